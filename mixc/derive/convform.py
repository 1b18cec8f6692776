"""The convolution form of a time-invariant recurrence (S4D, RetNet seen as a convolution).

A state whose transition does not depend on the token (a_t = a: fixed decays, a prefix sum)
unrolls to S_t = a^(t+1) S0 + sum_{s<=t} a^(t-s) key_s (x) value_s. Read out by a query q:

- when q and the key are the same at every token too (S4D: q = C, key = B_bar), the readout
  is a plain causal convolution of the value, r_t = sum_{s<=t} K_{t-s} value_s with the
  kernel K_j = sum over the key dims of q a^j key, computed from the params: the FFT form;
- otherwise (retention: q_t and k_s are per token) it is the parallel form: one chunk as
  long as the sequence, O = (Q K^T * D) V with the decay matrix D[t, s] = a^(t-s), s <= t.

mode="conv" runs it (runtime/conv_form.py); both must equal the recurrent form."""
from __future__ import annotations

from dataclasses import dataclass

from .. import classes
from . import plan as P
from .decay_sign import negative_decay

# mode="auto" takes the FFT form on the torch backend from this many tokens on (below it the
# chunked loop is as fast; see docs/kernels.md)
AUTO_MIN_T = 64


@dataclass(frozen=True)
class ConvForm:
    fft: bool                   # the FFT kernel form applies to every state
    why_not_fft: str | None     # otherwise why: the parallel (decay matrix) form runs


def _input_of(plan: P.Plan, e) -> str | None:
    leaves = plan.table.leaves(e, ("input",)) if e is not None else []
    return str(leaves[0]) if leaves else None


def _fft_blocker(plan: P.Plan) -> str | None:
    if plan.stabilizer is not None:
        return "the states carry a max-stabilizer"
    for st in plan.states:
        if not classes.unit(st.transition).conv_form:
            return f"state {st.name} is a {st.transition}"
        if st.key is None:
            return f"the input term of state {st.name} is not an outer product key (x) value"
        x = _input_of(plan, st.key)
        if x is not None:
            return f"the key of state {st.name} reads input {x}"
    for r in plan.output.readouts:
        for _, proj, _ in r.terms:       # a per-token scale multiplies after the convolution: it may vary
            x = _input_of(plan, proj)
            if x is not None:
                return f"the query of readout {r.name} reads input {x}"
    return None


_FORMS: dict[int, tuple] = {}      # id(plan) -> (plan kept alive, its ConvForm or None)


def conv_form(plan: P.Plan) -> ConvForm | None:
    """The convolution form of the plan, or None when its transition is not time-invariant.
    Found once per plan (a plain dict afterwards: every call of mode="conv" asks, and
    torch.compile can trace a dict lookup but not the sympy walk)."""
    hit = _FORMS.get(id(plan))
    if hit is None:
        hit = _FORMS[id(plan)] = (plan, _conv_form(plan))
    return hit[1]


def _conv_form(plan: P.Plan) -> ConvForm | None:
    if plan.sequence is not None or not all(st.time_invariant for st in plan.states) or \
            negative_decay(plan) is not None:
        return None            # a negative decay: a ** j from exp(j log a) is NaN (decay_sign.py)
    why = _fft_blocker(plan)
    return ConvForm(why is None, why)


def conv_form_lines(plan: P.Plan, text=str) -> list[str]:
    """What `mixc explain` prints about the convolution form (text: how to print a sympy expression)."""
    cf = conv_form(plan)
    if cf is None:
        return []
    out = ['convolution form (mode="conv"; every transition is time-invariant)']
    if cf.fft:
        for r in plan.output.readouts:
            st = plan.state(r.state)
            a = "1" if classes.unit(st.transition).decay_axis(st) is None else f"({text(st.decay)})"
            for scale, proj, over in r.terms:
                q = text(proj) if proj is not None else "1"
                lag = "j - 1" if r.prev else "j"
                over_txt = f"sum over {', '.join(over)} of " if over else ""
                out.append(f"  {r.name}: kernel K_j = {over_txt}({q}) * {a}^({lag}) * ({text(st.key)})"
                           + (" (K_0 = 0: prev() reads the state before the token)" if r.prev else "")
                           + (f", times ({text(scale)})" if scale != 1 else ""))
                out.append(f"    {r.name}_t = sum_{{s<=t}} K_{{t-s}} value_s with value = {text(st.value)}")
        out += ["  the kernel comes from the params alone (j = 0 .. T-1, a^j = exp(j log a)); the convolution is an "
                "FFT of size n = the next power of two >= 2T - 1, truncated to the first T outputs (a direct "
                "sum for T <= 64; a cumulative sum where a = 1)",
                "  initial state: + q . (a^(t+1) * S0); final state: a^T * S0 + sum_s a^(T-1-s) key (x) value_s",
                f'  mode="auto" takes this form on the torch backend (CPU without the interpreter) for T >= '
                f"{AUTO_MIN_T}"]
    else:
        out += [f"  the parallel form ({cf.why_not_fft}, so no fixed kernel): the whole sequence as one chunk,",
                "  O = (Q K^T * D) V + (Q * a^(t+1)) S0 with the decay matrix D[t, s] = a^(t-s) for s <= t, 0 above "
                "(RetNet's parallel retention; O(T^2) time and memory)",
                '  mode="auto" never takes it: the chunked form is cheaper for every T']
    return out

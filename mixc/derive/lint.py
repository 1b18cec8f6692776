"""A stability lint over a Plan: the places where a spec can overflow or divide by zero on
inputs it accepts, reported at the spec's line (`mixc check` prints them as warnings).

1. A log decay that is not provably <= 0 (a decay that can exceed 1): the recurrence then
   grows like exp(sum of log decays), and the chunked kernels' exp(b_i - b_j) of the
   cumulative sums overflows with it. fla's ops leave this to the caller (g = logsigmoid(..)
   in the model); the warning says so. A decay that is not provably >= 0 (tanh(g), -0.5,
   1 - 2 ** (head - 5)) has no real log: the chunked forms (kernels, the torch backend's,
   the convolution) refuse it (decay_sign.py, read by derive/layout.py and convform.py) and
   the recurrent kernels, which multiply by the decay itself, serve it.
2. An exponential in a state's input term that the max-stabilizer does not cover
   (derive/stabilize.py handles a scalar exp(x) gate shared by its states), or one in the
   output beside stabilized states that the output's scale does not cover.
3. A division in the output whose denominator is not provably nonzero (a normalizer
   q . z + eps with a feature map that can go negative)."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..dsl import ir
from ..dsl.errors import Span, SpecError
from . import plan as P
from .decay_sign import may_be_negative, nonpositive as _nonpositive


@dataclass(frozen=True)
class LintWarning:
    message: str
    span: Span | None

    def render(self, source) -> str:
        return SpecError(self.message, source, self.span).render().replace("error: ", "warning: ", 1)


def _exp_calls(e: ir.Expr | None) -> list[ir.Call]:
    if e is None:
        return []
    return [n for n in ir.walk(e) if isinstance(n, ir.Call) and n.fn == "exp"]


def lint(plan: P.Plan) -> list[LintWarning]:
    spec = plan.ir
    out = []
    stabilized = set(plan.stabilizer.states) if plan.stabilizer is not None else set()
    for st in plan.states:
        upd = spec.update(st.name)
        if may_be_negative(st.decay, plan.table):
            out.append(LintWarning(
                f"the decay of {st.name}, {sp.sstr(st.decay)}, can be negative (it is not provably >= 0): its log, "
                "which the chunked forms take, is not real, so mode='auto' takes the recurrent kernels, the torch "
                "backend its token-by-token loop, and mode='chunk' and mode='conv' refuse it; if the decay is meant to "
                "lie in [0, 1], write it so (sigmoid(x), exp(-softplus(x)), exp(g) with g <= 0)", upd.span))
        elif st.decay != 0 and not _nonpositive(st.log_decay, plan.table):
            out.append(LintWarning(
                f"the decay of {st.name} can exceed 1: its log, {sp.sstr(st.log_decay)}, is not provably <= 0, so "
                f"{st.name} can grow like exp(sum of log decays) and the chunked form's exp of cumulative sums "
                "overflows with it; pass log decays <= 0 (e.g. logsigmoid(x), -softplus(x), -exp(x) * dt), as "
                "fla's models do", upd.span))
        if st.name not in stabilized and st.ir_pieces is not None:
            calls = _exp_calls(st.ir_pieces.key) + _exp_calls(st.ir_pieces.value)
            if st.ir_pieces.key is None:
                calls = _exp_calls(upd.expr)
                calls = [c for c in calls if c not in _exp_calls(st.ir_pieces.decay)]
            if calls:
                out.append(LintWarning(
                    f"the input term of {st.name} takes an exponential that the max-stabilizer does not cover "
                    "(it covers one scalar exp(x) gate shared by its states): it overflows fp32 for arguments "
                    "above ~88", calls[0].span or upd.span))
    out += _unstabilized_output_exps(plan)
    _, den = sp.fraction(sp.together(plan.output.combine))
    if den.free_symbols and not (den.is_positive or den.is_negative):
        names = {str(s) for s in den.free_symbols}
        where = "; ".join(f"{r.name} = {_readout_text(r)}" for r in plan.output.readouts if r.name in names)
        out.append(LintWarning(
            f"the output divides by {sp.sstr(den)}{f' (where {where})' if where else ''}, which is not provably "
            "nonzero: keep it away from 0 (positive feature maps, an eps, or max(|.|, 1) as mLSTM does)",
            spec.output.span))
    return out


def _unstabilized_output_exps(plan: P.Plan) -> list[LintWarning]:
    """An exponential the output takes beside stabilized states that the output's scale does
    not cover. The stabilizer brings an exp(x) that a sum adds to a stabilized readout into the
    output's scale max(m, x) (RWKV-4's exp(u + k) in (prev(a) + exp(u + k) * v) / (prev(b) +
    exp(u + k)): derive/stabilize.output_exps); one that multiplies a readout's own term
    (prev(a) * exp(x)) or sits inside another function is evaluated as written and overflows
    for arguments above ~88."""
    if plan.stabilizer is None:
        return []
    covered = plan.stabilizer.output_exps
    inside = {id(n) for c in _exp_calls(plan.ir.output.expr) if c in covered for n in ir.walk(c.args[0])}
    calls = [c for c in _exp_calls(plan.ir.output.expr) if c not in covered and id(c) not in inside]
    if not calls:
        return []
    states = ", ".join(plan.stabilizer.states)
    return [LintWarning(
        f"the output takes an exponential beside the stabilized states ({states}) that the output's scale does "
        "not cover (it covers an exp(x) a sum adds to a readout of them, as in RWKV-4's (prev(a) + exp(u + k) * v) "
        "/ (prev(b) + exp(u + k)), not one that multiplies a readout or sits inside another function): it "
        "overflows fp32 for arguments above ~88; keep its argument below ~88, or write it as a term of the sum",
        calls[0].span or plan.ir.output.span)]


def _readout_text(r: P.ReadoutPlan) -> str:
    parts = []
    for scale, proj, over in r.terms:
        read = f"prev({r.state})" if r.prev else r.state
        term = f"{sp.sstr(proj)} @ {read}" if proj is not None else read
        parts.append(term if scale == 1 else f"{sp.sstr(scale)} * ({term})")
    return " + ".join(parts)

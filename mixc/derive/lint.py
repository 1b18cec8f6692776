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
   q . z + eps with a feature map that can go negative): bounded readout by readout, or
   proven as a sum over tokens of one polynomial (derive/token_sums.py: Based's Taylor
   normalizer). Both proofs take the states from zero (or from an earlier call's final
   state); an initial state passed from elsewhere can make any normalizer 0."""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp

from ..dsl import ir, scalar
from ..dsl.errors import Span, SpecError
from ..dsl.unparse import decl_text, expr_text
from . import plan as P
from .bounds import bounds, interval_product, lower_bound
from .decay_sign import may_be_negative, nonpositive as _nonpositive
from .symbolic import SymbolTable, ToSympy
from .token_sums import polynomial_sign, token_sum


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


# A quoted expression longer than this is shown by its place in the spec instead.
QUOTE_MAX = 80
# exp(x) with x provably <= this does not overflow fp32 (its limit is ~88.7).
EXP_SAFE = 80.0


def _quote(e: ir.Expr | None) -> str | None:
    """An expression as the user wrote it (lets by their names), or None where it is long."""
    if e is None:
        return None
    text = expr_text(e)
    return text if len(text) <= QUOTE_MAX else None


def lint(plan: P.Plan) -> list[LintWarning]:
    """The warnings of a plan, each once, in the user's names (the spec's inputs, params and
    lets, never the derivation's own symbols), each with what the user can do."""
    spec = plan.ir
    out = []
    stabilized = set(plan.stabilizer.states) if plan.stabilizer is not None else set()
    bounded = _ExpBounds(plan)
    unbounded: dict[ir.Expr, tuple] = {}       # exp's argument -> (where first, the states taking it)
    decays: dict[tuple, tuple] = {}            # (sign problem, the decay) -> (where first, the states, st)
    # the number options at their defaults, as `mixc check` takes the flags at theirs (lightning_attn's
    # per-head decay is <= 0 for layer_idx <= num_layers, true of the defaults)
    defaults = {s: v for s, (v, _) in _option_defaults(plan).items()}
    for st in plan.states:
        upd = spec.update(st.name)
        pieces = st.ir_pieces
        if may_be_negative(st.decay, plan.table):
            decays.setdefault(("negative", st.decay), (upd.span, [], st))[1].append(st.name)
        elif st.decay != 0 and not _nonpositive(st.log_decay, plan.table) and \
                not _nonpositive(st.log_decay.xreplace(defaults), plan.table):
            decays.setdefault(("above one", st.decay), (upd.span, [], st))[1].append(st.name)
        if st.name not in stabilized and pieces is not None:
            calls = _exp_calls(pieces.key) + _exp_calls(pieces.value)
            if pieces.key is None:
                calls = _exp_calls(upd.expr)
                calls = [c for c in calls if c not in _exp_calls(pieces.decay)]
            calls = [c for c in calls if not bounded.safe(c)]
            if calls:
                unbounded.setdefault(calls[0].args[0], (calls[0].span or upd.span, []))[1].append(st.name)
    for (problem, _), (span, names, st) in decays.items():     # one warning for a decay that states share
        out.append(LintWarning(_decay_message(plan, problem, names, st), span))
    for arg, (span, names) in unbounded.items():       # one warning for an exponential that states share
        text = _quote(arg)
        terms = f"the input term of {names[0]} takes" if len(names) == 1 else \
            f"the input terms of {', '.join(names)} take"
        out.append(LintWarning(
            f"{terms} an exponential that the max-stabilizer does not cover (it covers one scalar exp(x) gate "
            f"shared by its states): it overflows fp32 for arguments above ~88; if callers keep {text or 'its argument'}"
            f" below ~88, {_bound_hint(spec, arg)}", span))
    out += _unstabilized_output_exps(plan)
    _, den = sp.fraction(sp.together(plan.output.combine))
    if den.free_symbols and not (den.is_positive or den.is_negative) and not _nonzero(plan, den):
        divisor = _divisor(spec.output.expr)
        text = _quote(divisor)
        out.append(LintWarning(
            f"the output divides by {text or 'a value of the states'}, which is not provably nonzero: keep it away "
            "from 0 (positive feature maps, an eps, or max(|.|, 1) as mLSTM does)",
            (divisor.span if divisor is not None else None) or spec.output.span))
    return _once(out)


def _decay_message(plan: P.Plan, problem: str, names: list[str], st: P.StatePlan) -> str:
    pieces = st.ir_pieces
    states = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    the = f"the decay of {states}"
    if problem == "negative":
        decay = _quote(pieces.decay) if pieces is not None else None
        return (f"{the}{f', {decay},' if decay else ''} can be negative (it is not provably >= 0): its log, which "
                "the chunked forms take, is not real, so mode='auto' takes the recurrent kernels, the torch backend "
                "its token-by-token loop, and mode='chunk' and mode='conv' refuse it; if it lies in [0, 1] for the "
                f"values callers pass, {_declare_hint(plan, st.decay, 'nonnegative')}, or write it so (sigmoid(x), "
                "exp(-softplus(x)), exp(g) with g <= 0)")
    log = _quote(pieces.log_decay) if pieces is not None else None
    return (f"{the} can exceed 1: its log{f', {log},' if log else ''} is not provably <= 0, so {states} can grow "
            "like exp(sum of log decays) and the chunked form's exp of cumulative sums overflows with it; if callers "
            "keep it <= 0 (fla's models pass logsigmoid(x), -softplus(x), -exp(x) * dt), "
            f"{_declare_hint(plan, st.log_decay, 'nonpositive')}; else write the decay so that it is <= 1 "
            "(sigmoid(x), exp(-softplus(x)))")


def _nonzero(plan: P.Plan, den: sp.Expr) -> bool:
    """The output's denominator is provably away from 0: bounded over the declared ranges, the
    options at their defaults (as `mixc check` takes the flags) and each readout over its
    state's sign: a state whose decay and input term are >= 0 stays >= 0 from a zero (or
    nonnegative) initial state, as a normalizer z = z + phi(k) does."""
    table = plan.table
    known = _option_defaults(plan)
    signs = {st.name: _state_sign(st, table) for st in plan.states}
    positive = set()                # readouts > 0: of a state > 0, with factors > 0
    for r in plan.output.readouts:
        lo = hi = 0.0
        state, strict = signs[r.state]
        strict = strict and not r.prev          # S_{t-1} at t = 0 is the initial state: only >= 0
        for scale, proj, over in r.terms:
            term = interval_product(bounds(scale, table, known), state)
            strict = strict and _positive(scale, table, known)
            if proj is not None:
                term = interval_product(term, bounds(proj, table, known))
                strict = strict and _positive(proj, table, known)
            if over:                # a sum over dims: only the signs of its terms carry over
                term = (0.0 if term[0] >= 0 else -math.inf), (0.0 if term[1] <= 0 else math.inf)
            lo, hi = lo + term[0], hi + term[1]
        known[sp.Symbol(r.name, real=True)] = (lo, hi)
        if strict and r.terms:
            positive.add(sp.Symbol(r.name, real=True))
    lo, hi = bounds(den, table, known)
    if lo > 0 or hi < 0 or (lo >= 0 and _positive(den, table, known, positive)):
        return True
    return _positive_token_sum(plan, den, known) or _positive_token_sum(plan, -den, known)


def _positive_token_sum(plan: P.Plan, den: sp.Expr, known: dict) -> bool:
    """den > 0 as a sum over tokens j of w_tj P(t, j) + b with common weights w >= 0
    (derive/token_sums.py): P >= 0 for every value and b > 0, or P > 0, b >= 0 and the token's
    own term in the sum. Based's z0 + qs @ z1 + qq @ z2 / 2 + 1e-6 has P = 1 + s + s^2 / 2 > 0,
    s = scale q . k_j, which bounding each readout on its own cannot show."""
    try:
        form = token_sum(plan, den)
        sign = polynomial_sign(form.per_token) if form is not None else None
    except Exception:       # a form sympy's polynomial tools do not take: not proven (the warning stays)
        return False
    if sign is None:
        return False
    table = plan.table
    if bounds(form.rest, table, known)[0] >= 0 and _positive(form.rest, table, known):
        return True
    return sign == "positive" and not form.prev and bounds(form.rest, table, known)[0] >= 0


def _option_defaults(plan: P.Plan) -> dict:
    """{option symbol: (default, default)} for the number options whose default is a constant."""
    out = {}
    for o in plan.ir.options:
        if o.kind == "float":
            try:
                v = scalar.evaluate(o.default)
            except (scalar.NotConstant, scalar.ScalarError):
                continue
            out[sp.Symbol(o.name, real=True)] = (v, v)
    return out


def _positive(e: sp.Expr, table, known: dict, positive: set = frozenset()) -> bool:
    """e > 0 for every value (not just >= 0): exp, sigmoid and softplus of anything, a number
    > 0, a readout known > 0, a sum of terms >= 0 with one > 0, products and powers of such."""
    if e.is_positive or e in positive or type(e).__name__ in ("exp", "sigmoid", "softplus"):
        return True
    if e.is_Add:
        return all(bounds(a, table, known)[0] >= 0 for a in e.args) and \
            any(_positive(a, table, known, positive) for a in e.args)
    if e.is_Mul:
        return all(_positive(a, table, known, positive) for a in e.args)
    if e.is_Pow:
        return _positive(e.args[0], table, known, positive)
    return bounds(e, table, known)[0] > 0


def _state_sign(st: P.StatePlan, table) -> tuple[tuple[float, float], bool]:
    """The bounds of a state's values after each token from a zero or nonnegative initial
    state, and whether they are > 0 (a decay >= 0 and an input term > 0)."""
    if st.rank1 or lower_bound(st.decay, table) < 0:
        return (-math.inf, math.inf), False
    lo, hi = bounds(st.input_term, table)
    if lo >= 0:
        return (0.0, math.inf), _positive(st.input_term, table, {})
    if hi <= 0:
        return (-math.inf, 0.0), False
    return (-math.inf, math.inf), False


def _once(warnings: list[LintWarning]) -> list[LintWarning]:
    """Each warning once: two states with the same gate said the same thing twice."""
    seen, out = set(), []
    for w in warnings:
        key = (w.message, w.span)
        if key not in seen:
            seen.add(key)
            out.append(w)
    return out


def _divisor(e: ir.Expr) -> ir.Expr | None:
    """The first denominator of the output that reads a state, as written."""
    for node in ir.walk(e):
        if isinstance(node, ir.BinOp) and node.op == "/" and ir.refs(node.right, "state"):
            return node.right
    return None


def _declare_hint(plan: P.Plan, expr: sp.Expr, want: str) -> str:
    """What to declare so that expr is provably <= 0 (want 'nonpositive') or >= 0: a range on
    the one input or param that decides its sign (`input g[K] in [-inf, 0]`), else on the
    inputs and params it reads."""
    table = plan.table
    free = [x for x in table.leaves(expr) if _declared(plan.ir, x.name) is None]
    if not free:
        options = sorted({str(x) for x in expr.free_symbols if table.kinds.get(x) == "option"})
        if options:
            return f"pass values of {', '.join(options)} that keep it so (the prover takes options as any number)"
        return "write it so that its sign follows from its form"
    factors = sp.Mul.make_args(expr)
    sign_of_rest = None
    if len(factors) == 1 and factors[0] in free:
        target, sign_of_rest = factors[0], 1
    else:
        undecided = [f for f in factors if f in free]
        rest = [f for f in factors if f not in undecided]
        target = undecided[0] if len(undecided) == 1 else None
        if target is not None:
            lo, hi = bounds(sp.Mul(*rest), table)
            sign_of_rest = 1 if lo >= 0 else -1 if hi <= 0 else None
    if target is not None and sign_of_rest is not None:
        negative = (want == "nonpositive") == (sign_of_rest > 0)
        decl = _declared_decl(plan.ir, target.name)
        kind = table.kinds[target]
        shape = "[" + ", ".join(decl.shape) + "]"
        return f"declare it: `{kind} {target.name}{shape} in {'[-inf, 0]' if negative else '[0, inf)'}`"
    # a value read only through a bounded function (sigmoid(fz), tanh(x)) decides nothing
    bounded = {f: sp.Dummy() for f in expr.atoms(sp.Function) if type(f).__name__ in ("sigmoid", "tanh")}
    deciding = [x for x in free if x in expr.xreplace(bounded).free_symbols] or free
    names = ", ".join(x.name for x in deciding)
    return (f"declare the ranges of {names} that make it {'<= 0' if want == 'nonpositive' else '>= 0'} "
            "(`in [-inf, 0]`, `in [0, inf)`, `in [0, 1]`)")


def _bound_hint(m: ir.MixerIR, arg: ir.Expr) -> str:
    """What to declare so that exp(arg) provably stays finite."""
    if isinstance(arg, ir.Ref) and arg.kind in ("input", "param"):
        return f"declare it: `{arg.kind} {decl_text(_declared_decl(m, arg.name))} in (-inf, 80]`"
    names = sorted(ir.refs(arg, "input") | ir.refs(arg, "param"))
    return (f"declare the ranges of {', '.join(names)} that keep it there (`in [-10, 10]`)" if names
            else "write it so that it stays below ~88")


def _declared_decl(m: ir.MixerIR, name: str) -> ir.TensorDecl:
    return next(d for d in (*m.inputs, *m.params) if d.name == name)


def _declared(m: ir.MixerIR, name: str):
    return _declared_decl(m, name).range


class _ExpBounds:
    """Whether an exp(x) of the spec cannot overflow: x provably <= EXP_SAFE over the declared
    ranges (hgrn2's 1 - exp(g) with g <= 0)."""

    def __init__(self, plan: P.Plan):
        self.table = SymbolTable(plan.ir)
        self.conv = ToSympy(self.table, inline_lets=True)

    def safe(self, call: ir.Call) -> bool:
        try:
            x = self.conv(call.args[0])
        except Exception:           # a construct the converter does not take: warn as before
            return False
        return bounds(x, self.table)[1] <= EXP_SAFE


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

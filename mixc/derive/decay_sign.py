"""Signs of a state's decay and its log, decided for every value of the inputs a spec accepts.
The chunked forms (the kernels, the torch backend's chunked form, the convolution) work with
log a_t: a decay that can be negative (tanh(g), 0 - 0.5, 1 - 2 ** (head - 5)) has no real log
and gave NaN there, so derive/layout.py and convform.py refuse those forms for it (the
recurrent kernels and the torch backend's token loop multiply by the decay itself), and the
lint (lint.py) says why. Plain functions of sympy expressions and a plan read by attribute:
derive/plan.py imports layout.py, which imports this, so nothing here imports plan.py."""
from __future__ import annotations

import sympy as sp

from .bounds import lower_bound, upper_bound
from .functions import float_value


def nonpositive(expr: sp.Expr, table) -> bool:
    """expr <= 0 for every value of its inputs and params: by sympy's assumptions, by its bounds
    over the inputs' declared ranges (bounds.py), or, for an expression of the head index and
    dims only (or none), in floats at heads 0..63 and the dims at 1..4096. Floats, not sympy's
    numbers: `1e308 ** (-5 - head)` at head 4096 as an exact number never finished, and
    `log(max(0.5, 0.9)) <= 0` is no bool to sympy."""
    if expr.is_nonpositive or upper_bound(expr, table) <= 0:
        return True
    free = expr.free_symbols
    if not all(table.kinds.get(s) in ("head", "dim") for s in free):
        return False
    for value in ((0, 1, 2, 7, 31, 63, 4096) if free else (0,)):
        v = float_value(expr, {s: value for s in free})
        if v is None or v > 0:          # no real value (a decay <= 0) or above 0: not provable
            return False
    return True


def may_be_negative(decay: sp.Expr, table) -> bool:
    """decay < 0 for some real values of its inputs, params and options (or undecided). Every
    symbol is taken as real, and exp(x) as >= 0 whatever x (exp(8 * head / num_heads) is not
    provably finite to sympy); inputs and params over their declared ranges (bounds.py)."""
    if decay == 0 or lower_bound(decay, table) >= 0:
        return False
    real = {s: sp.Dummy(s.name, real=True) for s in decay.free_symbols if not s.is_real}
    return not (_nonnegative_form(decay.xreplace(real)) or nonpositive(-decay, table))


def _nonnegative_form(e: sp.Expr) -> bool:
    if e.is_nonnegative or isinstance(e, sp.exp):
        return True
    if e.is_Mul or e.is_Add:
        return all(_nonnegative_form(a) for a in e.args)
    if e.is_Pow:
        return _nonnegative_form(e.args[0]) or (e.args[1].is_integer and e.args[1].is_even) is True
    return False


def negative_decay(plan) -> str | None:
    """Why the log-space forms cannot take this plan's decays: the first state whose decay is
    not provably >= 0, in words with its place in the spec (file:line:column); None when every
    decay is."""
    for st in plan.states:
        if may_be_negative(st.decay, plan.table):
            span = plan.ir.update(st.name).span
            where = f" ({getattr(plan.ir.source, 'filename', None) or plan.ir.name}:{span.line}:{span.column})" \
                if span else ""
            return (f"the decay of {st.name}, {sp.sstr(st.decay)}{where}, is not provably >= 0: a negative decay has "
                    "no real log, which the chunked forms take (the recurrent kernels multiply by the decay itself)")
    return None

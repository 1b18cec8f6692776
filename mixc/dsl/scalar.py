"""Scalar expressions of numbers, dims and options, evaluated in plain Python floats.

One evaluator for every place that needs a number before any tensor exists: the checker folds
the constant parts of a spec (`0 ** (0 - 1)`, `log(0)`, `10 ** 10 ** 10`) and refuses the ones
that are not finite real numbers at their place; the runtime evaluates option defaults and a
window once the dims are bound (mixc/runtime/signature.py), and says which option fails.

Only the operator of a node is evaluated (never all of them at once), and every step is
checked: a division by zero, a result past float64's range, or a value that is not real
(a negative number to a fractional power, the log or sqrt of a negative number) raises
ScalarError naming the node that produced it."""
from __future__ import annotations

import math

from . import functions, ir


class ScalarError(ValueError):
    """`node` has no finite real value; `reason` says why, as words that follow the node's text
    ('divides by zero', 'is not a real number', ...)."""

    def __init__(self, node: ir.Expr, reason: str):
        super().__init__(reason)
        self.node = node
        self.reason = reason


class NotConstant(Exception):
    """The expression reads something that has no value here (an input, a dim not bound)."""


def _function(name: str):
    """The registry's float64 evaluator, refusing first where the function has no finite real
    value (the log of 0, the square root of a negative number) with the registry's words."""
    value = functions.python_callable(name)

    def checked(x: float) -> float:
        why = functions.undefined_at(name, x)
        if why is not None:
            raise _Domain(why)
        return value(x)
    return checked


FUNCTIONS = {name: _function(name) for name in functions.FUNCTIONS}


class _Domain(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _power(a: float, b: float) -> float:
    if a == 0 and b < 0:
        raise _Domain("divides by zero (0 to a negative power)")
    if a < 0 and not float(b).is_integer():
        raise _Domain("is not a real number (a negative number to a fractional power)")
    return math.pow(a, b)


def _divide(a: float, b: float) -> float:
    if b == 0:
        raise _Domain("divides by zero")
    return a / b


_BINOPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": _divide, "**": _power}


def apply(e: ir.Expr, args: list[float]) -> float:
    """The value of node e from the values of its children (Num, Neg, BinOp, Call)."""
    try:
        if isinstance(e, ir.Num):
            v = e.value
        elif isinstance(e, ir.Neg):
            v = -args[0]
        elif isinstance(e, ir.BinOp):
            v = _BINOPS[e.op](args[0], args[1])
        elif isinstance(e, ir.Call) and e.fn in ("max", "min"):
            v = (max if e.fn == "max" else min)(args)
        elif isinstance(e, ir.Call) and e.fn in FUNCTIONS:
            v = FUNCTIONS[e.fn](args[0])
        else:
            raise NotConstant(type(e).__name__)
    except _Domain as err:
        raise ScalarError(e, err.reason) from None
    except OverflowError:
        raise ScalarError(e, "is too large for a float (past 1.8e308)") from None
    except ZeroDivisionError:       # what the checks above miss, say 0.0 ** -inf
        raise ScalarError(e, "divides by zero") from None
    if isinstance(v, complex):
        raise ScalarError(e, "is not a real number")
    # comparisons, not math.isnan / isinf: under torch.compile(dynamic=True) a dim is a symbolic
    # int, which comparisons guard on and math's tests refuse
    if v != v:
        raise ScalarError(e, "is not a number (NaN)")
    if v == math.inf or v == -math.inf:
        raise ScalarError(e, "is too large for a float (past 1.8e308)")
    return float(v)


def evaluate(e: ir.Expr, sizes: dict[str, int] | None = None, values: dict[str, float] | None = None,
             flags: dict[str, bool] | None = None) -> float:
    """The value of a scalar expression of numbers, dims (sizes), number options (values) and
    flags (for if-then-else). Raises ScalarError at the first node without a finite real
    value, NotConstant when e reads anything else."""
    sizes, values, flags = sizes or {}, values or {}, flags or {}
    if isinstance(e, ir.Ref):
        if e.kind == "dim" and e.name in sizes:
            return float(sizes[e.name])
        if e.kind == "option" and e.name in values:
            return float(values[e.name])
        raise NotConstant(e.name)
    if isinstance(e, ir.Cond):
        if e.flag not in flags:
            raise NotConstant(e.flag)
        return evaluate(e.then if flags[e.flag] else e.otherwise, sizes, values, flags)
    return apply(e, [evaluate(c, sizes, values, flags) for c in ir.children(e)])

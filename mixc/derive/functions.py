"""Sympy functions for the spec language's built-ins that sympy lacks, with their derivatives,
and the log rewriting that turns a decay into its log-space form."""
from __future__ import annotations

import math

import sympy as sp


class sigmoid(sp.Function):
    def fdiff(self, argindex=1):
        return sigmoid(self.args[0]) * (1 - sigmoid(self.args[0]))

    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sp.Rational(1, 2)

    def _eval_rewrite_as_exp(self, x, **kw):
        return 1 / (1 + sp.exp(-x))

    def _eval_is_positive(self):
        return True if self.args[0].is_real else None


class logsigmoid(sp.Function):
    def fdiff(self, argindex=1):
        return sigmoid(-self.args[0])

    def _eval_is_nonpositive(self):
        return True if self.args[0].is_real else None

    def _eval_rewrite_as_exp(self, x, **kw):
        return -sp.log(1 + sp.exp(-x))


class softplus(sp.Function):
    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, x, **kw):
        return sp.log(1 + sp.exp(x))

    def _eval_is_positive(self):
        return True if self.args[0].is_real else None


class relu(sp.Function):
    def fdiff(self, argindex=1):
        return step(self.args[0])


class step(sp.Function):
    """1 where x > 0, else 0: the derivative of relu (0 at 0, as torch)."""

    def fdiff(self, argindex=1):
        return sp.S.Zero


class elu(sp.Function):
    def fdiff(self, argindex=1):
        x = self.args[0]
        return step(x) + (1 - step(x)) * sp.exp(x)


class silu(sp.Function):
    def fdiff(self, argindex=1):
        x = self.args[0]
        return sigmoid(x) * (1 + x * (1 - sigmoid(x)))


class geq(sp.Function):
    """1 where a >= b else 0 (the derivative of maximum(a, b) in a; ties go to a)."""

    def fdiff(self, argindex=1):
        return sp.S.Zero


class maximum(sp.Function):
    """max(a, b), never evaluated symbolically: sympy's Max would compare its arguments and
    fails on ones it cannot order (softplus(0), sqrt(-1))."""

    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return geq(a, b) if argindex == 1 else 1 - geq(a, b)

    def _eval_is_positive(self):        # max(a, b) > 0 when either is (the lint's normalizers)
        return True if any(x.is_positive for x in self.args) else None


class minimum(sp.Function):
    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return geq(b, a) if argindex == 1 else 1 - geq(b, a)


SYMPY_FUNCTIONS = {
    "exp": sp.exp, "log": sp.log, "sqrt": sp.sqrt, "tanh": sp.tanh, "abs": sp.Abs,
    "sigmoid": sigmoid, "logsigmoid": logsigmoid, "softplus": softplus, "elu": elu,
    "relu": relu, "silu": silu,
}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


# The functions above in plain floats, by the names sympy prints them with (for lambdify):
# the lint evaluates decays numerically where sympy's assumptions cannot decide.
FLOAT_FUNCTIONS = {
    "sigmoid": _sigmoid,
    "logsigmoid": lambda x: min(x, 0.0) - math.log1p(math.exp(-abs(x))),
    "softplus": lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x))),
    "relu": lambda x: max(x, 0.0), "step": lambda x: 1.0 if x > 0 else 0.0,
    "elu": lambda x: x if x > 0 else math.expm1(x), "silu": lambda x: x * _sigmoid(x),
    "geq": lambda a, b: 1.0 if a >= b else 0.0, "maximum": max, "minimum": min,
}


def float_value(expr: sp.Expr, values: dict | None = None) -> float | None:
    """expr as a float, its free symbols set to `values`; None where it has no finite real
    value there (a log of 0, an overflow) or is not made of known functions."""
    symbols = sorted(expr.free_symbols, key=str)
    values = values or {}
    if any(s not in values for s in symbols):
        return None
    try:
        f = sp.lambdify(symbols, expr, modules=[FLOAT_FUNCTIONS, "math"])
        v = f(*[float(values[s]) for s in symbols])
    except (ArithmeticError, ValueError, TypeError, NameError):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def log_of(expr: sp.Expr) -> sp.Expr:
    """log(expr) rewritten so that no exp is taken first: log(exp(x)) -> x,
    log(sigmoid(g) ** p) -> p * logsigmoid(g), log(a * b) -> log(a) + log(b)."""
    if expr.is_Mul:
        return sp.Add(*[log_of(f) for f in expr.args])
    if expr.is_Pow:
        base, e = expr.args
        if base is sp.E:
            return e
        return e * log_of(base)
    if isinstance(expr, sp.exp):
        return expr.args[0]
    if isinstance(expr, sigmoid):
        return logsigmoid(expr.args[0])
    if expr == 1:
        return sp.S.Zero
    if expr.is_Number and expr.is_positive:
        return sp.log(expr)
    return sp.log(expr)

"""Sympy functions for the spec language's built-ins (built from the registry,
mixc/dsl/functions.py, where sympy lacks one), the derivation's own (step, geq, maximum,
minimum), and the log rewriting that turns a decay into its log-space form."""
from __future__ import annotations

import functools
import math

import sympy as sp

from ..dsl import functions as registry


class step(sp.Function):
    """1 where x > 0, else 0: the derivative of relu (0 at 0, as torch)."""

    def fdiff(self, argindex=1):
        return sp.S.Zero


_X = sp.Symbol("x", real=True)


def _spec_function(f: registry.Function) -> type[sp.Function]:
    """The sympy function of a registry entry without one of sympy's own: its derivative, its
    form in exp (rewrite(exp)), its sign and its value at 0 from the entry's text."""
    def fdiff(self, argindex=1):
        return _derivative(f.name).subs(_X, self.args[0])

    def at_zero(cls, x):
        if f.at_zero is not None and x.is_zero:
            return sp.sympify(f.at_zero)

    attrs = {"fdiff": fdiff, "eval": classmethod(at_zero), "__doc__": f.doc, "__module__": __name__}
    if f.rewrite_exp is not None:
        attrs["_eval_rewrite_as_exp"] = lambda self, x, **kw: _parse(f.rewrite_exp).subs(_X, x)
    if f.sign is not None:
        attrs[f"_eval_is_{f.sign}"] = lambda self: True if self.args[0].is_real else None
    return type(f.name, (sp.Function,), attrs)


SYMPY_FUNCTIONS = {name: getattr(sp, f.sympy) if f.sympy else _spec_function(f)
                   for name, f in registry.FUNCTIONS.items()}


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> sp.Expr:
    """Registry text as sympy, the registry's names its functions (x real)."""
    names = {name: fn for name, fn in SYMPY_FUNCTIONS.items() if not registry.FUNCTIONS[name].sympy}
    return sp.sympify(text, locals=names | {"step": step, "x": _X})


@functools.lru_cache(maxsize=None)
def _derivative(name: str) -> sp.Expr:
    return _parse(registry.FUNCTIONS[name].derivative)


# Module attributes by their names, as sympy prints them (pickle finds them here); the
# derivation names a few itself (log rewriting, the lint, the stabilizer).
globals().update({name: fn for name, fn in SYMPY_FUNCTIONS.items() if not registry.FUNCTIONS[name].sympy})
sigmoid, logsigmoid, softplus = SYMPY_FUNCTIONS["sigmoid"], SYMPY_FUNCTIONS["logsigmoid"], SYMPY_FUNCTIONS["softplus"]
relu, elu, silu = SYMPY_FUNCTIONS["relu"], SYMPY_FUNCTIONS["elu"], SYMPY_FUNCTIONS["silu"]


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


# The functions in plain floats, by the names sympy prints them with (for lambdify): the
# registry's evaluators and the derivation's own. The lint evaluates decays numerically where
# sympy's assumptions cannot decide.
FLOAT_FUNCTIONS = {name: registry.python_callable(name) for name in registry.FUNCTIONS} | {
    "step": lambda x: 1.0 if x > 0 else 0.0,
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

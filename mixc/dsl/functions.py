"""The spec language's elementwise functions, one entry each: everything a stage needs of a
function is here, as text, and each stage builds its own form from it:

    dsl/check.py        the names and arity (a call's check)
    dsl/scalar.py       `python` and `undefined`: constant folding, option defaults
    derive/functions.py `sympy` or (`derivative`, `rewrite_exp`, `sign`, `at_zero`): the sympy
                        function; `python` again for the lint's float evaluation
    codegen/triton_expr.py, codegen/adjoint.py   `triton`, `triton_derivative`
    codegen/torch_expr.py, runtime/reference.py  `torch` (autograd differentiates it)
    codegen/module.py -> standalone/support.py   `python`, carried in a compiled module's
                        METADATA for the option defaults that call a function

Adding a function is one entry in FUNCTIONS; tests/dsl/test_functions.py walks the registry
and checks every entry numerically (the derivatives against float64 finite differences, the
Triton, torch and float64 forms against each other) and that docs/language.md names it.

This module is data: importing it loads neither sympy nor torch (the forms are strings; the
callables are built on first use)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Function:
    """One elementwise function of one argument x.

    python            its float64 value, a Python expression in x over `math`
    triton            its Triton code, `{x}` the argument's variable (fp32)
    torch             its torch code, `{x}` the argument's tensor; `torch` and `_F`
                      (torch.nn.functional) are in scope; autograd gives its gradient
    derivative        d/dx as sympy text in x: the other functions of this registry by name,
                      `step(x)` the indicator of x > 0, sympy's own (exp, erf, sqrt, pi, ...)
    triton_derivative d/dx as Triton code, `{x}` the argument and `{y}` the function's value
    sympy             the name of sympy's own function when it has one (exp, log, Abs): then
                      sympy's function is used and the fields below are not needed
    rewrite_exp       the function in exp and log (sympy text in x), for sympy's rewrite(exp)
    sign              "positive" or "nonpositive" for every real x: what the lint can prove
    at_zero           its value at 0 (sympy text), evaluated symbolically
    undefined         (Python condition in x, why) where it has no finite real value; the
                      reason reads after the expression's text: "log(0) is minus infinity ..."
    domain            the interval the tests draw points from (where it is finite and smooth)
    doc               one line for docs/language.md
    """

    name: str
    python: str
    triton: str
    torch: str
    derivative: str
    triton_derivative: str
    doc: str
    sympy: str | None = None
    rewrite_exp: str | None = None
    sign: str | None = None
    at_zero: str | None = None
    undefined: tuple[tuple[str, str], ...] = ()
    domain: tuple[float, float] = (-4.0, 4.0)
    arity: int = 1      # every function is unary; max and min (two values or a reduction) are the checker's

    def __post_init__(self):
        assert self.arity == 1, "the stages splice one argument ({x}) into every form"
        assert self.sign in (None, "positive", "nonpositive"), self.sign


_SIGMOID_PY = "1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))"

_ENTRIES = (
    Function("exp", "math.exp(x)", "tl.exp({x})", "torch.exp({x})", "exp(x)", "{y}",
             "e to the x", sympy="exp"),
    Function("log", "math.log(x)", "tl.log({x})", "torch.log({x})", "1/x", "1.0 / {x}",
             "natural logarithm, x > 0", sympy="log",
             undefined=(("x == 0", "is minus infinity (the log of 0)"),
                        ("x < 0", "is not a real number (the log of a negative number)")),
             domain=(0.05, 6.0)),
    Function("sqrt", "math.sqrt(x)", "tl.sqrt({x})", "torch.sqrt({x})", "1/(2*sqrt(x))", "0.5 / {y}",
             "square root, x >= 0", sympy="sqrt",
             undefined=(("x < 0", "is not a real number (the square root of a negative number)"),),
             domain=(0.05, 6.0)),
    Function("abs", "abs(x)", "tl.abs({x})", "torch.abs({x})", "sign(x)",
             "tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))", "absolute value (gradient 0 at 0)", sympy="Abs"),
    Function("tanh", "math.tanh(x)", "2.0 * tl.sigmoid(2.0 * {x}) - 1.0", "torch.tanh({x})",
             "1 - tanh(x)**2", "1.0 - {y} * {y}", "hyperbolic tangent", sympy="tanh"),
    Function("sigmoid", _SIGMOID_PY, "tl.sigmoid({x})", "torch.sigmoid({x})",
             "sigmoid(x)*(1 - sigmoid(x))", "{y} * (1.0 - {y})", "1 / (1 + exp(-x))",
             rewrite_exp="1/(1 + exp(-x))", sign="positive", at_zero="1/2"),
    Function("logsigmoid", "min(x, 0.0) - math.log1p(math.exp(-abs(x)))",
             "tl.minimum({x}, 0.0) - tl.log(1.0 + tl.exp(-tl.abs({x})))", "_F.logsigmoid({x})",
             "sigmoid(-x)", "1.0 - tl.sigmoid({x})", "log(sigmoid(x)), without overflow",
             rewrite_exp="-log(1 + exp(-x))", sign="nonpositive"),
    Function("softplus", "max(x, 0.0) + math.log1p(math.exp(-abs(x)))",
             "tl.maximum({x}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({x})))", "_F.softplus({x})",
             "sigmoid(x)", "tl.sigmoid({x})", "log(1 + exp(x)), without overflow",
             rewrite_exp="log(1 + exp(x))", sign="positive"),
    Function("elu", "x if x > 0 else math.expm1(x)", "tl.where({x} > 0, {x}, tl.exp(tl.minimum({x}, 0.0)) - 1.0)",
             "_F.elu({x})", "step(x) + (1 - step(x))*exp(x)", "tl.where({x} > 0, 1.0, {y} + 1.0)",
             "x for x > 0, exp(x) - 1 else (alpha 1)"),
    Function("relu", "max(x, 0.0)", "tl.maximum({x}, 0.0)", "torch.relu({x})", "step(x)",
             "tl.where({x} > 0, 1.0, 0.0)", "max(x, 0) (gradient 0 at 0)"),
    Function("silu", "x * (" + _SIGMOID_PY + ")", "{x} * tl.sigmoid({x})", "_F.silu({x})",
             "sigmoid(x)*(1 + x*(1 - sigmoid(x)))",
             "tl.sigmoid({x}) * (1.0 + {x} * (1.0 - tl.sigmoid({x})))", "x * sigmoid(x) (swish)"),
    # torch.nn.functional.gelu's default: the exact form with erf (not the tanh approximation)
    Function("gelu", "0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))",
             "0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", "_F.gelu({x})",
             "(1 + erf(x/sqrt(2)))/2 + x*exp(-x**2/2)/sqrt(2*pi)",
             "0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)) + {x} * tl.exp(-0.5 * {x} * {x}) * 0.3989422804014327",
             "x * Phi(x), Phi the normal CDF (erf form, as torch.nn.functional.gelu)", at_zero="0"),
)

FUNCTIONS: dict[str, Function] = {f.name: f for f in _ENTRIES}


@functools.lru_cache(maxsize=None)
def python_callable(name: str):
    """The float64 evaluator of `name` (math only): a function of one float."""
    return eval(f"lambda x: {FUNCTIONS[name].python}", {"math": math})  # noqa: S307 (registry text)


@functools.lru_cache(maxsize=None)
def torch_callable(name: str):
    """`name` over torch tensors (imports torch on first use)."""
    import torch                    # lazy: importing the spec language stays free of torch
    import torch.nn.functional as F
    return eval(f"lambda x: {FUNCTIONS[name].torch.format(x='x')}", {"torch": torch, "_F": F})  # noqa: S307


@functools.lru_cache(maxsize=None)
def _condition(cond: str):
    return eval(f"lambda x: {cond}", {"math": math})  # noqa: S307 (registry text)


def undefined_at(name: str, x: float) -> str | None:
    """Why `name` has no finite real value at x (words that follow the call's text), or None."""
    return next((why for cond, why in FUNCTIONS[name].undefined if _condition(cond)(x)), None)

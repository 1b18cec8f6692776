"""Derived sympy expressions -> callables over torch tensors (through sympy.lambdify with
our function table). test_plan_numeric.py checks the derivation numerically with it (a test
helper: it was mixc/codegen/torch_printer.py; the torch backend prints its own code,
mixc/codegen/torch_expr.py)."""
from __future__ import annotations

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter
import torch

from mixc.dsl.functions import FUNCTIONS, torch_callable

# The spec language's functions (the registry, by the names sympy prints them with), then the
# ones that derivatives and the derivation bring in.
TORCH_FUNCTIONS = {f.sympy or name: torch_callable(name) for name, f in FUNCTIONS.items()} | {
    "sign": torch.sign, "erf": torch.erf,
    "step": lambda x: (x > 0).to(x.dtype),
    "Heaviside": lambda x, h0=0.5: torch.where(x > 0, 1.0, torch.where(x < 0, 0.0, h0)).to(x.dtype),
    "Max": lambda *a: _fold(torch.maximum, a), "Min": lambda *a: _fold(torch.minimum, a),
    "maximum": lambda *a: _fold(torch.maximum, a), "minimum": lambda *a: _fold(torch.minimum, a),
    "geq": lambda a, b: (torch.as_tensor(a) >= torch.as_tensor(b)).to(torch.float64),
}


def _fold(fn, args):
    """max/min of several arguments, numbers taking the dtype of the tensors."""
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), torch.float64)
    out = torch.as_tensor(args[0], dtype=dtype)
    for a in args[1:]:
        out = fn(out, torch.as_tensor(a, dtype=dtype))
    return out


class TorchCallPrinter(PythonCodePrinter):
    """Prints every function as a plain call NAME(args) resolved in TORCH_FUNCTIONS (sympy's
    Python printer would inline sign, Max or Heaviside as scalar if-expressions)."""

    def _call(self, expr):
        name = type(expr).__name__
        if name not in TORCH_FUNCTIONS:
            raise NotImplementedError(f"no torch function for {name}")
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    _print_Function = _call
    _print_sign = _call
    _print_Heaviside = _call
    _print_Max = _call
    _print_Min = _call
    _print_Abs = _call
    _print_exp = _call
    _print_log = _call
    _print_tanh = _call
    _print_erf = _call

    def _print_Pow(self, expr, rational=False):
        base, e = expr.args
        if e == sp.S.Half:
            return f"sqrt({self._print(base)})"
        if e == -sp.S.Half:
            return f"(1/sqrt({self._print(base)}))"
        return f"({self._print(base)})**({self._print(e)})"


def torch_callable(expr: sp.Expr, symbols: list[sp.Symbol]):
    """f(*tensors) computing expr; symbols are the arguments in order."""
    return sp.lambdify(symbols, expr, modules=[TORCH_FUNCTIONS, "math"], printer=TorchCallPrinter,
                       dummify=True)

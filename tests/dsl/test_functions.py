"""The registry of elementwise functions (mixc/dsl/functions.py), walked entry by entry: every
function's derivatives (the sympy one the derivation uses, the Triton one the backward kernels
use) against float64 finite differences, its Triton, torch and sympy forms against its float64
evaluator, its claims (sign, value at 0, form in exp), and docs/language.md's list of it. A
function added to the registry is checked here with no test of its own."""
from __future__ import annotations

import importlib.util
import math
import random
import re
from pathlib import Path

import pytest
import sympy as sp
import torch

from mixc.derive import functions as symbolic
from mixc.dsl import functions as registry
from mixc.dsl.functions import FUNCTIONS

NAMES = sorted(FUNCTIONS)
DOC = Path(__file__).resolve().parents[2] / "docs" / "language.md"
H = 1e-6


def _points(name: str, n: int = 24, seed: int = 0) -> list[float]:
    """Random points in the function's domain, away from 0 (abs, relu and elu have a kink
    there, and a central difference across it is no derivative)."""
    lo, hi = FUNCTIONS[name].domain
    rng = random.Random(f"{name}-{seed}")
    out = []
    while len(out) < n:
        x = rng.uniform(lo, hi)
        if abs(x) > 10 * H + 1e-3:
            out.append(x)
    return out


def _finite_difference(name: str, x: float) -> float:
    f = registry.python_callable(name)
    return (f(x + H) - f(x - H)) / (2 * H)


def _sympy_value(expr: sp.Expr, x: float) -> float:
    return float(sp.lambdify(symbolic._X, expr, modules=[symbolic.FLOAT_FUNCTIONS, "math"])(x))


@pytest.mark.parametrize("name", NAMES)
def test_sympy_derivative_matches_finite_differences(name):
    """sympy's derivative of the function (its own, or the registry's `derivative` through
    fdiff) is the float64 evaluator's slope at random points of its domain."""
    f = symbolic.SYMPY_FUNCTIONS[name]
    d = sp.diff(f(symbolic._X), symbolic._X)
    written = symbolic._parse(FUNCTIONS[name].derivative)      # the registry's text, also for sympy's own
    for x in _points(name):
        fd = _finite_difference(name, x)
        assert _sympy_value(d, x) == pytest.approx(fd, rel=1e-6, abs=1e-8), (name, x)
        assert _sympy_value(written, x) == pytest.approx(fd, rel=1e-6, abs=1e-8), (name, x)


@pytest.mark.parametrize("name", NAMES)
def test_sympy_and_torch_forms_match_the_float64_evaluator(name):
    f, entry = registry.python_callable(name), FUNCTIONS[name]
    xs = _points(name)
    want = torch.tensor([f(x) for x in xs], dtype=torch.float64)
    got = registry.torch_callable(name)(torch.tensor(xs, dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # autograd through the torch form: the finite differences too
    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    registry.torch_callable(name)(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([_finite_difference(name, v) for v in xs], dtype=torch.float64),
                               rtol=1e-6, atol=1e-8)
    sym = symbolic.SYMPY_FUNCTIONS[name](symbolic._X)
    for v in xs[:6]:
        assert _sympy_value(sym, v) == pytest.approx(f(v), rel=1e-12, abs=1e-14)
        if entry.rewrite_exp is not None:
            assert _sympy_value(sym.rewrite(sp.exp), v) == pytest.approx(f(v), rel=1e-9)
        if entry.sign == "positive":
            assert f(v) > 0 and sym.is_positive
        if entry.sign == "nonpositive":
            assert f(v) <= 0 and sym.is_nonpositive
    if entry.at_zero is not None:
        assert float(symbolic.SYMPY_FUNCTIONS[name](sp.S.Zero)) == pytest.approx(f(0.0), abs=1e-15)


def _kernel_source() -> str:
    """One @triton.jit kernel that writes every function's value and Triton derivative at the
    points X[i, :] to Y[i, :] and D[i, :], row i the i-th function of NAMES."""
    body = []
    for i, name in enumerate(NAMES):
        f = FUNCTIONS[name]
        body += [f"    x{i} = tl.load(X + {i} * N + o)",
                 f"    y{i} = {f.triton.format(x=f'x{i}')}",
                 f"    tl.store(Y + {i} * N + o, y{i})",
                 f"    tl.store(D + {i} * N + o, {f.triton_derivative.format(x=f'x{i}', y=f'y{i}')})"]
    return ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
            "def every_function(X, Y, D, N: tl.constexpr):\n    o = tl.arange(0, N)\n" + "\n".join(body) + "\n")


def test_triton_forms_match_the_float64_evaluator(tmp_path):
    """One launch of one kernel under the interpreter: every function's Triton form against its
    float64 evaluator and its Triton derivative against finite differences (fp32 tolerance)."""
    path = tmp_path / "every_function.py"
    path.write_text(_kernel_source())
    spec = importlib.util.spec_from_file_location("every_function", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    n = 16
    xs = [_points(name, n) for name in NAMES]
    X = torch.tensor(xs, dtype=torch.float32)
    Y, D = torch.empty_like(X), torch.empty_like(X)
    module.every_function[(1,)](X, Y, D, n)
    for i, name in enumerate(NAMES):
        pts = X[i].double().tolist()            # the fp32 points, exactly
        f = registry.python_callable(name)
        torch.testing.assert_close(Y[i].double(), torch.tensor([f(x) for x in pts], dtype=torch.float64),
                                   rtol=2e-6, atol=2e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(D[i].double(), torch.tensor([_finite_difference(name, x) for x in pts],
                                                               dtype=torch.float64),
                                   rtol=2e-5, atol=2e-6, msg=lambda m: f"{name} derivative: {m}")


def test_undefined_points_are_refused_in_the_registry_words():
    from mixc.dsl.scalar import FUNCTIONS as folded, ScalarError  # noqa: F401
    for name in NAMES:
        for cond, why in FUNCTIONS[name].undefined:
            x = 0.0 if "== 0" in cond else -1.5
            assert registry.undefined_at(name, x) == why
        assert all(registry.undefined_at(name, x) is None for x in _points(name, 6))


def language_doc_table() -> str:
    """The function table of docs/language.md, from the registry."""
    rows = [f"| `{name}` | {FUNCTIONS[name].doc} |" for name in sorted(FUNCTIONS, key=list(FUNCTIONS).index)]
    return "| function | value |\n|---|---|\n" + "\n".join(rows) + "\n"


def test_the_language_doc_lists_every_function():
    text = DOC.read_text(encoding="utf-8")
    assert language_doc_table() in text, ("docs/language.md's table of functions is not the registry's; "
                                          "paste this under '### Functions':\n" + language_doc_table())
    section = text[text.index("### Functions"):text.index("#### `sum(x, K)`")]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    assert listed == set(FUNCTIONS)


def test_a_compiled_module_evaluates_an_option_default_that_calls_a_function():
    """The compiled module's runtime (standalone/support.py) has no registry: the call in METADATA
    carries the function's float64 form."""
    from mixc.codegen.module import _scalar_tree
    from mixc.dsl import ir
    from mixc.standalone.support import scalar
    for name in NAMES:
        x = _points(name, 1)[0]
        tree = _scalar_tree(ir.Call((), None, name, (ir.Num((), None, x),)))
        assert scalar(tree, {}, {}) == pytest.approx(registry.python_callable(name)(x), rel=1e-15)
    assert math.isnan(scalar(_scalar_tree(ir.Call((), None, "log", (ir.Num((), None, 0.0),))), {}, {}))


def test_the_registry_is_data():
    """Importing the spec language with its registry loads neither sympy nor torch nor triton."""
    import subprocess
    import sys
    code = ("import sys, mixc.dsl, mixc.dsl.functions; "
            "print(sorted(m for m in ('sympy', 'torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""The sign prover with declared ranges (derive/bounds.py, read by decay_sign.py): bounds over
the values the inputs may take, the multilinear corner test, and the decays it decides."""
import math

import pytest
import sympy as sp

from mixc.derive.bounds import bounds
from mixc.derive.decay_sign import may_be_negative, negative_decay, nonpositive
from mixc.derive.functions import SYMPY_FUNCTIONS
from mixc.derive.symbolic import SymbolTable
from mixc.dsl import parse
from mixc.pipeline import from_text
from range_specs import HGRN1, HGRN1_RANGED, HGRN1_UNRANGED

sigmoid, softplus, logsigmoid = (SYMPY_FUNCTIONS[n] for n in ("sigmoid", "softplus", "logsigmoid"))
INF = math.inf

SPEC = """mixer m
  dims   D
  input  x[D], y[D], g[D] in (-inf, 0], beta[] in (0, 2)
  param  lb[D] in [0, 1], A[D] in (-inf, 0]
  state  h[D]
  update h = h + x
  output o = h
"""


@pytest.fixture(scope="module")
def table():
    t = SymbolTable(parse(SPEC))
    for name, kind in (("x", "input"), ("y", "input"), ("g", "input"), ("beta", "input")):
        t.tensor(name, kind, ("D",))
    for name in ("lb", "A"):
        t.tensor(name, "param", ("D",))
    return t


def sym(name):
    return sp.Symbol(name, real=True)


x, y, g, beta, lb, A = (sym(n) for n in ("x", "y", "g", "beta", "lb", "A"))


@pytest.mark.parametrize("expr,want", [
    (x, (-INF, INF)),
    (g, (-INF, 0.0)),
    (beta, (0.0, 2.0)),
    (sp.exp(g), (0.0, 1.0)),
    (sigmoid(x), (0.0, 1.0)),
    (1 - lb, (0.0, 1.0)),
    (A * softplus(x), (-INF, 0.0)),
    (logsigmoid(x) + g, (-INF, 0.0)),
    (lb + (1 - lb) * sigmoid(y), (0.0, 1.0)),
    (sigmoid(x) + sigmoid(y) - sigmoid(x) * sigmoid(y), (0.0, 1.0)),
    (sp.log(lb + (1 - lb) * sigmoid(y)), (-INF, 0.0)),
    (beta ** 2, (0.0, 4.0)),
    (sp.sqrt(beta), (0.0, math.sqrt(2))),
    (1 / (1 + beta), (1 / 3, 1.0)),
], ids=["unranged", "log-gate", "beta", "exp-of-gate", "sigmoid", "one-minus", "mamba-log-decay", "sum-of-logs",
        "convex-mix", "convex-mix-expanded", "log-of-mix", "square", "sqrt", "reciprocal"])
def test_bounds(table, expr, want):
    lo, hi = bounds(expr, table)
    assert lo == pytest.approx(want[0]) and hi == pytest.approx(want[1])


def test_interval_arithmetic_alone_would_lose_the_convex_mix(table):
    """The corner test: a + b - a b over a, b in [0, 1] is [0, 1]; term by term it is [-1, 2]."""
    a, b = sigmoid(x), sigmoid(y)
    lo, hi = bounds(a + b - a * b, table)
    assert (lo, hi) == (0.0, 1.0)
    lo, hi = bounds(a + b - a * b ** 2, table)          # not multilinear: term by term, still >= -1
    assert lo >= -1.0 and hi <= 2.0


def test_the_prover_reads_declared_ranges(table):
    assert not may_be_negative(sp.exp(g) * lb, table)
    assert may_be_negative(x * lb, table)
    assert nonpositive(A * softplus(x), table) and not nonpositive(x * softplus(y), table)


@pytest.mark.parametrize("text,chunked", [(HGRN1, True), (HGRN1_RANGED, True), (HGRN1_UNRANGED, False)],
                         ids=["lower-bound-a-sigmoid", "lower-bound-a-ranged-param", "lower-bound-unranged"])
def test_hgrn1_gate_keeps_its_chunked_kernels(text, chunked):
    """f = lb + (1 - lb) * sigmoid(fz) with lb = sigmoid(x) or lb in [0, 1] is in [0, 1]: the
    chunked forms take log f (were refused: "not provably >= 0"); an unranged lb is refused."""
    plan = from_text(text).plan()
    assert ("chunk" in plan.forms) == chunked
    assert (plan.layout.chunk_unsupported is None) == chunked
    assert (negative_decay(plan) is None) == chunked
    if not chunked:
        assert "is not provably >= 0" in plan.layout.chunk_unsupported


def test_a_range_that_allows_a_negative_decay_proves_nothing():
    plan = from_text(HGRN1_RANGED.replace("in [0, 1]", "in [-1, 1]")).plan()
    assert "chunk" not in plan.forms and "is not provably >= 0" in plan.layout.chunk_unsupported

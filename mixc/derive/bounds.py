"""Bounds of a derived expression over every value its inputs may take: the sign prover's
second opinion (decay_sign.py asks it where sympy's assumptions cannot decide).

Each input and param ranges over the values its declaration promises (`param lb[V] in [0, 1]`,
ir.ValueRange; all reals without one), a dim over 1, 2, ... and the head index over 0, 1, ...
Bounds then follow the expression up: monotone functions map the ends of their argument's
bounds (sigmoid to (0, 1), exp to (0, inf)), sums and products of intervals combine their
ends. Interval arithmetic forgets that two appearances of sigmoid(x) are the same number, so
`lb + (1 - lb) * sigmoid(fz)` would get [0, 2], not [0, 1], and with lb = sigmoid(x) expanded,
sigmoid(x) + sigmoid(fz) - sigmoid(x) * sigmoid(fz) would get [-1, 2]. A sum or product that is
a polynomial of degree at most 1 in each of its non-polynomial parts (multilinear: HGRN-1's
lower-bounded gate, any convex mix a + (1 - a) b) takes its extremes at the corners of its
parts' box, so those are evaluated too and the tighter bound kept.

Bounds are closed intervals of floats, each end possibly infinite: an open end of a declared
range is taken as closed, which proves x >= 0 and x <= 0 but never x > 0."""
from __future__ import annotations

import itertools
import math

import sympy as sp

from ..dsl import functions as registry
from .functions import geq, maximum, minimum, step

INF = math.inf
ALL = (-INF, INF)

# the multilinear corner test: at most this many parts (2 ** n corners) and this many operations
CORNER_MAX_PARTS = 8
CORNER_MAX_OPS = 80

# Registry functions increasing in x over all reals (their bounds are the images of the ends).
_INCREASING = ("exp", "tanh", "sigmoid", "logsigmoid", "softplus", "elu", "relu")
# Decreasing then increasing (one minimum at x_min): the maximum on an interval is at an end.
_VALLEY = {"silu": (-1.2784645427610738, -0.2784645427610738), "gelu": (-0.7517915241, -0.1699740145)}


def lower_bound(expr: sp.Expr, table) -> float:
    return bounds(expr, table)[0]


def upper_bound(expr: sp.Expr, table) -> float:
    return bounds(expr, table)[1]


def bounds(expr: sp.Expr, table, known: dict | None = None) -> tuple[float, float]:
    """(lo, hi) with lo <= expr <= hi for every value of its symbols (ALL where unknown);
    known: bounds of further symbols (the lint's readouts and options at their defaults)."""
    try:
        return _Bounds(table, known).of(sp.sympify(expr))
    except Exception:       # a form the walk does not know (zoo, a float that sympy cannot order): unknown
        return ALL


def interval_product(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """The bounds of x * y for x in a, y in b (0 * inf is 0: a bound of finite products)."""
    ends = [_mul(x, y) for x in a for y in b]
    return min(ends), max(ends)


def _declared(table, name: str):
    m = table.ir
    for decl in (*m.inputs, *m.params):
        if decl.name == name:
            return decl.range
    return None


def _value(f, x: float) -> float:
    """f(x) with the limits at +-inf and overflow as the limit the function goes to."""
    try:
        return float(f(x))
    except OverflowError:
        return INF if x > 0 else -INF
    except (ValueError, ZeroDivisionError):
        return math.nan


def _mul(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b        # 0 * inf: a bound of finite products is 0


def _clean(lo: float, hi: float) -> tuple[float, float]:
    lo = -INF if math.isnan(lo) else lo
    hi = INF if math.isnan(hi) else hi
    return lo, hi


class _Bounds:
    def __init__(self, table, known: dict | None = None):
        self.t = table
        self.known = known or {}
        self.memo: dict[sp.Expr, tuple[float, float]] = {}

    def of(self, e: sp.Expr) -> tuple[float, float]:
        if e not in self.memo:
            self.memo[e] = _clean(*self._of(e))
        return self.memo[e]

    def _of(self, e: sp.Expr) -> tuple[float, float]:
        if e.is_Number:
            v = float(e)
            return (v, v) if math.isfinite(v) else ALL if math.isnan(v) else (v, v)
        if e is sp.S.Exp1 or e is sp.S.Pi:
            return float(e), float(e)
        if e.is_Symbol:
            return self.symbol(e)
        if e.is_Add:
            lo = sum(self.of(a)[0] for a in e.args)
            hi = sum(self.of(a)[1] for a in e.args)
            shift = self.below_its_max(e)
            if shift is not None:       # e = (x - max(x, K)) + rest, the first part <= 0
                hi = min(hi, self.of(shift[1])[1])
            return self.corners(e, (lo, hi))
        if e.is_Mul:
            out = (1.0, 1.0)
            for a in e.args:
                out = self.product(out, self.of(a))
            return self.corners(e, out)
        if e.is_Pow:
            return self.power(e)
        if isinstance(e, sp.Function):
            return self.function(e)
        return ALL

    def symbol(self, s: sp.Symbol) -> tuple[float, float]:
        if s in self.known:
            return self.known[s]
        kind = self.t.kinds.get(s)
        if kind in ("input", "param"):
            r = _declared(self.t, s.name)
            return (r.lower, r.upper) if r is not None else ALL
        if kind == "dim":
            return 1.0, INF
        if kind == "head":
            return 0.0, INF
        if kind == "let" and s in self.t.lets:
            return self.of(self.t.lets[s])
        if kind == "node" and s in self.t.nodes:
            return self.node(self.t.nodes[s])
        if s.is_nonnegative:
            return 0.0, INF
        if s.is_nonpositive:
            return -INF, 0.0
        return ALL

    def node(self, nd) -> tuple[float, float]:
        if nd.kind == "norm":
            return 0.0, INF
        if nd.kind in ("max", "min", "rename"):          # a value of the operand
            return self.of(nd.operands[0])
        if nd.kind == "sum":
            lo, hi = self.of(nd.operands[0])
            if self.shifted_exp_sum(nd):
                return max(lo, 1.0), INF
        elif nd.kind == "dot":
            lo, hi = self.product(self.of(nd.operands[0]), self.of(nd.operands[1]))
        else:
            return ALL
        # a sum of any number of terms: only the signs of the terms' bounds carry over
        return (0.0 if lo >= 0 else -INF), (0.0 if hi <= 0 else INF)

    product = staticmethod(interval_product)

    def max_node(self, s) -> object | None:
        nd = self.t.nodes.get(s) if self.t.kinds.get(s) == "node" else None
        return nd if nd is not None and nd.kind == "max" else None

    def below_its_max(self, e: sp.Expr):
        """(the max node, rest) where e is x - max(x, K) + rest (softmax's and logsumexp's
        shift, dsl/dim_functions.py: x - max(x, K) <= 0), else None."""
        for s in e.free_symbols:
            nd = self.max_node(s)
            if nd is not None:
                rest = e + s - nd.operands[0]     # sympy cancels the terms of x (no expand: its cost)
                if s not in rest.free_symbols:
                    return nd, rest
        return None

    def shifted_exp_sum(self, nd) -> bool:
        """sum(exp(x - max(x, K)), K): one term is exp(0) = 1 and none is negative, so >= 1
        (softmax's denominator is never 0)."""
        x = nd.operands[0]
        arg = x.args[0] if isinstance(x, sp.exp) else x.exp if x.is_Pow and x.base is sp.S.Exp1 else None
        shift = self.below_its_max(arg) if arg is not None and arg.is_Add else None
        return shift is not None and shift[1] == 0 and set(shift[0].over) == set(nd.over)

    def power(self, e: sp.Pow) -> tuple[float, float]:
        base, ex = e.args
        if base is sp.S.Exp1:
            return self.increasing(math.exp, self.of(ex))
        lo, hi = self.of(base)
        if ex.is_Integer:
            n = int(ex)
            if n == 0:
                return 1.0, 1.0
            if n < 0:
                if lo > 0 or hi < 0:             # 1 / x^|n| over an interval without 0
                    a, b = self._int_power(lo, hi, -n)      # of one sign, not 0
                    ends = sorted(1 / x if math.isfinite(x) else 0.0 for x in (a, b))
                    return ends[0], ends[1]
                return (0.0, INF) if n % 2 == 0 else ALL
            return self._int_power(lo, hi, n)
        if ex.is_Number:                        # a fractional power: a base >= 0
            p, lo = float(ex), max(lo, 0.0)
            if p > 0:
                return _value(lambda x: x ** p, lo), _value(lambda x: x ** p, hi)
            return _value(lambda x: x ** p, hi), (_value(lambda x: x ** p, lo) if lo > 0 else INF)
        if lo > 0:                              # exp(ex * log(base))
            logs = (math.log(lo), _value(math.log, hi))
            return self.increasing(math.exp, self.product(logs, self.of(ex)))
        return ALL

    @staticmethod
    def _int_power(lo: float, hi: float, n: int) -> tuple[float, float]:
        def p(x):
            return _value(lambda y: y ** n, x)
        if n % 2 == 1:
            return p(lo), p(hi)
        if lo >= 0:
            return p(lo), p(hi)
        if hi <= 0:
            return p(hi), p(lo)
        return 0.0, max(p(lo), p(hi))

    @staticmethod
    def increasing(f, arg) -> tuple[float, float]:
        return _value(f, arg[0]), _value(f, arg[1])

    def function(self, e: sp.Function) -> tuple[float, float]:
        if isinstance(e, (step, geq)):
            return 0.0, 1.0
        if isinstance(e, (maximum, minimum)):
            (alo, ahi), (blo, bhi) = self.of(e.args[0]), self.of(e.args[1])
            pick = max if isinstance(e, maximum) else min
            return pick(alo, blo), pick(ahi, bhi)
        name = "abs" if isinstance(e, sp.Abs) else type(e).__name__
        if name not in registry.FUNCTIONS or len(e.args) != 1:
            return ALL
        f = registry.python_callable(name)
        lo, hi = self.of(e.args[0])
        if name in _INCREASING:
            return self.increasing(f, (lo, hi))
        if name == "log":
            return (_value(math.log, lo) if lo > 0 else -INF), (_value(math.log, hi) if hi > 0 else math.nan)
        if name == "sqrt":
            return _value(math.sqrt, max(lo, 0.0)), _value(math.sqrt, hi) if hi >= 0 else math.nan
        if name == "abs":
            low = 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
            return low, max(abs(lo), abs(hi))
        if name in _VALLEY:
            at, least = _VALLEY[name]
            high = max(_value(f, lo), _value(f, hi))
            low = least if lo <= at <= hi else min(_value(f, lo), _value(f, hi))
            return low, high
        return ALL

    def corners(self, e: sp.Expr, found: tuple[float, float]) -> tuple[float, float]:
        """found, tightened by the corner test where e is multilinear in its parts."""
        if sp.count_ops(e) > CORNER_MAX_OPS:
            return found
        try:
            poly = sp.Poly(e)
        except Exception:           # not a polynomial in any generators sympy finds
            return found
        parts = poly.gens
        if not 1 < len(parts) <= CORNER_MAX_PARTS or any(d > 1 for d in poly.degree_list()):
            return found
        boxes = [self.of(p) for p in parts]
        if not all(math.isfinite(x) for box in boxes for x in box):
            return found
        try:
            values = [float(poly.eval(dict(zip(parts, corner)))) for corner in itertools.product(*boxes)]
        except (TypeError, ValueError, ArithmeticError):
            return found
        if any(math.isnan(v) for v in values):
            return found
        return max(found[0], min(values)), min(found[1], max(values))

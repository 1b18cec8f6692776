"""IR expressions -> sympy. Elementwise algebra becomes sympy algebra over one symbol per
named tensor; each reduction, contraction or rename becomes a *node*: a symbol of its own
whose definition (kind, operands, dims) is kept on the side. Elementwise derivatives are
then plain sympy.diff, and a node's backward rule is local (see NODE_VJP)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType

import sympy as sp

from ..dsl import ir
from .functions import SYMPY_FUNCTIONS, maximum, minimum


@dataclass(frozen=True)
class NodeDef:
    """A non-elementwise step: sum/norm/max/min over `over`, a contraction (dot) or a rename."""

    symbol: sp.Symbol
    kind: str                       # sum, norm, max, min, dot, rename
    operands: tuple[sp.Expr, ...]
    over: ir.Shape
    shape: ir.Shape
    mapping: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        if self.kind == "dot":
            return f"({self.operands[0]}) @ ({self.operands[1]})  over {', '.join(self.over)}"
        if self.kind == "rename":
            m = ", ".join(f"{a} -> {b}" for a, b in self.mapping)
            return f"rename({self.operands[0]}, {m})"
        return f"{self.kind}({self.operands[0]}, {', '.join(self.over)})"


@dataclass
class SymbolTable:
    """Symbols of one spec: tensors (with their shapes), dims, and nodes."""

    ir: ir.MixerIR
    shapes: dict[sp.Symbol, ir.Shape] = field(default_factory=dict)
    kinds: dict[sp.Symbol, str] = field(default_factory=dict)
    nodes: dict[sp.Symbol, NodeDef] = field(default_factory=dict)
    lets: dict[sp.Symbol, sp.Expr] = field(default_factory=dict)    # lets kept as symbols: their value

    def tensor(self, name: str, kind: str, shape: ir.Shape) -> sp.Symbol:
        s = sp.Symbol(name, real=True)
        self.shapes[s] = tuple(shape)
        self.kinds[s] = kind
        return s

    def dim(self, name: str) -> sp.Symbol:
        s = sp.Symbol(name, positive=True)
        self.shapes[s] = ()
        self.kinds[s] = "dim"
        return s

    def shape(self, s: sp.Symbol) -> ir.Shape:
        return self.shapes.get(s, ())

    def node(self, kind, operands, over, shape, mapping=()) -> sp.Symbol:
        if kind == "dot":
            label = f"({operands[0]})@({operands[1]})"
        elif kind == "rename":
            label = f"rename({operands[0]}, " + ", ".join(f"{a}->{b}" for a, b in mapping) + ")"
        else:
            label = f"{kind}({operands[0]}, {', '.join(over)})"
        s = sp.Symbol(label, real=True)
        if s not in self.nodes:
            self.nodes[s] = NodeDef(s, kind, tuple(operands), tuple(over), tuple(shape), tuple(mapping))
            self.shapes[s] = tuple(shape)
            self.kinds[s] = "node"
        return s

    def freeze(self) -> "SymbolTable":
        """Read-only from here on (the Plan that holds it is frozen)."""
        self.shapes = MappingProxyType(dict(self.shapes))
        self.kinds = MappingProxyType(dict(self.kinds))
        self.nodes = MappingProxyType(dict(self.nodes))
        self.lets = MappingProxyType(dict(self.lets))
        return self

    def leaves(self, expr: sp.Expr, kinds=("input", "param")) -> list[sp.Symbol]:
        """Tensor symbols of the given kinds that expr depends on, through nodes too."""
        out, seen, stack = [], set(), [expr]
        while stack:
            e = stack.pop()
            for s in sorted(e.free_symbols, key=str):
                if s in seen:
                    continue
                seen.add(s)
                if s in self.nodes:
                    stack.extend(self.nodes[s].operands)
                elif s in self.lets:
                    stack.append(self.lets[s])
                elif self.kinds.get(s) in kinds:
                    out.append(s)
        return sorted(out, key=str)


def _number(value: float) -> sp.Expr:
    """Exact where it reads well (2, 1/2, 1/16), a float otherwise (1e-6 stays 1.0e-6)."""
    if float(value).is_integer() and abs(value) < 2**53:
        return sp.Integer(int(value))
    if abs(value) >= 2**53:     # 1e308 as an exact integer makes every power of it a huge integer
        return sp.Float(value)
    r = sp.Rational(repr(float(value)))
    if r.q <= 1024:
        return r
    return sp.Float(value)


def _power(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    """a ** b; of two numbers exact only for a small integer exponent of a rational (2 ** -5 is
    1/32), a float otherwise: sympy would build 1.0000001 ** 10000000 as an exact rational of
    seventy million digits."""
    if a.is_Number and b.is_Number and not (a.is_Rational and b.is_Integer and abs(b) <= 64):
        try:
            return _number(math.pow(float(a), float(b)))
        except (ArithmeticError, ValueError):   # the checker refuses these constants; derived ones stay symbolic
            return sp.Pow(a, b, evaluate=False)
    return a ** b


# A let is inlined into what reads it while its written-out expression stays below this many
# nodes (sharing counted once per use, as sympy walks it); past it the let is kept as a symbol
# of its own. A chain `let a_i = sigmoid(a_{i-1}) + a_{i-1}` doubles at every line: inlined,
# 14 lines took 25 s to derive and 18 over 90 s; kept, the chain is linear.
LET_INLINE_MAX_NODES = 400


def tree_size(e: sp.Expr, memo: dict | None = None) -> int:
    """The number of nodes of e written out as a tree, in time linear in its shared form."""
    memo = {} if memo is None else memo
    stack = [e]
    while stack:
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        todo = [a for a in x.args if a not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        memo[x] = 1 + sum(memo[a] for a in x.args)
    return memo[e]


class ToSympy:
    """Convert IR expressions; lets are inlined (inline_lets) or kept as symbols, and past
    LET_INLINE_MAX_NODES kept as symbols in any case (the table records their value)."""

    def __init__(self, table: SymbolTable, inline_lets: bool = True, state_symbols=None):
        self.t = table
        self.inline_lets = inline_lets
        self.state_symbols = state_symbols or {}
        self._let_cache: dict[str, sp.Expr] = {}

    def __call__(self, e: ir.Expr) -> sp.Expr:
        return getattr(self, "x_" + type(e).__name__)(e)

    def x_Num(self, e: ir.Num):
        return _number(e.value)

    def x_Ref(self, e: ir.Ref):
        t, mixer = self.t, self.t.ir
        if e.kind == "dim":
            return t.dim(e.name)
        if e.kind == "head":
            s = sp.Symbol("head", nonnegative=True, integer=True)
            t.shapes[s], t.kinds[s] = (), "head"
            return s
        if e.kind == "let":
            if self.inline_lets:
                if e.name not in self._let_cache:
                    value = self(mixer.let(e.name).expr)
                    if tree_size(value) > LET_INLINE_MAX_NODES:
                        sym = t.tensor(e.name, "let", e.shape)
                        t.lets[sym] = value
                        value = sym
                    self._let_cache[e.name] = value
                return self._let_cache[e.name]
            return t.tensor(e.name, "let", e.shape)
        if e.kind == "state":
            return self.state_symbols.get(e.name) or t.tensor(e.name, "state", mixer.state(e.name).shape)
        if e.kind == "readout":
            return t.tensor(e.name, "readout", e.shape)
        return t.tensor(e.name, e.kind, e.shape)

    def x_Prev(self, e: ir.Prev):
        return self.t.tensor(f"prev_{e.state}", "state", e.shape)

    def x_Neg(self, e: ir.Neg):
        return -self(e.x)

    def x_BinOp(self, e: ir.BinOp):
        a, b = self(e.left), self(e.right)
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
                "/": lambda: a / b, "**": lambda: _power(a, b)}[e.op]()

    def x_Contract(self, e: ir.Contract):
        return self.t.node("dot", (self(e.left), self(e.right)), e.over, e.shape)

    def x_Call(self, e: ir.Call):
        args = [self(a) for a in e.args]
        if e.fn == "max":
            return maximum(*args)
        if e.fn == "min":
            return minimum(*args)
        return SYMPY_FUNCTIONS[e.fn](*args)

    def x_Reduce(self, e: ir.Reduce):
        return self.t.node(e.fn, (self(e.x),), e.over, e.shape)

    def x_Rename(self, e: ir.Rename):
        return self.t.node("rename", (self(e.x),), (), e.shape, e.mapping)

    def x_Cond(self, e: ir.Cond):
        raise AssertionError("conditions are resolved by specialize() before derivation")


# The local backward rule of each node kind, as the partial derivative of the node with
# respect to operand i, broadcast by dim name (the upstream gradient is multiplied by it
# and summed over the dims the operand lacks).
def node_partial(node: NodeDef, i: int) -> sp.Expr:
    x = node.operands[i]
    if node.kind in ("sum", "rename"):
        return sp.S.One
    if node.kind == "norm":
        return x / node.symbol
    if node.kind == "dot":
        return node.operands[1 - i]
    if node.kind in ("max", "min"):
        return sp.Function("is_arg" + node.kind)(x, node.symbol)
    raise AssertionError(node.kind)


# sympy's simplify tries expansions whose cost grows with the expression: 20 nested exps take
# a minute, (g + h) ** 1000000 exhausts memory. Library decays are a few operations deep; past
# these bounds the decay is kept as written (classification still works: it reads the symbols,
# and a decay that only simplify would reduce to 1 is classified as a general scalar decay).
SIMPLIFY_MAX_DEPTH = 8
SIMPLIFY_MAX_OPS = 40
SIMPLIFY_MAX_POWER = 16


def bounded_simplify(e: sp.Expr) -> sp.Expr:
    """sp.simplify(e) where e is small enough for it to finish quickly, e otherwise."""
    if not e.free_symbols:
        return e
    if _depth(e) > SIMPLIFY_MAX_DEPTH or sp.count_ops(e) > SIMPLIFY_MAX_OPS:
        return e
    if any(p.exp.is_Number and abs(p.exp) > SIMPLIFY_MAX_POWER for p in e.atoms(sp.Pow)):
        return e
    return sp.simplify(e)


def _depth(e: sp.Expr) -> int:
    stack, deepest = [(e, 1)], 0
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((a, d + 1) for a in x.args)
    return deepest

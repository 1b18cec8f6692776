"""MixerIR: a checked spec. Frozen dataclasses; every expression carries its shape.

A shape is a tuple of dimension names in the order the spec's `dims` declares them
(shapes are sets of names; the order only fixes a layout). Spans are kept for error
reports but do not take part in equality.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .errors import Source, Span

Shape = tuple[str, ...]


@dataclass(frozen=True)
class Expr:
    shape: Shape
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class Num(Expr):
    value: float


@dataclass(frozen=True)
class Ref(Expr):
    """A name. kind: input, param, option, let, state, dim (its size), head (the head index)."""

    name: str
    kind: str


@dataclass(frozen=True)
class Prev(Expr):
    """prev(S): the state before this token's update."""

    state: str


@dataclass(frozen=True)
class Neg(Expr):
    x: Expr


@dataclass(frozen=True)
class BinOp(Expr):
    """Elementwise + - * / ** broadcast by dimension name."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Contract(Expr):
    """left @ right: multiply and sum over the shared dims `over`."""

    left: Expr
    right: Expr
    over: Shape


@dataclass(frozen=True)
class Call(Expr):
    """An elementwise function: exp, log, sigmoid, ..., max(a, b), min(a, b)."""

    fn: str
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Reduce(Expr):
    """sum / norm / max / min of x over `over`."""

    fn: str
    x: Expr
    over: Shape


@dataclass(frozen=True)
class Rename(Expr):
    """rename(x, K -> J): the same values with dim K called J (J has K's size)."""

    x: Expr
    mapping: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Cond(Expr):
    """if FLAG then a else b, FLAG a boolean option (resolved when the spec is specialized)."""

    flag: str
    then: Expr
    otherwise: Expr


@dataclass(frozen=True)
class Dim:
    name: str
    alias_of: str | None
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: Shape
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class Option:
    """A call-time scalar (kind 'float', default an expression of dims and earlier
    options) or a flag (kind 'bool', default True/False) that specializes the spec."""

    name: str
    kind: str
    default: Expr | bool
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class Let:
    name: str
    expr: Expr
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class Update:
    state: str
    expr: Expr
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class Output:
    name: str
    expr: Expr
    span: Span | None = field(compare=False, repr=False)


@dataclass(frozen=True)
class MixerIR:
    name: str
    dims: tuple[Dim, ...]
    inputs: tuple[TensorDecl, ...]
    params: tuple[TensorDecl, ...]
    options: tuple[Option, ...]
    lets: tuple[Let, ...]
    states: tuple[TensorDecl, ...]
    updates: tuple[Update, ...]          # in the order of `states`
    output: Output
    source: Source = field(compare=False, repr=False)

    @property
    def dim_names(self) -> Shape:
        return tuple(d.name for d in self.dims)

    def dim(self, name: str) -> Dim:
        return next(d for d in self.dims if d.name == name)

    def root_dim(self, name: str) -> str:
        """The dim whose size `name` shares (itself unless declared `J = K`)."""
        d = self.dim(name)
        return self.root_dim(d.alias_of) if d.alias_of else d.name

    def input(self, name: str) -> TensorDecl:
        return next(x for x in self.inputs if x.name == name)

    def param(self, name: str) -> TensorDecl:
        return next(x for x in self.params if x.name == name)

    def state(self, name: str) -> TensorDecl:
        return next(x for x in self.states if x.name == name)

    def option(self, name: str) -> Option:
        return next(x for x in self.options if x.name == name)

    def let(self, name: str) -> Let:
        return next(x for x in self.lets if x.name == name)

    def update(self, state: str) -> Update:
        return next(u for u in self.updates if u.state == state)

    @property
    def flags(self) -> tuple[Option, ...]:
        return tuple(o for o in self.options if o.kind == "bool")

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(self.source.text.encode()).hexdigest()[:16]


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, (Neg,)):
        return (e.x,)
    if isinstance(e, (BinOp, Contract)):
        return (e.left, e.right)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, (Reduce, Rename)):
        return (e.x,)
    if isinstance(e, Cond):
        return (e.then, e.otherwise)
    return ()


def walk(e: Expr):
    """Every node of e, parents before children."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(children(node)))


def refs(e: Expr, kind: str | None = None) -> set[str]:
    """Names referenced in e (of one kind if given); prev(S) counts as state S."""
    out = set()
    for node in walk(e):
        if isinstance(node, Ref) and (kind is None or node.kind == kind):
            out.add(node.name)
        elif isinstance(node, Prev) and kind in (None, "state"):
            out.add(node.state)
    return out

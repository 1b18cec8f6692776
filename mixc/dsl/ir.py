"""MixerIR: a checked spec. Frozen dataclasses; every expression carries its shape.

A shape is a tuple of dimension names in the order the spec's `dims` declares them
(shapes are sets of names; the order only fixes a layout). Spans are kept for error
reports but do not take part in equality.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

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
class SeqOp(Expr):
    """A sequence op: its value at token t reads other tokens of the sequence.

    kind conv:   args (h, x); y_t = sum_j h_j x_{t-j}, the filter's taps along `tap` (a dim
                 of h that x lacks) or, when tap is None, along time (h at token j is tap j).
    kind mix:    args (W, x); y_t = sum_s W_t[s] x_s, W an expression of a [T, T] param (its
                 rows carry the source positions as the dim "T").
    kind attend: args (q, k, v); softmax attention, q . k over the dims q and k share.
    causal is True/False or the name of a flag; window (attend) a scalar expression of
    numbers, dims and options; index numbers the spec's sequence ops (it names their caches)."""

    kind: str
    args: tuple[Expr, ...]
    tap: str | None = None
    causal: bool | str = True
    window: Expr | None = None
    index: int = 0


# The positions of a sequence: T in a param's shape ([T, ...] one value per position,
# [T, T, ...] a token-mixing matrix) and, on a value, the dim of source positions.
POSITIONS = "T"


@dataclass(frozen=True)
class Dim:
    """A named dimension: its size bound by a call's tensors, shared with another dim
    (alias_of, `dims J = K`) or fixed by the spec (size, `dims E = 2`)."""

    name: str
    alias_of: str | None
    span: Span | None = field(compare=False, repr=False)
    size: int | None = None


@dataclass(frozen=True)
class ValueRange:
    """The values a caller promises for an input or param: `in [lower, upper]`, each end closed
    (the value may equal it) or open; -inf and inf for an end without a bound. Checked at call
    time in the reference and torch modes (runtime/inputs.py) and read by the sign prover
    (derive/bounds.py)."""

    lower: float
    upper: float
    lower_closed: bool = True
    upper_closed: bool = True

    def contains(self, x: float) -> bool:
        above = x >= self.lower if self.lower_closed else x > self.lower
        below = x <= self.upper if self.upper_closed else x < self.upper
        return bool(above and below)

    def text(self) -> str:
        def end(v: float) -> str:
            return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)
        return (("[" if self.lower_closed else "(") + f"{end(self.lower)}, {end(self.upper)}"
                + ("]" if self.upper_closed else ")"))


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: Shape
    span: Span | None = field(compare=False, repr=False)
    range: ValueRange | None = None


@dataclass(frozen=True)
class Const:
    """`const W[E] = [0.5, 1.0]`: a param whose values the spec fixes (dims of fixed size only).
    It is also an entry of MixerIR.params (every stage reads it as a param, [H, *shape], the same
    for every head); the runtime's binder supplies its tensor (standalone/binding.py) and no call
    passes it. values: row-major over shape, numbers the checker evaluated."""

    name: str
    shape: Shape
    values: tuple[float, ...]
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
class Shifted:
    """prev(x) of an input x: the previous token's x, zero at each sequence's start. The checker
    lowers it to a derived input `name` (prev_x) that the runtime computes before the kernels
    (standalone/shift.py: a shift along T within each packed sequence) and that the decode step
    carries as an entry of the state (the last token's x)."""

    name: str
    source: str
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
    # prev(x) of inputs: derived inputs, the last entries of `inputs` (given_inputs are the caller's)
    shifted: tuple[Shifted, ...] = ()
    # const W[E] = [...]: params the spec fixes, also entries of `params` (given_params are the caller's)
    consts: tuple[Const, ...] = ()

    @property
    def dim_names(self) -> Shape:
        return tuple(d.name for d in self.dims)

    def dim(self, name: str) -> Dim:
        return next(d for d in self.dims if d.name == name)

    def fixed_size(self, name: str) -> int | None:
        """The size the spec gives dim `name` (through its alias), or None: bound by a call."""
        return self.dim(self.root_dim(name)).size

    def root_dim(self, name: str) -> str:
        """The dim whose size `name` shares (itself unless declared `J = K`)."""
        d = self.dim(name)
        return self.root_dim(d.alias_of) if d.alias_of else d.name

    @property
    def given_inputs(self) -> tuple[TensorDecl, ...]:
        """The inputs a caller passes: all but the derived prev(x) ones (Shifted)."""
        derived = {s.name for s in self.shifted}
        return tuple(x for x in self.inputs if x.name not in derived)

    def shift_of(self, name: str) -> Shifted | None:
        """The prev(x) that derived input `name` carries, or None for a given input."""
        return next((s for s in self.shifted if s.name == name), None)

    @property
    def given_params(self) -> tuple[TensorDecl, ...]:
        """The params a caller passes: all but the consts."""
        fixed = {c.name for c in self.consts}
        return tuple(p for p in self.params if p.name not in fixed)

    def const(self, name: str) -> Const | None:
        """The const `name`, or None for a param the caller passes."""
        return next((c for c in self.consts if c.name == name), None)

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
    def sequence_ops(self) -> tuple[SeqOp, ...]:
        """The sequence ops (conv, mix, attend) of the lets and the output, by index."""
        found = {}
        for e in [x.expr for x in self.lets] + [self.output.expr]:
            for node in walk(e):
                if isinstance(node, SeqOp):
                    found[node.index] = node
        return tuple(found[i] for i in sorted(found))

    @property
    def is_sequence(self) -> bool:
        """A sequence mixer: sequence ops and no state (the checker allows no mix of both)."""
        return len(self.states) == 0

    def positional(self, name: str) -> bool:
        """A param declared [T, ...]: one value (or, [T, T, ...], one row) per position."""
        return any(p.name == name and p.shape[:1] == (POSITIONS,) for p in self.params)

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
    if isinstance(e, SeqOp):
        return e.args + ((e.window,) if e.window is not None else ())
    return ()


def with_children(node: Expr, kids: list[Expr]) -> Expr:
    """node with its children (in the order of children()) replaced."""
    if isinstance(node, Neg):
        return replace(node, x=kids[0])
    if isinstance(node, (BinOp, Contract)):
        return replace(node, left=kids[0], right=kids[1])
    if isinstance(node, Call):
        return replace(node, args=tuple(kids))
    if isinstance(node, (Reduce, Rename)):
        return replace(node, x=kids[0])
    if isinstance(node, Cond):
        return replace(node, then=kids[0], otherwise=kids[1])
    raise AssertionError(type(node))


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

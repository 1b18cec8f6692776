"""Building kernel IR as Triton reads: small constructors over the nodes (name, num, add, mul,
op, let: the recurrent kernels', codegen/recurrent_ir.py) and `Block`, an expression with
Triton's operators, so that code building a kernel reads as the kernel:

    A = dot(Q, trans(Kj)) * exp(where(causal & ok, bq - bk, -inf))

builds the IR of `_A = _mixc_dot(Q, tl.trans(K), DOT) * tl.exp(tl.where(..., float('-inf')))`.

Broadcasting is by dims, as the IR's: an operand whose dims are a subsequence of the other's
is broadcast to them (`b0` [T] against `Q` [T, K] prints `b0[:, None]`); two operands neither
of which holds the other (a row vector [T] and a key vector [T']) broadcast to the union of
their dims, the chunk's rows first, then its key rows (`second("_T")`), then the others in the
order met. A broadcast wraps the whole operand, as Triton's indexing does: `(i - 1)[:, None]`
and `i[:, None] - 1` are different IR, so build the pair indices broadcast first where the
kernel reads them so. `==` stays Python's (Blocks are compared by identity): `eq` builds it.
"""
from __future__ import annotations

from . import nodes as K
from . import printer

INF = float("inf")


# ---- small constructors (the recurrent kernels' too) ----

def name(x: str, dims=()) -> K.Name:
    return K.Name(x, tuple(dims))


def num(v) -> K.Num:
    return K.Num(v)


def add(*xs: K.Expr) -> K.Expr:
    out = xs[0]
    for x in xs[1:]:
        out = K.BinOp("+", out, x)
    return out


def mul(*xs: K.Expr) -> K.Expr:
    out = xs[0]
    for x in xs[1:]:
        out = K.BinOp("*", out, x)
    return out


def op(o: str, a: K.Expr, b: K.Expr) -> K.BinOp:
    return K.BinOp(o, a, b)


def let(x: str, value: K.Expr, dtype: str = "f32", comment: str | None = None) -> K.Let:
    return K.Let(x, value, value.dims, dtype, comment)


# ---- broadcasting by dims ----

ROWS = "_T"                     # the chunk's token rows (the query side of a pair (i, j))
KEY_ROWS = K.second(ROWS)       # the same rows as the key side j of a pair


def _rank(d: str) -> int:
    return 0 if d == ROWS else 1 if d == KEY_ROWS else 2


def _subsequence(have: K.Dims, want: K.Dims) -> bool:
    it = iter(want)
    return all(d in it for d in have)


def common_dims(*dims: K.Dims) -> K.Dims:
    """The dims operands broadcast to: the one that holds every other's, else their union, rows
    first, then key rows, then the others as met."""
    for d in dims:
        if all(_subsequence(x, d) for x in dims):
            return d
    seen: list[str] = []
    for ds in dims:
        seen += [d for d in ds if d not in seen]
    out = tuple(sorted(seen, key=lambda d: (_rank(d), seen.index(d))))
    if not all(_subsequence(x, out) for x in dims):
        shown = " and ".join("[" + ", ".join(x) + "]" for x in dims)
        raise ValueError(f"cannot broadcast {shown} together")
    return out


def lift(x) -> K.Expr:
    if isinstance(x, Block):
        return x.e
    if isinstance(x, K.Expr):
        return x
    if isinstance(x, (bool, int, float)):
        return K.Num(x)
    raise TypeError(f"not an expression: {x!r}")


def broadcast(*xs) -> list[K.Expr]:
    """The operands as expressions of their common dims (a scalar stays a scalar)."""
    es = [lift(x) for x in xs]
    to = common_dims(*[e.dims for e in es if e.dims])
    return [K.Broadcast(e, to) if e.dims and e.dims != to else e for e in es]


def _binary(o: str, a, b) -> "Block":
    left, right = broadcast(a, b)
    return Block(K.BinOp(o, left, right))


class Block:
    """A kernel IR expression with Triton's arithmetic, comparison and `&` operators."""

    __slots__ = ("e",)
    __hash__ = None

    def __init__(self, e: K.Expr):
        self.e = e

    @property
    def dims(self) -> K.Dims:
        return self.e.dims

    def __add__(self, o):
        return _binary("+", self, o)

    def __radd__(self, o):
        return _binary("+", o, self)

    def __sub__(self, o):
        return _binary("-", self, o)

    def __rsub__(self, o):
        return _binary("-", o, self)

    def __mul__(self, o):
        return _binary("*", self, o)

    def __rmul__(self, o):
        return _binary("*", o, self)

    def __truediv__(self, o):
        return _binary("/", self, o)

    def __floordiv__(self, o):
        return _binary("//", self, o)

    def __mod__(self, o):
        return _binary("%", self, o)

    def __and__(self, o):
        return _binary("&", self, o)

    def __gt__(self, o):
        return _binary(">", self, o)

    def __ge__(self, o):
        return _binary(">=", self, o)

    def __lt__(self, o):
        return _binary("<", self, o)

    def __le__(self, o):
        return _binary("<=", self, o)

    def __neg__(self):
        return Block(K.Neg(self.e))

    def eq(self, o) -> "Block":
        return _binary("==", self, o)

    def __repr__(self):
        return f"Block({printer.expr(self.e)} [{', '.join(self.dims)}])"


# ---- Triton's functions over Blocks ----

def dot(a, b) -> Block:
    """_mixc_dot(a, b, DOT): [m, c] @ [c, n]."""
    return Block(K.Dot(lift(a), lift(b)))


def trans(x) -> Block:
    return Block(K.Trans(lift(x)))


def exp(x) -> Block:
    return Block(K.Call("tl.exp", (lift(x),)))


def where(cond, a, b) -> Block:
    return Block(K.Call("tl.where", tuple(broadcast(cond, a, b))))


def maximum(a, b) -> Block:
    return Block(K.Call("tl.maximum", tuple(broadcast(a, b))))


def minimum(a, b) -> Block:
    return Block(K.Call("tl.minimum", tuple(broadcast(a, b))))


def sum(x, over: str | None = None) -> Block:     # noqa: A001 (tl.sum)
    """tl.sum over one dim (None: over every one)."""
    return Block(K.Reduce("tl.sum", lift(x), over))


def rename(x, old: str, new: str) -> Block:
    """x with its axis `old` named `new` (no code: the same block read as other rows)."""
    e = lift(x)
    dims = tuple(new if d == old else d for d in e.dims)
    return Block(K.Permute(e, dims, dims))

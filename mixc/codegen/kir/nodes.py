"""The kernel IR's nodes: typed expressions and statements of one Triton kernel.

Every expression knows its dims: the named axes of the block it computes, outermost first
(a scalar has none). Broadcasting by name is explicit (a Broadcast node indexes a block with
None to the axes of a larger one), so both operands of an elementwise op have the result's
dims or none. A name carries the dims its definition gave it; the verifier (verify.py) checks
that the two agree, that every name is defined before it is read and that nothing is read
outside the block that defines it. The printer (printer.py) is the only place Triton text is
made; `Raw` holds text made elsewhere (the chunked kernels' templates, still text: the
Emitter's adapter, triton_expr.py) and never appears in a kernel built as IR.

Nodes are frozen dataclasses: passes (passes.py) rebuild, never mutate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

Dims = tuple[str, ...]

# dtypes a Let may hold (what the shape comment says after the dims)
DTYPES = ("f32", "i1", "i32", "i64", "ptr")


class Expr:
    """A value: `dims` (its axes), `children` (the expressions it reads)."""

    __slots__ = ()

    @property
    def dims(self) -> Dims:
        raise NotImplementedError

    def children(self) -> tuple["Expr", ...]:
        return ()

    def uses(self) -> tuple[str, ...]:
        """Names this node itself reads (not its children's)."""
        return ()


# ---- leaves ----

@dataclass(frozen=True)
class Name(Expr):
    """A variable: a Let's name, a loop's variable or a kernel argument."""
    id: str
    dims_: Dims = ()

    @property
    def dims(self) -> Dims:
        return self.dims_

    def uses(self):
        return (self.id,)


@dataclass(frozen=True)
class Num(Expr):
    """A number: int (indices) or float (values; inf and nan print as float('inf'))."""
    value: int | float

    @property
    def dims(self) -> Dims:
        return ()


@dataclass(frozen=True)
class Const(Expr):
    """A compile-time Triton constant: a dtype (tl.float32 ...) or True/False."""
    text: str

    @property
    def dims(self) -> Dims:
        return ()


@dataclass(frozen=True)
class Raw(Expr):
    """Triton text made outside the IR, with the dims its maker says (the adapter's strings)."""
    text: str
    dims_: Dims = ()

    @property
    def dims(self) -> Dims:
        return self.dims_


def flat(*dims: str) -> str:
    """The name of a flat axis over several dims' blocks, outermost first (a chunked kernel's
    state matrix flattens its key dims into one axis, based's [K*J, V]): "K*J"."""
    return "*".join(dims)


def second(dim: str) -> str:
    """A second axis over the same dims as `dim` (a scalar state's matrix is [_1, _1']: two
    unit axes, told apart by name): "_1'"."""
    return dim + "'"


def blocks(dim: str) -> tuple[str, ...]:
    """The block constants whose product is a dim's (a flat axis's, a second axis's) block."""
    return tuple(f"_BLOCK_{d}" for d in dim.rstrip("'").split("*"))


@dataclass(frozen=True)
class Arange(Expr):
    """tl.arange(0, _BLOCK_<dim>): the lanes of one dim's block (of a flat axis: the product
    of its dims' blocks)."""
    dim: str

    @property
    def dims(self) -> Dims:
        return (self.dim,)

    def uses(self):
        return blocks(self.dim)


@dataclass(frozen=True)
class Zeros(Expr):
    """tl.zeros([_BLOCK_<d>, ...], dtype=tl.float32): a block of zeros with these axes."""
    dims_: Dims

    @property
    def dims(self) -> Dims:
        return self.dims_

    def uses(self):
        return tuple(b for d in self.dims_ for b in blocks(d))


# ---- operators ----

# Python's binding strength, for the printer's parentheses (higher binds tighter)
BINARY = {"*": 12, "/": 12, "//": 12, "%": 12, "+": 11, "-": 11, "&": 8, "|": 6,
          "<": 5, "<=": 5, ">": 5, ">=": 5, "==": 5, "!=": 5, "and": 3, "or": 2}
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")


@dataclass(frozen=True)
class BinOp(Expr):
    """An elementwise binary op: both operands have the result's dims, or none (a scalar)."""
    op: str
    left: Expr
    right: Expr

    def __post_init__(self):
        assert self.op in BINARY, self.op

    @property
    def dims(self) -> Dims:
        return self.left.dims or self.right.dims

    def children(self):
        return (self.left, self.right)


@dataclass(frozen=True)
class Neg(Expr):
    x: Expr

    @property
    def dims(self) -> Dims:
        return self.x.dims

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Broadcast(Expr):
    """x indexed with None to the axes `to` (x's dims in the same order, a subsequence)."""
    x: Expr
    to: Dims

    @property
    def dims(self) -> Dims:
        return self.to

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Permute(Expr):
    """x's axes renamed position by position to `frm`, then permuted to the order `to` (the
    same names): tl.permute where the order changes, no code where only the names do."""
    x: Expr
    frm: Dims
    to: Dims

    @property
    def dims(self) -> Dims:
        return self.to

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Reduce(Expr):
    """tl.sum / tl.max / tl.min of x over one named dim (None: over all of them, a scalar)."""
    fn: str
    x: Expr
    over: str | None

    def __post_init__(self):
        assert self.fn in ("tl.sum", "tl.max", "tl.min"), self.fn

    @property
    def dims(self) -> Dims:
        return () if self.over is None else tuple(d for d in self.x.dims if d != self.over)

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Scan(Expr):
    """tl.cumsum of x along one named dim: the running sums, x's dims."""
    fn: str
    x: Expr
    over: str

    def __post_init__(self):
        assert self.fn in ("tl.cumsum",), self.fn

    @property
    def dims(self) -> Dims:
        return self.x.dims

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Dot(Expr):
    """The matrix product a @ b at the kernel's DOT precision, _mixc_dot(a, b, DOT) (the
    chunked kernels' helper over tl.dot): a [m, c] and b [c, n] give [m, n]; c is contracted."""
    a: Expr
    b: Expr

    @property
    def dims(self) -> Dims:
        return (self.a.dims[0], self.b.dims[-1]) if len(self.a.dims) == len(self.b.dims) == 2 else ()

    def children(self):
        return (self.a, self.b)

    def uses(self):
        return ("DOT",)


@dataclass(frozen=True)
class Trans(Expr):
    """tl.trans(x): a matrix [m, n] as [n, m]."""
    x: Expr

    @property
    def dims(self) -> Dims:
        return tuple(reversed(self.x.dims))

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Cast(Expr):
    """x.to(dtype): `to` a Const dtype, or ElementType(pointer)."""
    x: Expr
    to: Expr

    @property
    def dims(self) -> Dims:
        return self.x.dims

    def children(self):
        return (self.x, self.to)


@dataclass(frozen=True)
class ElementType(Expr):
    """<pointer>.dtype.element_ty: the dtype a buffer holds (stores cast to it)."""
    ptr: Name

    @property
    def dims(self) -> Dims:
        return ()

    def children(self):
        return (self.ptr,)


# tl functions a Call may name, with the rule for the dims of their result:
#   "elementwise": the operands' dims (equal or none), "scalar": none (program ids)
TL = {
    "tl.exp": "elementwise", "tl.log": "elementwise", "tl.sqrt": "elementwise", "tl.abs": "elementwise",
    "tl.floor": "elementwise", "tl.sigmoid": "elementwise", "tl.erf": "elementwise",
    "tl.maximum": "elementwise", "tl.minimum": "elementwise", "tl.where": "elementwise",
    "tl.program_id": "scalar", "tl.num_programs": "scalar", "tl.debug_barrier": "scalar",
}


@dataclass(frozen=True)
class Call(Expr):
    """A call of a tl function of the registry TL."""
    fn: str
    args: tuple[Expr, ...]

    def __post_init__(self):
        assert self.fn in TL, f"{self.fn} is not in kir.TL"

    @property
    def dims(self) -> Dims:
        if TL[self.fn] == "scalar":
            return ()
        return next((a.dims for a in self.args if a.dims), ())

    def children(self):
        return self.args


@dataclass(frozen=True)
class Helper(Expr):
    """A call of one of the generated module's @triton.jit helpers (_mixc_solve_lower ...):
    its result has the dims of its argument `like` (an index into args)."""
    fn: str
    args: tuple[Expr, ...]
    like: int

    @property
    def dims(self) -> Dims:
        return self.args[self.like].dims

    def children(self):
        return self.args


@dataclass(frozen=True)
class Template(Expr):
    """A spec function's Triton form from its registry entry (dsl/functions.py: `triton` or
    `triton_derivative`), `{x}` and `{y}` filled with the operands: elementwise in them."""
    text: str
    args: tuple[tuple[str, Expr], ...]

    @property
    def dims(self) -> Dims:
        return next((a.dims for _, a in self.args if a.dims), ())

    def children(self):
        return tuple(a for _, a in self.args)


# ---- blocks shaped at run time like another (`like.shape`): a block over the key dim of a
# chunked kernel keeps its shape when a key split (codegen/key_split.py) shrinks that dim's block

@dataclass(frozen=True)
class ZerosLike(Expr):
    """tl.zeros(like.shape, dtype=tl.float32): zeros shaped as the block `like` (a name); with
    f32 False, tl.zeros_like(like), in like's dtype too."""
    like: Name
    f32: bool = True

    @property
    def dims(self) -> Dims:
        return self.like.dims

    def children(self):
        return (self.like,)


@dataclass(frozen=True)
class BroadcastTo(Expr):
    """tl.broadcast_to(x, like.shape): x (indexed with None to like's dims) materialized."""
    x: Expr
    like: Name

    @property
    def dims(self) -> Dims:
        return self.like.dims

    def children(self):
        return (self.x, self.like)


@dataclass(frozen=True)
class Gather(Expr):
    """tl.gather(x, index, axis): x's elements at `index` (of x's dims) along one axis."""
    x: Expr
    index: Expr
    axis: int

    @property
    def dims(self) -> Dims:
        return self.x.dims

    def children(self):
        return (self.x, self.index)


@dataclass(frozen=True)
class SubchunkSum(Expr):
    """x [rows, d] summed over each run of `size` rows (a sub-chunk), the sum in every row of
    it: reshaped to [_BLOCK__T // size, size, like.shape[1]], summed, broadcast back."""
    x: Expr
    like: Name
    size: int

    @property
    def dims(self) -> Dims:
        return self.like.dims

    def children(self):
        return (self.x, self.like)

    def uses(self):
        return ("_BLOCK__T",)


@dataclass(frozen=True)
class Load(Expr):
    """tl.load(ptr + offsets[0] + offsets[1] ..., mask=mask, other=other): the offsets added to
    the pointer one by one, in order (each a scalar or a block of the load's dims: how the
    address is formed is the kernel's choice, kept as built); a block with their dims."""
    ptr: Name
    offsets: tuple[Expr, ...]
    mask: Expr | None = None
    other: Expr | None = None

    @property
    def dims(self) -> Dims:
        # a pointer block (ptr itself [i, j]: a Let of addresses) or its offsets' block
        return next((o.dims for o in (self.ptr, *self.offsets) if o.dims), ())

    def children(self):
        return tuple(x for x in (self.ptr, *self.offsets, self.mask, self.other) if x is not None)


# ---- statements ----

class Stmt:
    __slots__ = ()


@dataclass(frozen=True)
class Let(Stmt):
    """name = value, a block with these dims and dtype (a second Let of a name re-assigns it:
    a loop-carried state; it keeps its dims and dtype)."""
    name: str
    value: Expr
    dims: Dims = ()
    dtype: str = "f32"
    comment: str | None = None


@dataclass(frozen=True)
class Acc(Stmt):
    """name += value: a sum carried by a loop (the key-diagonal decay's sub-blocks into A); name
    is defined before, with value's dims."""
    name: str
    value: Expr


@dataclass(frozen=True)
class Store(Stmt):
    """tl.store(ptr + offsets[0] + ..., value, mask=mask) (the offsets as a Load's)."""
    ptr: Name
    offsets: tuple[Expr, ...]
    value: Expr
    mask: Expr | None = None


@dataclass(frozen=True)
class Do(Stmt):
    """An expression evaluated for its effect (tl.debug_barrier())."""
    value: Expr


@dataclass(frozen=True)
class For(Stmt):
    """for var in range(start, stop): body (tl.static_range: unrolled where static). What the
    body defines stays in it."""
    var: str
    start: Expr
    stop: Expr
    body: tuple[Stmt, ...]
    static: bool = False


@dataclass(frozen=True)
class If(Stmt):
    """if cond: body else: orelse. A name both branches define is defined after it."""
    cond: Expr
    body: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()


@dataclass(frozen=True)
class Text(Stmt):
    """Lines of Triton made outside the IR, indented relative to where the Text stands: what
    the chunked kernels' chunk body still is (codegen/chunk_ir.py: the class stages are IR
    printed into its lines) until it is IR itself. `what` names them (errors, --dump kir). The verifier does
    not look into them and what they define is not visible to the IR after them, so a kernel
    holding Text takes no passes (passes.run refuses it)."""
    lines: tuple[str, ...]
    what: str = "text"


@dataclass(frozen=True)
class Comment(Stmt):
    """A comment line ('' a blank line)."""
    text: str


@dataclass(frozen=True)
class Arg:
    """A kernel parameter: "ptr" a buffer, else the dtype of a scalar (a constexpr is an int)."""
    name: str
    constexpr: bool = False
    dtype: str = "i32"


@dataclass(frozen=True)
class ArgLine:
    """One line of the signature: arguments and a trailing comment, or a comment alone."""
    args: tuple[Arg, ...] = ()
    comment: str | None = None


@dataclass(frozen=True)
class Kernel:
    """One @triton.jit function: its name, the comment lines above it (class, stage,
    notation), its arguments and its body."""
    name: str
    header: tuple[str, ...]
    args: tuple[ArgLine, ...]
    body: tuple[Stmt, ...]
    notes: tuple[str, ...] = field(default=())      # comment lines opening the body

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for line in self.args for a in line.args)


def walk(e: Expr):
    """e and every expression below it, parents first."""
    stack = [e]
    while stack:
        x = stack.pop()
        yield x
        stack.extend(reversed(x.children()))


def expr_uses(e: Expr) -> list[str]:
    return [u for x in walk(e) for u in x.uses()]


def walk_stmts(stmts):
    """Every statement of a body, nested loops' and branches' included, outer first."""
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from walk_stmts(s.body)
        elif isinstance(s, If):
            yield from walk_stmts(s.body)
            yield from walk_stmts(s.orelse)


def stmt_exprs(s: Stmt) -> tuple[Expr, ...]:
    """The expressions a statement reads itself (not those of the statements it holds)."""
    if isinstance(s, (Let, Acc)):
        return (s.value,)
    if isinstance(s, Store):
        return tuple(x for x in (s.ptr, *s.offsets, s.value, s.mask) if x is not None)
    if isinstance(s, Do):
        return (s.value,)
    if isinstance(s, For):
        return (s.start, s.stop)
    if isinstance(s, If):
        return (s.cond,)
    return ()

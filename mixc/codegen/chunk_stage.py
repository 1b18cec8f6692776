"""The builder a class's chunk stage is written with (mixc/classes/<class>.py: its `chunk_*`
hooks ask `code.builder(st)` for one): the chunk's names as typed blocks of kernel IR, Triton's
functions over them (kir/build.py), and the stage's statements, verified on their own and
printed by kir's printer into the lines the hooks return (the chunk body around them is still
text: codegen/chunk.py, chunk_bwd.py).

Axes, by the letters a stage names them with:
    i   the chunk's C token rows (_T): the query side of a pair (i, j)
    j   the same rows as the key side of a pair (_T', no code: `at_keys` renames)
    K   the state's key dims flattened into one axis (chunk_ir.matrix_axes)
    V   the state's value dims flattened likewise (the second unit axis _1' where K is _1 too)
so Q and K are [i, K], V is [i, V], the state s_<S> [K, V] and Q K^T [i, j].
"""
from __future__ import annotations

from contextlib import contextmanager

from .. import classes
from ..derive import plan as P
from .chunk_ir import matrix_axes
from .kir import build as b
from .kir import nodes as K
from .kir import printer, verify
from .kir.build import INF, Block
from .kir.dtypes import dtype_of


class ChunkStage:
    """One class stage's statements for one state, built in order."""

    # Triton's functions (kir/build.py), handed to the class modules, which cannot import codegen
    dot = staticmethod(b.dot)               # _mixc_dot(a, b, DOT)
    trans = staticmethod(b.trans)           # tl.trans
    exp = staticmethod(b.exp)               # tl.exp
    where = staticmethod(b.where)           # tl.where, its operands broadcast to one block
    maximum = staticmethod(b.maximum)       # tl.maximum
    minimum = staticmethod(b.minimum)       # tl.minimum
    INF = INF

    def __init__(self, code, st: P.StatePlan):
        self.code, self.st = code, st
        kf, vf = matrix_axes(code.plan, st)
        self.axes = {"i": b.ROWS, "j": b.KEY_ROWS, "K": kf, "V": vf}
        self.stmts: list[K.Stmt] = []                                        # the open block's (a loop's body inside one)
        self.made: dict[str, tuple[K.Dims, str]] = {}                        # every name a Let of the stage made
        self.free: dict[str, tuple[K.Dims, str]] = {"DOT": ((), "i32")}      # what the stage reads, defined before it
        self.offs = self.block("_offs__T", "i", dtype="i32")                # the row index [i]
        # the pair (i, j) indices, broadcast as the kernel reads them ([i, j]: _offs__T[:, None], _offs__T[None, :])
        self.row_i = Block(K.Broadcast(self.offs.e, (b.ROWS, b.KEY_ROWS)))
        self.key_j = Block(K.Broadcast(self.at_keys(self.offs).e, (b.ROWS, b.KEY_ROWS)))
        self.n_valid = self.block("_n_valid", dtype="i32")                   # the chunk's real rows
        self.rows_block = self.block("_BLOCK__T", dtype="i32")               # C, the chunk's block of rows

    # ---- names ----
    def block(self, x: str, *axes: str, dtype: str = "f32") -> Block:
        """A name the stage reads, defined before it (an argument of the hook, a name of the
        chunk's), with its axes by letter."""
        assert x.isidentifier(), f"{x!r}: a chunk stage reads names, not text"
        dims = tuple(self.axes[a] for a in axes)
        have = self.made.get(x, self.free.get(x))
        if have is not None and have != (dims, dtype):
            raise verify.KirError(f"{x} is read as [{', '.join(dims)}], elsewhere as [{', '.join(have[0])}]")
        if x not in self.made:
            self.free[x] = (dims, dtype)
        return Block(K.Name(x, dims))

    def state(self) -> Block:
        """s_<S>: the state S0 at the chunk's start [K, V] (a stage advancing it re-assigns it)."""
        return self.block(f"s_{self.st.name}", "K", "V")

    def state_grad(self) -> Block:
        """d_<S> = dL/dS_C [K, V]."""
        return self.block(f"d_{self.st.name}", "K", "V")

    def at_keys(self, x) -> Block:
        """x's rows i read as the key rows j of the pairs (no code)."""
        return b.rename(x, b.ROWS, b.KEY_ROWS)

    def at_rows(self, x) -> Block:
        """x's key rows j read as the chunk's rows i again (a gradient per key is one per row)."""
        return b.rename(x, b.KEY_ROWS, b.ROWS)

    def causal(self, prev: bool) -> Block:
        """The pairs (i, j) a readout reads: j < i where it reads S_{t-1} (prev), else j <= i."""
        return self.row_i > self.key_j if prev else self.row_i >= self.key_j

    def cumsum(self, x, over: str) -> Block:
        """tl.cumsum along the axis of that letter."""
        return Block(K.Scan("tl.cumsum", b.lift(x), self.axes[over]))

    def sum(self, x, over: str | None = None) -> Block:
        """tl.sum over the axis of that letter (None: every axis)."""
        return b.sum(x, None if over is None else self.axes[over])

    def let(self, x: str | Block, value: Block, *axes: str) -> Block:
        """x = value, a block with these axes (by letter: broadcasting by dims would take a
        wrong operand to a larger block rather than fail, so the stage says what it makes); x a
        name or the block of one (a re-assignment: it keeps x's dims). The name, to read on."""
        if isinstance(x, Block):
            assert isinstance(x.e, K.Name), f"{x!r}: only a name is assigned"
            x = x.e.id
        value = b.lift(value)
        want = tuple(self.axes[a] for a in axes)
        if value.dims != want:
            raise verify.KirError(f"{x} = {printer.expr(value)[:80]}: a block [{', '.join(value.dims)}], "
                                  f"the stage makes [{', '.join(want)}]")
        dtype = dtype_of(value, lambda n: self.made.get(n, self.free.get(n, (None, None)))[1]) or "f32"
        self.stmts.append(b.let(x, value, dtype))
        self.made[x] = (value.dims, dtype)
        return Block(K.Name(x, value.dims))

    def acc(self, x: Block, value) -> None:
        """x += value (x made before, value of its axes): a sum a loop carries."""
        assert isinstance(x.e, K.Name), f"{x!r}: only a name is added into"
        value = b.lift(value)
        if value.dims != x.dims:
            raise verify.KirError(f"{x.e.id} += {printer.expr(value)[:80]}: a block [{', '.join(value.dims)}] "
                                  f"into [{', '.join(x.dims)}]")
        self.stmts.append(K.Acc(x.e.id, value))

    @contextmanager
    def loop(self, var: str, start, stop, static: bool = False):
        """for var in range(start, stop) (tl.static_range where static): the statements made
        inside the `with` are its body; yields the loop variable."""
        start, stop = b.lift(start), b.lift(stop)
        look = lambda n: self.made.get(n, self.free.get(n, (None, None)))[1]       # noqa: E731
        self.made[var] = ((), dtype_of(K.BinOp("+", start, stop), look) or "i64")   # as the verifier types it
        outer, self.stmts = self.stmts, []
        try:
            yield Block(K.Name(var))
        finally:
            body, self.stmts = tuple(self.stmts), outer
        self.stmts.append(K.For(var, start, stop, body, static))

    @staticmethod
    def broadcast_rows(x: Block) -> Block:
        """A row vector [i] indexed to the pairs [i, j] (x[:, None]), before arithmetic on it."""
        return Block(K.Broadcast(x.e, (b.ROWS, b.KEY_ROWS)))

    def zeros(self, *axes: str) -> Block:
        """tl.zeros of these axes (by letter)."""
        return Block(K.Zeros(tuple(self.axes[a] for a in axes)))

    def store(self, ptr: Block, value, mask) -> None:
        """tl.store(ptr, value, mask=mask): ptr a block of addresses of value's axes."""
        value, mask = b.broadcast(value, mask)
        self.stmts.append(K.Store(ptr.e, (), value, mask))

    @staticmethod
    def load(ptr: Block, mask, other: float = 0.0) -> Block:
        """tl.load(ptr, mask=mask, other=other).to(tl.float32): ptr a block of addresses."""
        mask = K.Broadcast(b.lift(mask), ptr.dims) if b.lift(mask).dims != ptr.dims else b.lift(mask)
        return Block(K.Cast(K.Load(ptr.e, (), mask, b.num(other)), K.Const("tl.float32")))

    @staticmethod
    def cast_to_element(x: Block, ptr: Block) -> Block:
        """x.to(ptr.dtype.element_ty): x in the dtype a buffer holds."""
        return Block(K.Cast(x.e, K.ElementType(ptr.e)))

    # ---- blocks shaped at run time like another (they follow a key split's block: kir.ZerosLike) ----
    @staticmethod
    def zeros_like(x: Block, f32: bool = True) -> Block:
        """tl.zeros(x.shape, dtype=tl.float32); f32 False: tl.zeros_like(x), x's dtype too."""
        return Block(K.ZerosLike(x.e, f32))

    @staticmethod
    def row_index(index, like: Block) -> Block:
        """A row index [i] materialized to the shape of `like` [i, d] (tl.broadcast_to)."""
        index = b.lift(index)
        return Block(K.BroadcastTo(K.Broadcast(index, like.dims) if index.dims != like.dims else index, like.e))

    @staticmethod
    def gather_rows(x: Block, index: Block) -> Block:
        """x [i, d] with row i taken from row index[i, :] (tl.gather along the rows)."""
        return Block(K.Gather(x.e, index.e, 0))

    def rows_at(self, x: Block, index) -> Block:
        """x [i, d] with row i taken from row index[i] of a row vector index [i]."""
        return self.gather_rows(x, self.row_index(index, x))

    @staticmethod
    def subchunk_sum(x, like: Block, size: int = 16) -> Block:
        """x [i, d] summed over each sub-chunk of `size` rows, the sum in each of its rows."""
        return Block(K.SubchunkSum(b.lift(x), like.e, size))

    # ---- the chunk's log weights (ChunkCode's), as blocks ----
    def _logs(self, x, *axes: str):
        return tuple(self.block(n, *axes) for n in x) if isinstance(x, tuple) else self.block(x, *axes)

    def pair_ok(self, zq: str) -> Block:
        """The pairs (i, j) with no reset between them: z at the query row's read (zq) equals z
        at the key (ChunkCode.pair_ok's mask, [i, j] or [i, j, V])."""
        axes = ("i",) + self.decay_axes()
        z = self.block(f"_z_{self.st.name}", *axes)
        return self.block(zq, *axes).eq(self.at_keys(z))

    def decay_axes(self) -> tuple[str, ...]:
        """The letters of the chunk's log decay's axes beside its rows: () for a [C] vector
        (a scalar decay), ("K",) per key, ("V",) per value."""
        if not self.code.g_axes[self.st.name]:
            return ()
        return ("K",) if classes.unit(self.st.transition).decay_axis(self.st) == "key" else ("V",)

    # ---- the helpers of the generated module (standalone: _mixc_solve_lower ...) ----
    def solve_lower(self, M, Y) -> Block:
        """(I - M)^-1 Y for a strictly lower triangular M [i, j] and Y [i, n], by forward
        substitution over the rows (_mixc_solve_lower)."""
        return Block(K.Helper("_mixc_solve_lower", (b.lift(M), b.lift(Y), self.offs.e, self.rows_block.e), 1))

    def solve_upper_t(self, M, Y) -> Block:
        """(I - M)^-T Y, by back substitution (_mixc_solve_upper_t)."""
        return Block(K.Helper("_mixc_solve_upper_t", (b.lift(M), b.lift(Y), self.offs.e, self.rows_block.e), 1))

    def intra_address(self, slot) -> Block:
        """The addresses [i, j] of the chunk's staged [C, C] matrix at `slot` (chunk.IntraSlot) in
        p_intra, row-major per token row ([rows, H, count, C])."""
        row = self.broadcast_rows(self.block("_rows", "i", dtype="i32")) * self.block("H", dtype="i32") \
            + self.block("i_h", dtype="i32")
        if slot.count != 1:
            row = row * slot.count + slot.index
        return self.block("p_intra", dtype="ptr") + row * self.rows_block + self.at_keys(self.offs)

    def query_logs(self, prev: bool, *axes: str) -> tuple[list[str], Block, Block, Block]:
        """(lines, bq, bq0, ok) of a diagonal decay's readout ([i, axes] each): ChunkCode's
        query_decay, query_b0 and pair_ok."""
        code, st = self.code, self.st
        pre, bq = code.query_decay(st, prev)
        return (pre, self.block(bq, "i", *axes), self.block(code.query_b0(st, prev), "i", *axes),
                self.pair_ok(code.query_z(st, prev)))

    def scalar_logs(self, prev: bool):
        """(lines, bq, bk, b0, ok) of a scalar decay's readout: ChunkCode.scalar_logs' names
        as [i] blocks (bq, bk a (hi, lo) pair where b is compensated), and the pair mask."""
        code, st = self.code, self.st
        pre, bq, bk, b0 = code.scalar_logs(st, prev)
        return pre, self._logs(bq, "i"), self._logs(bk, "i"), self.block(b0, "i"), self.pair_ok(code.query_z(st, prev))

    def scalar_advance_logs(self) -> tuple[Block, Block]:
        """(log weight of S0 in S_C, log weights [i] of the chunk's keys in S_C); a stabilized
        state's relative to m at the chunk's end."""
        n = self.st.name
        bl0, kw = self.block(f"_bl0_{n}"), self.block(f"_kw_{n}", "i")
        if not self.code.stabilized(self.st):
            return bl0, kw
        # padded rows weigh nothing: their kw + gi is 0, and 0 - m overflows exp once m < -88
        # (their K rows are 0, and 0 * inf is NaN)
        m_new = self.block("_mnew")
        return (bl0 + self.block("_M0") - m_new,
                b.where(self.block("_mask__T", "i", dtype="i1"), kw + self.block("_gi", "i") - m_new, -INF))

    # ---- the stage's text ----
    def lines(self) -> list[str]:
        """The statements, verified against the dims of what they read, printed at the chunk
        loop's indent, each block's shape in a comment after it (`# [_T, K]`: the ast passes that
        split the chunk body cut its text by statement lines, so a line's comment goes with it)."""
        verify.verify_block(self.stmts, self.free)
        return [line for s in self.stmts for line in printer.stmt(s, self.code.indent)]

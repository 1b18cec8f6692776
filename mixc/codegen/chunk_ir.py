"""The chunked kernels' scaffolding as kernel IR (codegen/kir): each stage's kernel (module.py:
one per stage, `<spec>_chunk_fwd_<stage>`, `<spec>_chunk_bwd_<stage>`) is a kir Kernel whose
program ids, sequence bounds, lanes and masks, params and grouped heads, chunk loop, checkpoint
walk and constexpr switches are IR statements, and in the forward the states' loads and stores
(initial, checkpoints, dense, final) and the inputs' loads too; what the hooks still render as
text (the forward's chunk body with the class stages: chunk.py, the units' hooks, built as
IR and printed into lines; the backward's gradients and chunk: chunk_bwd.py) enters as Text statements where the templates
put it.

The kernels are verified as built and printed by the one printer; the ast passes (key_split.py,
tile_split.py) then read the printed text as they read the rendered templates it replaces (the
same Python statements, checked when the templates went: docs/design-notes.md). The next step
builds the Texts as IR: then the passes become rewrites of these kernels."""
from __future__ import annotations

from ..derive import plan as P
from ..derive.plan import Plan
from ..derive.stabilize import M_EMPTY
from .kir import nodes as K
from .kir import printer
from .recurrent_ir import (F32, add, arg, arguments, i64, input_row, lanes, let, mul, name, nprog, num, op,
                           params_and_heads, pid)
from .triton_expr import canon

UNIT = "_1"            # the unit axis of a state without key (or value) dims

# the hooks' texts are indented as the templates placed them: a Text's lines are relative
I1, I2 = "    ", "        "


def text(hook: str, indent: str, what: str) -> K.Text:
    """A hook's lines (each at `indent` or deeper, or blank) as a Text relative to `indent`."""
    lines = []
    for line in hook.split("\n"):
        if not line.strip():
            lines.append("")
            continue
        if not line.startswith(indent):
            raise AssertionError(f"{what}: a line less indented than {len(indent)} spaces: {line!r}")
        lines.append(line[len(indent):])
    return K.Text(tuple(lines), what)


def blank() -> K.Comment:
    return K.Comment("")


def _blocks(n: K.Expr, span: K.Expr) -> K.Expr:
    """(n + span - 1) // span: the spans n tokens need."""
    return op("//", op("-", add(n, span), num(1)), span)


def programs(slots: bool, span: K.Expr, span_what: str) -> list[K.Stmt]:
    """This kernel's (sequence, head) and chunks. slots: one program per (slot, head), numbered
    as the checkpoints (the forward's output, refill and intra kernels, the backward's tiles);
    else one program per (sequence, head) walking all the sequence's chunks (the walks)."""
    H, T = arg("H"), arg("T")
    i_n, bos, slot = name("i_n"), name("bos"), name("_slot")
    bounds = (let("bos", i64(K.Load(arg("cu_seqlens"), (i_n,))), "i64"),
              let("eos", i64(K.Load(arg("cu_seqlens"), (i_n, num(1)))), "i64"))
    dense = (let("bos", mul(i64(i_n), T), "i64"), let("eos", add(bos, T), "i64"))
    if not slots:
        return [
            K.Comment("One program per (sequence, head): it walks all the sequence's chunks."),
            let("i_n", op("//", pid(0), H), "i32"),
            let("i_h", op("%", pid(0), H), "i32"),
            K.If(arg("varlen"), bounds, dense),
            let("_prow", i_n, "i32"),
            let("_nprow", arg("n_seqs"), "i32"),
        ]
    return [
        K.Comment("One program per (slot, head), numbered as the checkpoints (sequence i's from bos_i // span"),
        K.Comment("+ i); _first is its slot within the sequence, none where the slot lies past the sequence's"),
        K.Comment(f"last. A slot: {span_what}, span = {_span_text(span)} tokens."),
        let("i_h", op("%", pid(0), H), "i32"),
        let("_slot", op("//", pid(0), H), "i32", "this program's slot"),
        K.If(arg("varlen"), (
            let("i_n", K.Load(arg("chunk_seq"), (slot,)), "i32"),
            *bounds,
            let("_first", op("-", op("-", slot, op("//", bos, span)), i_n), "i64",
                "past the sequence's slots: nothing to do"),
        ), (
            let("i_n", op("//", slot, _blocks(T, span)), "i32"),
            *dense,
            let("_first", op("%", slot, _blocks(T, span)), "i32"),
        )),
        let("_prow", slot, "i32", "the params' partials: per chunk slot"),
        let("_nprow", op("//", nprog(0), H), "i32"),
    ]


def _span_text(span: K.Expr) -> str:
    return printer.expr(span)


def lanes_of_chunk(plan: Plan) -> list[K.Stmt]:
    """The chunk's rows, the unit axis and each dim's lanes (the tile dim's: this program's block)."""
    tile = plan.layout.tile
    return [
        let("_offs__T", K.Arange("_T"), "i32", "the chunk's rows [C]"),
        let("_offs__1", K.Arange("_1"), "i32"),
        let("_mask__1", op("<", name("_offs__1", ("_1",)), num(1)), "i1"),
        *[s for d in plan.kernel_ir.dim_names for s in lanes(d, 1 if d == tile else None)],
    ]


def params(plan: Plan) -> list[K.Stmt]:
    return [blank(), K.Comment("params"), *params_and_heads(plan)]


def chunk_rows(chunk: K.Expr) -> list[K.Stmt]:
    """The chunk's token rows, their mask and how many are in the sequence."""
    C, bos, eos = arg("chunk"), name("bos"), name("eos")
    start = mul(chunk, C)
    return [
        let("_rows", add(bos, start, name("_offs__T", ("_T",))), "i64", "the chunk's token rows [C]"),
        let("_mask__T", op("<", name("_rows", ("_T",)), eos), "i1"),
        let("_n_valid", K.Call("tl.minimum", (op("-", op("-", eos, bos), start), C)), "i64"),
    ]


def n_chunks() -> K.Let:
    C = arg("chunk")
    return let("_n_chunks", op("//", op("-", add(op("-", name("eos"), name("bos")), C), num(1)), C), "i64")


# ---- the states as [key, value] matrices: their flat axes and addresses ----

def order(plan: Plan) -> tuple[str, ...]:
    """The chunked kernels' canonical axis order: the chunk's rows, the spec's dims, the unit axis."""
    return ("_T",) + plan.ir.dim_names + (UNIT,)


def state_axes(plan: Plan, st: P.StatePlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A state's key dims and value dims, canonical (the unit axis where it has none)."""
    o = order(plan)
    return canon(o, st.key_dims) or (UNIT,), canon(o, st.value_dims) or (UNIT,)


def _and(*xs: K.Expr) -> K.Expr:
    out = xs[0]
    for x in xs[1:]:
        out = op("&", out, x)
    return out


def flat_axis(plan: Plan, stem: str, dims: tuple[str, ...], ax: str, decl: tuple[str, ...],
              tile_block: K.Expr) -> list[K.Let]:
    """_f<stem>: the lanes of a flat axis over dims' blocks; _i<stem>_<i>: each dim's index in
    it (the tile dim's: in this program's block, tile_block); _o<stem>: its offset in a state
    laid out as `decl`; _m<stem>: its mask. An index is named by the dim's position, not its
    name: `_ik_S_K_V` could be state S_K's dim V or state S's dim K_V. ax: the axis's name
    (matrix_axes)."""
    f = name(f"_f{stem}", (ax,))
    out = [let(f.id, K.Arange(ax), "i32")]
    offs, masks = [], []
    for i, d in enumerate(dims):
        inner = dims[i + 1:]
        idx = op("//", f, mul(*[arg("block", x) for x in inner])) if inner else f
        idx = op("%", idx, arg("block", d)) if i else idx
        if d == plan.layout.tile:           # this program's block of the tile dim (grid axis 1)
            idx = add(mul(tile_block, arg("block", d)), idx)
        index = name(f"_i{stem}_{i}", (ax,))
        out.append(let(index.id, idx, "i32", d))
        if d == UNIT:
            masks.append(op("<", index, num(1)))
            continue
        stride = decl[decl.index(d) + 1:]
        offs.append(mul(index, *[arg("size", x) for x in stride]))
        masks.append(op("<", index, arg("size", d)))
    out.append(let(f"_o{stem}", add(*offs) if offs else mul(num(0), f), "i32"))
    out.append(let(f"_m{stem}", _and(*masks), "i1"))
    return out


def matrix_axes(plan: Plan, st: P.StatePlan) -> tuple[str, str]:
    """The axes of a state's matrix: its key dims' flat axis and its value dims' (a state
    without either has two unit axes, the second named apart: [_1, _1'])."""
    kd, vd = state_axes(plan, st)
    k, v = K.flat(*kd), K.flat(*vd)
    return k, K.second(v) if v == k else v


def state_matrix(plan: Plan, st: P.StatePlan) -> K.Name:
    return name(f"s_{st.name}", matrix_axes(plan, st))


def state_address(plan: Plan, st: P.StatePlan, base: K.Expr) -> tuple[tuple[K.Expr, ...], K.Expr]:
    """(offsets, mask) of a state's matrix in row `base` of a buffer [rows, *its shape]."""
    n, dims = st.name, state_matrix(plan, st).dims
    decl = plan.ir.state(n).shape
    ok, ov, mk, mv = (name(f"_{x}{side}_{n}", (ax,)) for x in "om" for side, ax in zip("kv", dims))
    rows = mul(base, *[arg("size", d) for d in decl]) if decl else mul(base, num(1))
    return ((rows, K.Broadcast(ok, dims), K.Broadcast(ov, dims)),
            op("&", K.Broadcast(mk, dims), K.Broadcast(mv, dims)))


def load_state(plan: Plan, st: P.StatePlan, ptr: K.Name, base: K.Expr, cast: bool = True) -> K.Let:
    offs, mask = state_address(plan, st, base)
    value = K.Load(ptr, offs, mask, num(0.0))
    s = state_matrix(plan, st)
    return K.Let(s.id, K.Cast(value, F32) if cast else value, s.dims, "f32")


def store_state(plan: Plan, st: P.StatePlan, ptr: K.Name, base: K.Expr, cast: bool = True) -> K.Store:
    offs, mask = state_address(plan, st, base)
    s = state_matrix(plan, st)
    return K.Store(ptr, offs, K.Cast(s, K.ElementType(ptr)) if cast else s, mask)


def seq_row() -> K.Expr:
    """A state's row per (sequence, head)."""
    return add(mul(name("i_n"), arg("H")), name("i_h"))


def dense_slot() -> K.Expr:
    """The chunk's slot among every chunk start: sequence i's chunks from bos_i // C + i."""
    return add(op("//", name("bos"), arg("chunk")), name("i_n"), name("_chunk"))


def stabilizer(plan: Plan) -> bool:
    return plan.stabilizer is not None


def m_offsets(row: K.Expr) -> tuple[K.Expr, K.Expr]:
    """The stabilizer m's address: a scalar per (row, head), added as row * H, then i_h."""
    return (mul(row, arg("H")), name("i_h"))


def init_states(plan: Plan, walks: bool) -> list[K.Stmt]:
    """Each state's flat axes and its matrix, zero (walks: the initial state where given); the
    slot kernels start from a checkpoint (or have no state: intra)."""
    out: list[K.Stmt] = []
    for st in plan.states:
        kd, vd = state_axes(plan, st)
        decl = plan.ir.state(st.name).shape
        ka, va = matrix_axes(plan, st)
        out += (flat_axis(plan, f"k_{st.name}", kd, ka, decl, pid(1))
                + flat_axis(plan, f"v_{st.name}", vd, va, decl, pid(1)))
        s = state_matrix(plan, st)
        out.append(K.Let(s.id, K.Zeros(s.dims), s.dims, "f32"))
        if walks:
            out.append(K.If(arg("use_initial"), (load_state(plan, st, arg("init", st.name), seq_row(), cast=False),)))
    if stabilizer(plan):          # the stabilizer m: a scalar per (sequence, head)
        out.append(let("s__m", add(mul(name("_fhead"), num(0.0)), num(M_EMPTY)),
                       comment="an empty state's m (derive/stabilize.py)"))
        if walks:
            out.append(K.If(arg("use_initial"), (let("s__m", K.Load(arg("init", "_m"), (*m_offsets(name("i_n")),))),)))
    return out


def load_checkpoint(plan: Plan) -> list[K.Stmt]:
    """The states at the checkpoint _ck_slot (in the inputs' dtype where that is bf16/fp16:
    launch.checkpoint_dtype), as float32."""
    row = add(mul(name("_ck_slot"), arg("H")), name("i_h"))
    out: list[K.Stmt] = [load_state(plan, st, arg("ckpt", st.name), row) for st in plan.states]
    if stabilizer(plan):
        out.append(let("s__m", K.Load(arg("ckpt", "_m"), m_offsets(name("_ck_slot")))))
    return out


def segment_correction(plan: Plan) -> list[K.Stmt]:
    """The output kernel of the segmented walk (standalone/segments.py, SEGMENTED): the checkpoint
    just loaded holds the state from its segment's start at zero; its segment's true start
    (seg_start, row i_n: the segments are the stream's sequences), decayed per key row by
    exp(seg_decay[_ck_slot]), added: the true state, as unsegmented. Where the checkpoints are kept
    (STORE_CHECKPOINTS: training), the corrected one is stored back for the backward (each program
    its own slot and tile block). Only the scalar and key-diagonal classes take this launch, their
    key dims leading the state (segments.unsupported): a key row's index is its offset // the value
    dims' size."""
    row = add(mul(name("_ck_slot"), arg("H")), name("i_h"))
    out: list[K.Stmt] = [K.Comment("the segmented walk: this segment's true start, decayed to the checkpoint, added")]
    for st in plan.states:
        s = state_matrix(plan, st)
        ka, _ = s.dims
        n, (kd, vd) = st.name, (st.key_dims, st.value_dims)
        keys = mul(*[arg("size", d) for d in kd]) if kd else num(1)
        values = mul(*[arg("size", d) for d in vd]) if vd else num(1)
        decay = K.Load(arg("seg_decay", n), (mul(row, keys), op("//", name(f"_ok_{n}", (ka,)), values)),
                       name(f"_mk_{n}", (ka,)), num(0.0))
        offs, mask = state_address(plan, st, seq_row())
        start = K.Load(arg("seg_start", n), offs, mask, num(0.0))
        out.append(K.Let(s.id, add(s, mul(K.Broadcast(K.Call("tl.exp", (decay,)), s.dims), start)), s.dims, "f32"))
    out.append(K.If(arg("store_ckpt"), tuple(store_checkpoint(plan))))
    return [K.If(arg("segmented"), tuple(out))]


def store_checkpoint(plan: Plan) -> list[K.Stmt]:
    row = add(mul(name("_ck_slot"), arg("H")), name("i_h"))
    out: list[K.Stmt] = [store_state(plan, st, arg("ckpt", st.name), row) for st in plan.states]
    if stabilizer(plan):
        out.append(K.Store(arg("ckpt", "_m"), m_offsets(name("_ck_slot")), name("s__m")))
    return out


def store_dense(plan: Plan) -> list[K.Stmt]:
    """Every state at this chunk's start (the refill, for the backward)."""
    row = add(mul(dense_slot(), arg("H")), name("i_h"))
    out: list[K.Stmt] = [store_state(plan, st, arg("dense", st.name), row) for st in plan.states]
    if stabilizer(plan):
        out.append(K.Store(arg("dense", "_m"), m_offsets(dense_slot()), name("s__m")))
    return out


def store_final(plan: Plan) -> list[K.Stmt]:
    out: list[K.Stmt] = [store_state(plan, st, arg("final", st.name), seq_row(), cast=False) for st in plan.states]
    if stabilizer(plan):
        out.append(K.Store(arg("final", "_m"), m_offsets(name("i_n")), name("s__m")))
    return out


def load_inputs(plan: Plan) -> list[K.Let]:
    """Each input's rows of this chunk [C, *dims] at its head, float32 (padded rows and lanes 0)."""
    o, out = order(plan), []
    for d in plan.ir.inputs:
        full = ("_T",) + canon(o, d.shape)
        offs = [mul(K.Broadcast(name(f"_offs_{x}", (x,)), full), *[arg("size", y) for y in d.shape[i + 1:]])
                for i, x in enumerate(d.shape)]
        mask = _and(*[K.Broadcast(name(f"_mask_{x}", (x,)), full) for x in full])
        row = input_row(d.name, K.Broadcast(name("_rows", ("_T",)), full))
        rows = mul(row, *[arg("size", x) for x in d.shape]) if d.shape else mul(row, num(1))
        out.append(K.Let(f"v_{d.name}", K.Cast(K.Load(arg("input", d.name), (rows, *offs), mask, num(0.0)), F32),
                         full, "f32"))
    return out


def forward_kernel(plan: Plan, kernel: str, header: tuple[str, ...], stage: str, hooks: dict,
                   rewalk: bool = False) -> K.Kernel:
    """One stage's kernel of the chunked forward (fused, walk, output, refill or intra): what it
    reads and writes is in its header (chunk_kernels.CHUNK_STAGES). rewalk: the output kernel's
    variant that walks CKPT_EVERY > 1 chunks from their checkpoint, the state carried in
    registers (else one chunk a program, its state loaded in the chunk: chunk_kernels.VARIANTS)."""
    slots = stage in ("output", "refill", "intra")
    every = arg("ckpt_every")
    span = mul(arg("chunk"), every)
    chunk, bos, i_n = name("_chunk"), name("bos"), name("i_n")
    body: list[K.Stmt] = [
        *programs(slots, span, "CKPT_EVERY chunks (one checkpoint's)"),
        blank(),
        let("_fhead", mul(name("i_h"), num(1.0))),
        *lanes_of_chunk(plan),
        *params(plan),
        blank(), K.Comment("states as [key, value] matrices"), *init_states(plan, stage in ("fused", "walk")),
        blank(), n_chunks(),
    ]
    if slots:
        body += [
            K.Comment("this program's CKPT_EVERY chunks (none past the sequence's last), from their checkpoint"),
            let("_c_lo", mul(name("_first"), every), "i64"),
            let("_c_hi", K.Call("tl.minimum", (add(name("_c_lo"), every), name("_n_chunks"))), "i64"),
            let("_ck_slot", add(op("//", bos, span), i_n, name("_first")), "i64"),
        ]
        if stage == "refill" or (stage == "output" and rewalk):
            # (the refill runs only where CKPT_EVERY > 1: Launcher.chunk_states); the output adds the
            # segment's true start where the walk was segmented (SEGMENTED: standalone/segments.py)
            fix = segment_correction(plan) if stage == "output" and not stabilizer(plan) else []
            body += [K.Comment("the state advances through the chunks in registers"), *load_checkpoint(plan), *fix]
    else:
        body += [let("_c_lo", num(0), "i32"), let("_c_hi", name("_n_chunks"), "i64")]
    loop: list[K.Stmt] = chunk_rows(chunk)
    if stage == "output" and not rewalk:
        loop += [
            K.Comment("one chunk, its state loaded here: nothing carries over, so its advance is dead"),
            K.Comment("code (fewer live registers: the output kernel spills nothing at K = V = 128, bench/README.md)"),
            *load_checkpoint(plan), *([] if stabilizer(plan) else segment_correction(plan))]
    elif stage == "refill":
        loop += [
            K.Comment("every chunk's start state, for the backward"),
            *store_dense(plan),
            K.Comment("the last chunk's advance reaches the next checkpoint, stored already: its rows"),
            K.Comment("masked, nothing of it is loaded"),
            let("_mask__T", op("<", name("_rows", ("_T",)), K.Call("tl.where", (
                op("<", chunk, op("-", name("_c_hi"), num(1))), name("eos"), bos))), "i1"),
        ]
    elif stage in ("fused", "walk"):
        loop.append(K.If(arg("store_ckpt"), (
            K.Comment("at the start of every CKPT_EVERY-th chunk"),
            K.If(op("==", op("%", chunk, every), num(0)), (
                let("_ck_slot", add(op("//", bos, span), i_n, op("//", chunk, every)), "i64"),
                *store_checkpoint(plan))),
        )))
    loop += [K.Comment("the chunk's inputs [C, *dims], lets, keys, values, log decays"),
             *load_inputs(plan),
             text(hooks["chunk_body"], I2, "chunk_body")]
    body.append(K.For("_chunk", name("_c_lo"), name("_c_hi"), tuple(loop)))
    if stage in ("fused", "walk"):
        body += [blank(), K.If(arg("store_final"), tuple(store_final(plan)))]
    return K.Kernel(kernel, header, arguments(plan, "chunk_fwd"), tuple(body))


def backward_kernel(plan: Plan, kernel: str, header: tuple[str, ...], stage: str, hooks: dict) -> K.Kernel:
    """One stage's kernel of the chunked backward (fused, walk or tiles)."""
    slots = stage == "tiles"
    tile = plan.layout.tile
    T, n_seqs = arg("T"), arg("n_seqs")
    body: list[K.Stmt] = [
        *programs(slots, arg("chunk"), "a chunk"),
        blank(),
        let("_fhead", mul(name("i_h"), num(1.0))),
        let("_nseq", n_seqs, "i32", "rows of the per-tile gradient partials"),
        K.If(arg("varlen"), (let("_ntok", T, "i32"),), (let("_ntok", mul(n_seqs, T), "i32"),)),
        *lanes_of_chunk(plan),
    ]
    if tile is not None:
        body.append(let("_N_TILES", _blocks(arg("size", tile), arg("block", tile)), "i32", "blocks of the tile dim"))
    body += [*params(plan),
             blank(), K.Comment("gradients of the states (from the final state's) and of the params"),
             text(hooks["init_grads"], I1, "init_grads"),
             blank(), n_chunks()]
    if slots:
        body += [K.Comment("the one chunk of this program (none past the sequence's last)"),
                 let("_cc_hi", op("-", name("_n_chunks"), name("_first")), "i64"),
                 let("_cc_lo", K.Call("tl.maximum", (op("-", name("_cc_hi"), num(1)), num(0))), "i64")]
    else:
        body += [K.Comment("the chunks from last to first, dL/dS carried back in registers"),
                 let("_cc_lo", num(0), "i32"), let("_cc_hi", name("_n_chunks"), "i64")]
    chunk = name("_chunk")
    # the chunk's backward: with a tile dim, its tile loop (a for header in the text) holds the
    # checkpoint's loads, the inputs and the body, and the sums after it
    parts = ([hooks["tile_loop"]] if tile is not None else []) + [
        hooks["load_checkpoint"], hooks["load_inputs"], hooks["chunk_backward"]] + (
        [hooks["store_sums"]] if tile is not None else [])
    loop = [let("_chunk", op("-", op("-", name("_n_chunks"), num(1)), name("_cc")), "i64"),
            *chunk_rows(chunk),
            text("\n".join(parts), I2, "chunk_backward")]
    body += [K.For("_cc", name("_cc_lo"), name("_cc_hi"), tuple(loop)),
             blank(), text(hooks["store_grads"], I1, "store_grads")]
    return K.Kernel(kernel, header, arguments(plan, "chunk_bwd"), tuple(body))

"""The fused recurrent kernels, built as kernel IR (codegen/kir) and printed once: one program
per (sequence, head), states in registers, tokens in order. The forward is also the decode step
(T = 1, a state in and out); the backward (recurrent_bwd_ir.py) recomputes each chunk of CK
tokens from a checkpointed state and walks its tokens in reverse with the adjoint of the same
per-token code (adjoint.py). codegen/module.py runs RECURRENT_PASSES on both, the verifier after
each (kir/passes.py); `mixc compile SPEC --dump kir` prints them after each."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..derive.plan import Plan
from ..derive.stabilize import M, M_EMPTY
from ..dsl import ir
from ..standalone.kernel_args import ROLES
from .kir import nodes as K
from .kir import passes, printer
from .kir.build import add, let, mul, name, num, op  # noqa: F401 (the small constructors, re-exported)
from .triton_expr import Emitter, canon, mask_expr

Var = tuple[str, tuple[str, ...]]
RECURRENT_PASSES = (passes.DEAD_LETS, passes.HOIST_INVARIANTS)
F32 = K.Const("tl.float32")
I64 = K.Const("tl.int64")


# ---- small constructors ----

def arg(role: str, of: str | None = None) -> K.Name:
    """A kernel argument by its role: its name from the one definition (standalone/kernel_args.py)."""
    return name(ROLES[role].name.format(of))


def pid(axis: int) -> K.Expr:
    return K.Call("tl.program_id", (num(axis),))


def nprog(axis: int) -> K.Expr:
    return K.Call("tl.num_programs", (num(axis),))


def i64(x: K.Expr) -> K.Expr:
    return K.Cast(x, I64)


def zeros(dims) -> K.Expr:
    """A float32 block of zeros (a scalar zero that is a runtime float: loops keep its type)."""
    return K.Zeros(tuple(dims)) if dims else mul(name("_fhead"), num(0.0))


# ---- addresses ----

def offsets(decl: tuple[str, ...], order) -> list[K.Expr]:
    """The terms of the offsets of a block laid out in declared order, as blocks in canonical
    order (each lane's index times the stride of its dim)."""
    cd = canon(order, decl)
    return [mul(K.Broadcast(name(f"_offs_{d}", (d,)), cd), *[arg("size", x) for x in decl[i + 1:]])
            for i, d in enumerate(decl)]


def address(base: K.Expr, decl, order) -> tuple[tuple[K.Expr, ...], K.Expr | None]:
    """(offsets, mask) of row `base` of a buffer [rows, *decl]: the row's start, then each
    dim's lanes times its stride, added to the pointer in turn."""
    if not decl:
        return (base,), None
    return (mul(base, *[arg("size", d) for d in decl]), *offsets(decl, order)), mask_expr(canon(order, decl))


def load(ptr: K.Name, base: K.Expr, decl, order) -> K.Expr:
    """Row `base` of a buffer [rows, *decl] as a float32 block (padded lanes 0)."""
    offs, mask = address(base, decl, order)
    return K.Cast(K.Load(ptr, offs, mask, num(0.0) if mask is not None else None), F32)


def store(ptr: K.Name, base: K.Expr, decl, order, value: K.Expr, cast: bool = False) -> K.Store:
    """Store a block into row `base` of a buffer [rows, *decl] (cast: to the buffer's dtype)."""
    offs, mask = address(base, decl, order)
    return K.Store(ptr, offs, K.Cast(value, K.ElementType(ptr)) if cast else value, mask)


def input_row(x: str, token: K.Expr) -> K.Expr:
    """The row of an input at a token: [B, T, H_x, *dims] read at head _head_x of its _heads_x."""
    return add(mul(token, name(f"_heads_{x}")), name(f"_head_{x}"))


def state_base(kind: str) -> K.Expr:
    """Row of a state in its buffer: per (sequence, head), per (cache slot, head) in the forward
    (slot: the sequence's own row, or its entry of state_indices), or per checkpoint / scratch
    slot. Checkpoint slots: sequence i's chunks start at bos // CK + i, which never overlaps
    sequence i - 1's, so packed sequences need at most (total tokens) // CK + N + 1 slots."""
    h, i_h = arg("H"), name("i_h")
    if kind == "seq":
        return add(mul(name("i_n"), h), i_h)
    if kind == "slot":
        return add(mul(name("i_s"), h), i_h)
    if kind == "ckpt":
        return add(mul(add(op("//", name("bos"), arg("ck")), name("i_n"), name("_chunk")), h), i_h)
    program = add(mul(add(mul(i64(pid(0)), nprog(1)), pid(1)), nprog(2)), pid(2))
    return add(mul(program, arg("ck")), name("_slot"))


def partial_index(plan: Plan, shape) -> K.Expr | None:
    """Which partial a program writes for a gradient (or output) of this shape: what lacks the
    tile dim gets one per tile, what lacks the split dim one per split block (summed on the
    host). None where every program writes its own elements of one buffer."""
    t, k = plan.layout.tile, plan.layout.split
    by_tile = t is not None and t not in shape
    by_split = k is not None and k not in shape
    if by_tile and by_split:
        return add(mul(i64(pid(1)), nprog(2)), pid(2))
    if by_tile:
        return i64(pid(1))
    if by_split:
        return i64(pid(2))
    return None


def tile_base(plan: Plan, shape, base: K.Expr, rows: str) -> K.Expr:
    """The row of a gradient of something without the tile or the split dim: each such
    program writes its own partial (summed on the host), rows offset by partial * rows."""
    index = partial_index(plan, shape)
    return base if index is None else add(mul(index, name(rows), arg("H")), base)


# ---- the kernels' common opening ----

def prologue(plan: Plan, split_comment: str, rows_comment: str) -> tuple[list[K.Stmt], list[K.Stmt]]:
    """What both kernels open with, in two parts (the forward puts the state's row between):
    the program's sequence, head and tokens; then the partial rows, each dim's lanes and masks,
    the params and the grouped heads."""
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    tile, split = plan.layout.tile, plan.layout.split
    body: list[K.Stmt] = [
        let("i_n", op("//", pid(0), arg("H")), "i32"),
        let("i_h", op("%", pid(0), arg("H")), "i32"),
        K.If(arg("varlen"),
             (let("bos", i64(K.Load(arg("cu_seqlens"), (name("i_n"),))), "i64"),
              let("eos", i64(K.Load(arg("cu_seqlens"), (name("i_n"), num(1)))), "i64")),
             (let("bos", mul(i64(name("i_n")), arg("T")), "i64"),
              let("eos", add(name("bos"), arg("T")), "i64"))),
        let("_fhead", mul(name("i_h"), num(1.0))),
    ]
    return body, [
        *([let("_not_first", K.Cast(op(">", pid(2), num(0)), F32), comment=split_comment)] if split else []),
        let("_nseq", op("//", nprog(0), arg("H")), "i32", rows_comment),
        K.If(arg("varlen"), (let("_ntok", arg("T"), "i32"),), (let("_ntok", mul(name("_nseq"), arg("T")), "i32"),)),
        *[s for d in order for s in lanes(d, 1 if d == tile else 2 if d == split else None)],
        K.Comment(""),
        K.Comment("params"),
        *params_and_heads(plan),
    ]


def params_and_heads(plan: Plan) -> list[K.Stmt]:
    """The params of this head, and each input's heads and the one this head reads (every
    kernel's, the chunked ones' too: chunk_ir.params)."""
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    # grouped heads: input x has H / _group_x heads and head i_h reads its head i_h // _group_x
    # (no copy per head; _group_x = 1, Triton's specialization, folds this away)
    return [
        *[let(f"v_{d.name}", load(arg("param", d.name), name("i_h"), d.shape, order)) for d in m.params],
        *([K.Comment("grouped heads: each input's heads, and the one this head reads")] if m.inputs else []),
        *[s for d in m.inputs for s in (let(f"_heads_{d.name}", op("//", arg("H"), arg("group", d.name)), "i32"),
                                        let(f"_head_{d.name}", op("//", name("i_h"), arg("group", d.name)), "i32"))],
    ]


def lanes(d: str, axis: int | None) -> list[K.Let]:
    """A dim's lanes: the whole dim's block, or (axis) this program's block of the tile or split dim."""
    lanes = K.Arange(d) if axis is None else add(mul(pid(axis), arg("block", d)), K.Arange(d))
    return [let(f"_offs_{d}", lanes, "i32", None if axis is None else f"this program's block of {d}"),
            let(f"_mask_{d}", op("<", name(f"_offs_{d}", (d,)), arg("size", d)), "i1")]


def arguments(plan: Plan, form: str) -> tuple[K.ArgLine, ...]:
    """The signature from the one definition of the arguments (standalone/kernel_args.py)."""
    return tuple(K.ArgLine(tuple(K.Arg(a.name, a.constexpr, _arg_dtype(a)) for a in line.args), line.comment)
                 for line in plan.layout.kernel_args[form].lines)


def _arg_dtype(a) -> str:
    """A parameter's dtype from its role: a pointer, a float scalar, else an int (constexprs too)."""
    return "ptr" if a.kind == "pointer" else "f32" if a.dtype == "fp32" else "i32"


def base_env(plan: Plan) -> dict[str, Var]:
    """The spec's names every token reads: params (loaded by the prologue) and float options."""
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    env = {d.name: (f"v_{d.name}", canon(order, d.shape)) for d in m.params}
    env.update({o.name: (f"v_{o.name}", ()) for o in m.options if o.kind == "float"})
    return env


@dataclass
class Token:
    """The forward code of one token: loads, lets, updates (from states `s_*`), output; every
    emitter shares one record of values (a renamed view is no Let of its own)."""

    plan: Plan
    stmts: list[K.Stmt] = field(default_factory=list)
    env: dict[str, Var] = field(default_factory=dict)
    new: dict[str, str] = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    def emitter(self, env, prefix: str) -> Emitter:
        return Emitter(self.plan.kernel_ir, env, prefix=prefix, values=self.values)

    def build(self, with_output: bool = True) -> "Token":
        m, order = self.plan.kernel_ir, self.plan.kernel_ir.dim_names
        self.env = base_env(self.plan)
        for d in m.inputs:      # its row: token _t, its head (grouped heads: prologue)
            self.stmts.append(let(f"v_{d.name}", load(arg("input", d.name), input_row(d.name, name("_t")), d.shape, order)))
            self.env[d.name] = (f"v_{d.name}", canon(order, d.shape))
        self.lets = self.emitter(self.env, "_l")
        for x in m.lets:
            self.env[x.name] = self.lets(x.expr)
            self.lets.env[x.name] = self.env[x.name]
        self.stmts += self.lets.stmts
        upd_env = dict(self.env)
        for s in m.states:
            upd_env[s.name] = upd_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
        self.upd = self.emitter(upd_env, "_u")
        for u in m.updates:
            var, dims = self.upd(u.expr)
            assert set(dims) == set(m.state(u.state).shape)
            self.new[u.state] = var
        self.stmts += self.upd.stmts
        if with_output:
            self._output()
        return self

    def _output(self) -> None:
        m, order = self.plan.kernel_ir, self.plan.kernel_ir.dim_names
        out_env = dict(self.env)
        for s in m.states:
            out_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
            out_env[s.name] = (self.new[s.name], canon(order, s.shape))
        self.out = self.emitter(out_env, "_o")
        self.o = self.out(m.output.expr)
        self.stmts += self.out.stmts
        self.out0 = None
        if self.plan.layout.split is not None:
            # the state-free part of the output (D * x) counts once: block 0 keeps it, the
            # other blocks subtract it (out evaluated at zero states)
            zero_env = dict(self.env)
            for s in m.states:
                zs = (f"_zs_{s.name}", canon(order, s.shape))
                self.stmts.append(let(zs[0], zeros(zs[1])))
                zero_env[s.name] = zero_env["prev " + s.name] = zs
            self.out0 = self.emitter(zero_env, "_z")
            o0 = self.out0(m.output.expr)
            self.stmts += self.out0.stmts
            od = canon(order, m.output.expr.shape)
            self.stmts.append(let("_oj", op("-", self.out.bcast(*self.o, od),
                                            mul(name("_not_first"), self.out0.bcast(*o0, od)))))
            self.o = ("_oj", od)


def initial_state(s: ir.StateDecl, order) -> K.Expr:
    if s.name == M:         # a stabilizer's m: an empty state's (derive/stabilize.py)
        return add(mul(name("_fhead"), num(0.0)), num(M_EMPTY))
    return zeros(canon(order, s.shape))


FWD_NOTES = (
    "One program per (sequence, head), block of the tile dim (axis 1) and block of the split dim",
    "(axis 2; one block where the spec has no such dim): the state lives in registers, tokens run",
    "in order. Split blocks write partial outputs, summed on the host.",
)


def state(s: ir.StateDecl, order) -> K.Name:
    return name(f"s_{s.name}", canon(order, s.shape))


def forward_kernel(plan: Plan, kernel: str, header: tuple[str, ...]) -> K.Kernel:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    split = plan.layout.split
    opening, rest = prologue(plan, f"blocks of {split} after the first drop out(0)", "rows of the output's partials")
    slot = [
        K.Comment("the state's row: this sequence's, or its cache slot. Each program reads its block of the"),
        K.Comment("state before its first token and writes the same block after its last, so the initial and"),
        K.Comment("final buffers may be one (launch.py keeps one tile block where a state lacks the tile dim)"),
        let("i_s", i64(name("i_n")), "i64"),
        K.If(arg("use_indices"), (let("i_s", i64(K.Load(arg("state_indices"), (name("i_n"),))), "i64"),)),
    ]
    states: list[K.Stmt] = [K.Comment(""), K.Comment("states")]
    for s in m.states:
        states.append(let(f"s_{s.name}", initial_state(s, order)))
        states.append(K.If(arg("use_initial"),
                           (let(f"s_{s.name}", load(arg("init", s.name), state_base("slot"), s.shape, order)),)))
    since = op("-", name("_t"), name("bos"))
    ckpt = K.If(arg("store_ckpt"), (K.If(op("==", op("%", since, arg("ck")), num(0)), (
        let("_chunk", op("//", since, arg("ck")), "i64"),
        *[store(arg("ckpt", s.name), state_base("ckpt"), s.shape, order, state(s, order)) for s in m.states])),))
    tok = Token(plan).build()
    o_shape = m.output.expr.shape
    row = name("_row")
    out = store(arg("out"), tile_base(plan, o_shape, row, "_ntok") if split else row, o_shape, order,
                tok.out.bcast(*tok.o, canon(order, o_shape)), cast=True)
    loop = K.For("_t", name("bos"), name("eos"), (
        let("_row", add(mul(name("_t"), arg("H")), name("i_h")), "i64"),
        ckpt,
        K.Comment("this token: inputs, lets, every state's update from the previous states, the output"),
        *tok.stmts,
        out,
        # the states advance after the output has read both the old and the new ones
        *[let(f"s_{s}", tok.upd.value(v, canon(order, m.state(s).shape))) for s, v in tok.new.items()],
    ))
    final = K.If(arg("store_final"), tuple(
        store(arg("final", s.name), state_base("slot"), s.shape, order, state(s, order)) for s in m.states))
    body = (*opening, *slot, *rest, *states, K.Comment(""), loop, K.Comment(""), final)
    return K.Kernel(kernel, header, arguments(plan, "recurrent_fwd"), tuple(body), FWD_NOTES)


def render(k: K.Kernel) -> str:
    return printer.kernel(k)

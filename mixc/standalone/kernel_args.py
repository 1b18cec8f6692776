"""The argument list of each generated kernel, defined once.

Each kernel form (recurrent_fwd, recurrent_bwd, chunk_fwd, chunk_bwd) has one KernelArgs: its
parameters in order, each an Arg with a role (what the launch passes: a pointer to an input, a
state's checkpoints, the output's gradient ..., a runtime scalar, a constexpr size, block or
switch) and what it is for (the input, param, option, state or dim). ROLES gives each role its
parameter name, its kind and its dtype rule. From this one list:

- the kernels' signatures: codegen/recurrent_ir.arguments makes the kernel IR's argument
  lines of `arguments.lines` (the lines and comments of the `def kernel(...)` block), which
  the kir printer prints;
- the launch call: the launcher (launcher.py, for mixc.load's op and a compiled module alike)
  fills a value per Arg.key and calls KernelArgs.launch: the arguments before the first
  constexpr positionally, the rest by name; runtime/fastpath.py replays the recorded order;
  the orders are computed once per plan (plan.layout and the LaunchPlan carry the KernelArgs
  of each form) or per replay recipe;
- the ahead-of-time signature: tools/aot.py types each argument by its role's dtype rule.

It imports nothing from mixc and no third-party module: a compiled module's runtime
(support.py, in the copy of this package beside the module) builds the same lists from
METADATA's names without the compiler. It lives in mixc/standalone, below every stage, so that
derive (plan.layout), codegen, the runtime and a compiled module read the one definition."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple

FORMS = ("recurrent_fwd", "recurrent_bwd", "chunk_fwd", "chunk_bwd")
# The chunked forms are one kernel per stage a launch runs, all stages of a form taking the
# form's arguments, each named <spec>_<form>_<stage> (stage_kernel). Forward: fused (the walk
# with the outputs, one launch), walk (the states: checkpoints, final states), output (every
# chunk's output from its checkpoint), refill (the state at every chunk start, for the
# backward), intra (the staged intra-chunk matrices: specs whose class stages them);
# backward: fused (one launch), walk (dL/dS at every chunk's end), tiles (every chunk's
# gradients, the tile dim's blocks looped inside).
CHUNK_STAGES = {"chunk_fwd": ("fused", "walk", "output", "refill", "intra"),
                "chunk_bwd": ("fused", "walk", "tiles")}


# The variants of a stage the launcher chooses among, each a kernel of its own named
# <spec>_<form>_<stage>[_rewalk][_staged][_keyblocks] (the parts in this order; none: the
# stage's plain kernel): rewalk, the output kernel walking CKPT_EVERY > 1 chunks from one
# checkpoint (else one chunk a program); staged, the walk or output kernel reading the intra
# kernel's matrices (else computing them; the backward's walk: the rank-1 inverse the intra
# kernel stages again before it); keyblocks, the chunk over the key dim in blocks of
# KEY_BLOCK (else the whole dim). codegen/chunk_kernels.py generates them (a keyblocks variant
# only where its split applies), Launcher.kernel picks one per launch.
VARIANT_PARTS = ("rewalk", "staged", "keyblocks")
STAGE_VARIANTS = {("chunk_fwd", "walk"): ("staged",), ("chunk_fwd", "output"): VARIANT_PARTS,
                  ("chunk_fwd", "intra"): ("keyblocks",), ("chunk_bwd", "walk"): ("staged",),
                  ("chunk_bwd", "tiles"): ("keyblocks",)}


def stage_kernel(stem: str, stage: str, parts: tuple[str, ...] = ()) -> str:
    """The name of a chunked form's kernel for one stage (stem: <spec>_<form>), one variant of
    it (parts: some of VARIANT_PARTS)."""
    return "_".join((stem, stage) + tuple(p for p in VARIANT_PARTS if p in parts))
# Triton's launch options: a launch's values may hold them next to the arguments
LAUNCH_OPTIONS = ("num_warps", "num_stages")


class Role(NamedTuple):
    name: str            # the parameter's name ("{}": the input, param, option, state or dim)
    kind: str            # "pointer", "scalar" or "constexpr"
    dtype: str | None    # pointers and scalars: "io" (the call's dtype), "fp32" or "i32"
    what: str


ROLES: dict[str, Role] = {
    # pointers: the call's tensors and the buffers the launch allocates
    "input": Role("p_{}", "pointer", "io", "a per-token input [B, T, H, *dims] (B = 1 with cu_seqlens)"),
    "param": Role("p_{}", "pointer", "fp32", "a per-head param [H, *dims] (float32 ahead of time)"),
    "init": Role("p_init_{}", "pointer", "fp32", "a state's initial value [N, H, *dims]"),
    "final": Role("p_final_{}", "pointer", "fp32", "a state's final value [N, H, *dims]"),
    "ckpt": Role("p_ckpt_{}", "pointer", "fp32", "a state at each chunk start [slots, H, *dims]"),
    "dense": Role("p_dense_{}", "pointer", "fp32",
                  "the chunked forward's refill: the state at every chunk start [slots, H, *dims]"),
    "intra": Role("p_intra", "pointer", "io",
                  "the chunked forward's intra-chunk matrices in the matmuls' dtype: the intra kernel writes "
                  "them, the output kernel reads them [rows, H, n, C]"),
    "scratch": Role("p_scratch_{}", "pointer", "fp32", "CK recomputed states per program"),
    "dfinal": Role("p_dfinal_{}", "pointer", "fp32", "the final state's gradient [N, H, *dims]"),
    "dinit": Role("p_dinit_{}", "pointer", "fp32", "the initial state's gradient (per tile or split block)"),
    "dh": Role("p_dh_{}", "pointer", "fp32", "dL/dS at each chunk's end [slots, H, *dims]"),
    "seg_start": Role("p_segstart_{}", "pointer", "fp32",
                      "the segmented walk (standalone/segments.py): each segment's true start state (forward) or "
                      "dL/dS at its end (backward) [segments, H, *dims]"),
    "seg_decay": Role("p_segdecay_{}", "pointer", "fp32",
                      "the segmented walk: per slot, each key row's log decay from its segment's start to the "
                      "slot's checkpoint (forward) or from the chunk's end to its segment's end (backward) "
                      "[slots, H, key rows]"),
    "out": Role("p_out", "pointer", "io", "the output [B, T, H, *dims] (float32 partials per split block)"),
    "do": Role("p_do", "pointer", "io", "the output's gradient"),
    "dinput": Role("p_d{}", "pointer", "io", "an input's gradient (float32 partials per tile or split block)"),
    "dparam": Role("p_dp_{}", "pointer", "fp32", "a param's gradient partials, per (sequence, head)"),
    "cu_seqlens": Role("p_cu_seqlens", "pointer", "i32", "packed sequences' offsets"),
    "chunk_seq": Role("p_chunk_seq", "pointer", "i32", "the slot kernels with packed sequences: each slot's sequence"),
    "state_indices": Role("p_state_indices", "pointer", "i32", "each sequence's row of a state cache"),
    # runtime scalars
    "option": Role("v_{}", "scalar", "fp32", "a number option's value"),
    "T": Role("T", "scalar", "i32", "tokens per sequence (all of them with cu_seqlens)"),
    "H": Role("H", "scalar", "i32", "heads"),
    "group": Role("_group_{}", "scalar", "i32",
                  "heads sharing each head of an input (H / its heads; 1 where it has H heads)"),
    "n_seqs": Role("_N_SEQS", "scalar", "i32", "sequences"),
    "fsize": Role("_fsize_{}", "scalar", "fp32", "a dim's size as a float (expressions read it)"),
    # constexprs: sizes and blocks
    "size": Role("_size_{}", "constexpr", None, "a dim's size"),
    "block": Role("_BLOCK_{}", "constexpr", None, "a dim's block (a power of two)"),
    "chunk": Role("_BLOCK__T", "constexpr", None, "the chunk size C"),
    "unit": Role("_BLOCK__1", "constexpr", None, "the unit axis of a state without key or value dims"),
    "ck": Role("CK", "constexpr", None, "tokens between checkpoints (recurrent kernels)"),
    "ckpt_every": Role("CKPT_EVERY", "constexpr", None, "chunks between checkpoints (chunked forward)"),
    # constexpr switches
    "use_initial": Role("USE_INITIAL_STATE", "constexpr", None, "read the initial states"),
    "store_final": Role("STORE_FINAL_STATE", "constexpr", None, "write the final states"),
    "varlen": Role("IS_VARLEN", "constexpr", None, "packed sequences (cu_seqlens)"),
    "store_ckpt": Role("STORE_CHECKPOINTS", "constexpr", None, "write the states at chunk starts"),
    "use_dfinal": Role("USE_FINAL_STATE_GRAD", "constexpr", None, "read the final states' gradient"),
    "use_indices": Role("USE_STATE_INDICES", "constexpr", None, "states live in a cache of slots"),
    "dot": Role("DOT", "constexpr", None, "matmul inputs: 0 fp32 (ieee), 1 bf16, 2 fp16, 3 fp32 (tf32x3)"),
    "key_block": Role("KEY_BLOCK", "constexpr", None, "the key dim's block in the intra and output kernels' loop "
                                                      "over it"),
    "segmented": Role("SEGMENTED", "constexpr", None,
                      "the segmented walk's correction: a checkpoint (forward) or dL/dS (backward) read here gets "
                      "its segment's seg_start, decayed by exp(seg_decay), added"),
}


@dataclass(frozen=True)
class Arg:
    role: str
    of: str | None = None      # the input, param, option, state or dim it is for
    # from ROLES when the argument is made
    name: str = field(init=False)           # the kernel's parameter name
    kind: str = field(init=False)           # "pointer", "scalar" or "constexpr"
    dtype: str | None = field(init=False)   # the AOT dtype rule: "io", "fp32", "i32" (None: constexpr)

    def __post_init__(self):
        role = ROLES[self.role]
        object.__setattr__(self, "name", role.name.format(self.of))
        object.__setattr__(self, "kind", role.kind)
        object.__setattr__(self, "dtype", role.dtype)

    @property
    def key(self):
        """What a launch keys the argument's value by: the role, or (role, of)."""
        return self.role if self.of is None else (self.role, self.of)

    @property
    def constexpr(self) -> bool:
        return self.kind == "constexpr"


@dataclass(frozen=True)
class Line:
    """One line of the signature: arguments with an optional trailing comment, or (no
    arguments) a comment line."""
    args: tuple[Arg, ...] = ()
    comment: str | None = None


@dataclass(frozen=True)
class KernelArgs:
    form: str
    lines: tuple[Line, ...]

    @cached_property
    def args(self) -> tuple[Arg, ...]:
        """The parameters in order."""
        return tuple(a for line in self.lines for a in line.args)

    @cached_property
    def _first_constexpr(self) -> int:
        return next((i for i, a in enumerate(self.args) if a.constexpr), len(self.args))

    @cached_property
    def positional(self) -> tuple:
        """The keys of the arguments before the first constexpr (pointers and runtime scalars),
        in the kernel's order: a launch passes these positionally."""
        return tuple(a.key for a in self.args[:self._first_constexpr])

    @cached_property
    def named(self) -> tuple[tuple[str, object], ...]:
        """(name, key) of the rest (the constexprs, and the pointers after them such as
        p_state_indices): a launch passes these by name."""
        return tuple((a.name, a.key) for a in self.args[self._first_constexpr:])

    @cached_property
    def names(self) -> dict:
        """key -> parameter name."""
        return {a.key: a.name for a in self.args}

    def launch(self, kernel, grid, values: dict) -> None:
        """kernel[grid] on `values` keyed by Arg.key: `positional` in order, the rest by name
        (bench's fakecuda reads the constexprs by name), Triton's launch options where `values`
        has them."""
        kernel[grid](*[values[k] for k in self.positional], **{name: values[k] for name, k in self.named},
                     **{k: values[k] for k in LAUNCH_OPTIONS if k in values})


def _comment(*text: str) -> list[Line]:
    return [Line((), t) for t in text]


def _each(names, *roles: str) -> list[Line]:
    """One line per name: its argument of each role."""
    return [Line(tuple(Arg(r, x) for r in roles)) for x in names]


def _one(role: str, comment: str | None = None) -> list[Line]:
    return [Line((Arg(role),), comment)]


def _recurrent_fwd(inputs, params, options, states, dims) -> list[Line]:
    return [
        *_comment("per-token inputs [B, T, H, *dims] (B = 1 with cu_seqlens), per-head params [H, *dims]"),
        *_each(inputs, "input"), *_each(params, "param"),
        *_comment("option values (runtime scalars)"),
        *_each(options, "option"),
        *_comment("states: initial in, final out [N, H, *state dims] float32; with STORE_CHECKPOINTS (training)",
                  "the state at the start of every chunk of CK tokens [slots, H, *state dims]"),
        *_each(states, "init", "final", "ckpt"),
        Line((Arg("out"), Arg("cu_seqlens"))),
        Line((Arg("T"), Arg("H"))),
        *_comment("grouped heads: head i_h reads head i_h // _group_x of input x"),
        Line(tuple(Arg("group", x) for x in inputs)),
        *_each(dims, "fsize"),
        *_each(dims, "size", "block"),
        *_one("use_initial"), *_one("store_final"), *_one("varlen"), *_one("store_ckpt"), *_one("ck"),
        *_comment("decode into a cache (serving): sequence i's state is row p_state_indices[i] of the state",
                  "buffers (fla / vLLM's ssm_state_indices); initial and final may be one buffer (in place)"),
        *_one("state_indices"), *_one("use_indices"),
    ]


def _recurrent_bwd(inputs, params, options, states, dims) -> list[Line]:
    return [
        *_comment("the forward's inputs and params"),
        *_each(inputs, "input"), *_each(params, "param"), *_each(options, "option"),
        *_comment("per state: checkpoints [slots, H, *dims], a scratch of CK states per program,",
                  "the final state's gradient in and the initial state's gradient out"),
        *_each(states, "ckpt", "scratch", "dfinal", "dinit"),
        *_comment("the output's gradient in; the inputs' gradients out, the params' per (sequence, head)"),
        *_one("do"), *_each(inputs, "dinput"), *_each(params, "dparam"),
        *_one("cu_seqlens"),
        Line((Arg("T"), Arg("H"))),
        *_comment("grouped heads: head i_h reads head i_h // _group_x of input x"),
        Line(tuple(Arg("group", x) for x in inputs)),
        *_each(dims, "fsize"),
        *_each(dims, "size", "block"),
        *_one("use_dfinal"), *_one("varlen"), *_one("ck"),
    ]


def _chunk_tail() -> tuple[list[Line], list[Line]]:
    """What the chunked kernels add after the dims as floats, and after their sizes and blocks."""
    after_fsize = [*_one("chunk_seq", "the slot kernels with packed sequences: the sequence of each chunk slot"),
                   *_one("n_seqs", "sequences")]
    after_blocks = [*_one("chunk", "the chunk size C"),
                    *_one("unit", "the unit axis of a state without key or value dims")]
    return after_fsize, after_blocks


def _chunk_fwd(inputs, params, options, states, dims) -> list[Line]:
    after_fsize, after_blocks = _chunk_tail()
    return [
        *_comment("per-token inputs [B, T, H, *dims] (B = 1 with cu_seqlens), per-head params [H, *dims]"),
        *_each(inputs, "input"), *_each(params, "param"),
        *_comment("option values (runtime scalars)"),
        *_each(options, "option"),
        *_comment("states: initial in, final out [N, H, *state dims]; checkpoints at the start of every",
                  "CKPT_EVERY-th chunk [slots, H, *state dims]; the refill writes every chunk's start into dense"),
        *_each(states, "init", "final", "ckpt", "dense"),
        *_comment("the segmented walk (SEGMENTED): each segment's true start [segments, H, *state dims] and per",
                  "checkpoint slot each key row's log decay from its segment's start [slots, H, key rows]"),
        *_each(states, "seg_start", "seg_decay"),
        *_one("intra", "the intra kernel writes each chunk's intra-chunk matrices [rows, H, n, C], the output "
                       "kernel (and the rank-1 walk) reads them"),
        Line((Arg("out"), Arg("cu_seqlens"))),
        Line((Arg("T"), Arg("H"))),
        *_comment("grouped heads: head i_h reads head i_h // _group_x of input x"),
        Line(tuple(Arg("group", x) for x in inputs)),
        *_each(dims, "fsize"), *after_fsize,
        *_each(dims, "size", "block"), *after_blocks,
        *_one("use_initial"), *_one("store_final"), *_one("varlen"), *_one("store_ckpt"),
        *_one("ckpt_every", "chunks per checkpoint (the output, refill and intra kernels: chunks per program)"),
        *_one("segmented", "the output kernel adds each segment's true start to its checkpoints (segments.py)"),
        *_one("key_block", "the intra and output kernels' _keyblocks variants loop over the key dim in blocks of "
                           "this (codegen/key_split.py; the output kernel walking chunks: static blocks, "
                           "key_walk.py)"),
        *_one("dot", "matmul inputs: 0 fp32 (ieee), 1 bf16, 2 fp16, 3 fp32 (tf32x3)"),
    ]


def _chunk_bwd(inputs, params, options, states, dims) -> list[Line]:
    after_fsize, after_blocks = _chunk_tail()
    return [
        *_comment("the forward's inputs and params"),
        *_each(inputs, "input"), *_each(params, "param"), *_each(options, "option"),
        *_comment("per state: checkpoints at chunk starts [slots, H, *dims], the final state's gradient in,",
                  "the initial state's gradient out [N, H, *dims], dL/dS at each chunk's end [slots, H, *dims]",
                  "(written by the walk, read by the tiles kernel)"),
        *_each(states, "ckpt", "dfinal", "dinit", "dh"),
        *_comment("the segmented walk (SEGMENTED): dL/dS at each segment's end [segments, H, *dims] and per chunk",
                  "each key row's log decay from the chunk's end to its segment's end [slots, H, key rows]"),
        *_each(states, "seg_start", "seg_decay"),
        *_one("intra", "the rank-1 walk's staged inverses [rows, H, n, C] (the forward's intra kernel, run again "
                       "before the walk: its _staged variant reads them)"),
        *_comment("the output's gradient in; the inputs' gradients out, the params' per (sequence, head)"),
        *_one("do"), *_each(inputs, "dinput"), *_each(params, "dparam"),
        *_one("cu_seqlens"),
        Line((Arg("T"), Arg("H"))),
        *_comment("grouped heads: head i_h reads head i_h // _group_x of input x"),
        Line(tuple(Arg("group", x) for x in inputs)),
        *_each(dims, "fsize"), *after_fsize,
        *_each(dims, "size", "block"), *after_blocks,
        *_one("use_dfinal"), *_one("varlen"), *_one("dot"),
        *_one("segmented", "the tiles kernel adds each segment's end dL/dS to its chunks' (segments.py)"),
        *_one("key_block", "the tiles kernel's _keyblocks variant loops over the key dim in blocks of this "
                           "before, in and after its tile loop (codegen/key_split.py)"),
    ]


_FORMS = {"recurrent_fwd": _recurrent_fwd, "recurrent_bwd": _recurrent_bwd,
          "chunk_fwd": _chunk_fwd, "chunk_bwd": _chunk_bwd}


@lru_cache(maxsize=256)
def kernel_args(form: str, inputs: tuple[str, ...], params: tuple[str, ...], options: tuple[str, ...],
                states: tuple[str, ...], dims: tuple[str, ...]) -> KernelArgs:
    """The arguments of one kernel form, from the names of the inputs, params, number options,
    kernel states (a stabilizer's _m included) and dims, each in declared order."""
    if form not in _FORMS:
        raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {form!r}")
    return KernelArgs(form, tuple(_FORMS[form](inputs, params, options, states, dims)))


def plan_kernel_args(plan, forms=FORMS) -> dict[str, KernelArgs]:
    """The KernelArgs of each form in `forms` for a plan (its kernel IR: a stabilizer's state too)."""
    m = plan.kernel_ir
    names = (tuple(d.name for d in m.inputs), tuple(d.name for d in m.params),
             tuple(o.name for o in m.options if o.kind == "float"), tuple(s.name for s in m.states),
             tuple(m.dim_names))
    return {form: kernel_args(form, *names) for form in forms}


def metadata_kernel_args(meta: dict) -> dict[str, KernelArgs]:
    """The same from a generated module's METADATA (support.py: no plan there)."""
    names = (tuple(meta["inputs"]), tuple(meta["params"]), tuple(meta["options"]), tuple(meta["kernel_states"]),
             tuple(meta["dims"]))
    return {form: kernel_args(form, *names) for form in meta["kernels"]}

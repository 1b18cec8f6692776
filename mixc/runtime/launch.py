"""Launching generated kernels: argument order, block sizes, outputs and states."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

from .. import classes
from ..codegen.key_split import key_dim
from ..codegen.key_walk import STATIC_BLOCKS
from ..derive.plan import Plan
from ..derive.stabilize import M as STABILIZER_M
from . import autotune
from .autotune import RECURRENT_SPLIT, RECURRENT_TILE, block  # noqa: F401  (launch.block: aot, tests)
from .cache import interpreting, load_module
from .reference import _options
from .signature import Bound


def _empty(shape, dtype, device) -> torch.Tensor:
    """An output buffer; filled with NaN under MIXC_POISON=1 (the tests) so that an element a
    kernel forgets to write shows up instead of passing with stale memory."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("MIXC_POISON") == "1":
        t.fill_(float("nan"))
    return t


# Block of the tile dim (V, Mamba-2's P) in the chunked kernels: the state per program is
# [K, CHUNK_TILE] instead of [K, V] (sm_90 at K = V = 128 spilled 0.9-5 KB whole; bench/README.md).
CHUNK_TILE = 64

# The chunked forward's checkpoints (the states at chunk starts, which PHASE 2 and the backward
# read) are stored in the inputs' dtype where that is bf16 or fp16, as fla stores its h: half
# the bytes of fp32 (bench/traffic_report), the kernels accumulating in fp32 as before. The
# stabilizer's m (one number per chunk) and the recurrent kernels' checkpoints stay fp32.
# MIXC_FP32_CHECKPOINTS=1 (or launch.FP32_CHECKPOINTS = True) keeps every checkpoint fp32.
FP32_CHECKPOINTS = os.environ.get("MIXC_FP32_CHECKPOINTS") == "1"


def checkpoint_dtype(chunked: bool, dtype: torch.dtype, state: str = "", half: bool = True) -> torch.dtype:
    """The dtype of a state's checkpoints for inputs of `dtype` (chunked: the chunked forward's;
    half: the plan allows half-precision checkpoints, plan.layout.half_states)."""
    if (chunked and half and not FP32_CHECKPOINTS and dtype in (torch.bfloat16, torch.float16)
            and state != STABILIZER_M):
        return dtype
    return torch.float32


def dim_kwargs(plan: Plan, bound: Bound, config: autotune.Config | None = None) -> dict:
    """Sizes and blocks of the recurrent kernels, keyed as their arguments (standalone/kernel_args.py:
    ("size", dim), ("block", dim)); a tuned config may set the tile and split blocks."""
    kw = {}
    tile, split = plan.layout.tile, plan.layout.split
    tile_block = config.tile if config is not None and config.tile else RECURRENT_TILE
    split_block = config.split if config is not None and config.split else RECURRENT_SPLIT
    for d in plan.ir.dim_names:
        kw["size", d] = bound.sizes[d]
        limit = tile_block if d == tile else split_block if d == split else None
        kw["block", d] = block(bound.sizes[d]) if limit is None else min(block(bound.sizes[d]), limit)
    return kw


def n_tiles(plan: Plan, bound: Bound, blocks: dict) -> int:
    """Programs along the tile dim: 1 for specs without a tile dim."""
    tile = plan.layout.tile
    if tile is None:
        return 1
    return -(-bound.sizes[tile] // blocks["block", tile])


def n_splits(plan: Plan, bound: Bound, blocks: dict) -> int:
    """Programs along the split dim: 1 for the chunked kernels and specs without a split dim."""
    split = plan.layout.split
    if split is None or "chunk" in blocks:
        return 1
    # at least one: a split dim of size 0 (gla K = 0, mamba2 N = 0) still needs block 0, which
    # writes the state-free part of the output (zeros, D * x) and every gradient
    return max(1, -(-bound.sizes[split] // blocks["block", split]))


class KernelUnavailable(RuntimeError):
    """The generated kernels cannot run on these tensors here."""


def module_for(plan: Plan, device: torch.device):
    if device.type == "cpu" and not interpreting():
        raise KernelUnavailable(
            "Triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before Python starts (before triton is imported), or use mode='reference'")
    if device.type not in ("cpu", "cuda"):
        raise KernelUnavailable(f"no Triton kernels for device type '{device.type}'")
    return load_module(plan)


def _kernel(plan: Plan, device, form: str):
    mod = module_for(plan, device)
    return getattr(mod, mod.METADATA["kernels"][form])


def settings() -> tuple:
    """What a launch depends on besides its arguments: this module's block and phase choices
    (tests and gpu_check set them), the tuner's mode, whether Triton interprets (mode "auto" on
    CPU tensors, KernelUnavailable without it). Part of a replayed launch's key
    (runtime/fastpath.py), so changing one takes the bound path again."""
    return (CHUNK_PHASES, CHUNK_TILE, RECURRENT_TILE, RECURRENT_SPLIT, _tuned, interpreting(),
            os.environ.get("MIXC_AUTOTUNE"), FP32_CHECKPOINTS, CHECKPOINT_EVERY, STAGE_INTRA, STAGE_SOLVE)


# A decode step's fast path (runtime/fastpath.py) replays the launch a first step made: while
# recording, each forward launch leaves its shape-derived part here (kernel, grid, its argument
# list and values, buffer shapes); the replay orders them by the same list.
_RECORDING = threading.local()


@contextmanager
def recording():
    """Collect the forward launches made inside (a list of dicts, the call's last: tuning runs
    come first; the chunked forward's PHASE 1 before its PHASE 2): fastpath.recipe_from reads
    which tensors each took."""
    prev = getattr(_RECORDING, "log", None)
    _RECORDING.log = log = []
    try:
        yield log
    finally:
        _RECORDING.log = prev


def checkpoint_slots(bound: Bound, CK: int) -> int:
    """Slots for the chunk checkpoints of all sequences (see codegen.recurrent.state_base)."""
    return (bound.B * bound.T) // CK + bound.n_seqs + 1


def _forward(plan: Plan, bound: Bound, form: str, *, output_final_state: bool, checkpoints: bool,
             chunk_tokens: int, launch: dict, out_dtype=None, ckpts_in: dict | None = None, write_out: bool = True,
             grid0: int | None = None, finals_into: dict | None = None, dense_into: dict | None = None,
             tiles: int | None = None, intra: torch.Tensor | None = None, staged: bool = False):
    """Launch a forward kernel: its arguments (plan.layout.kernel_args[form]) keyed by role,
    `launch` the sizes, blocks and constexprs the caller chose and Triton's options.
    chunk_tokens: tokens per checkpoint; ckpts_in: checkpoints to read (the chunked PHASE 2 and
    3: their start states); write_out=False: the launch writes no output (PHASE 1 and 3), None
    is returned for it; grid0: programs along axis 0 (default: sequences x heads); finals_into:
    the final states' buffers (float32, contiguous; the initial ones for a step in place);
    dense_into: PHASE 3's buffers for the state at every chunk start; tiles: programs along axis 1
    (default: the tile dim's blocks); intra: the intra-chunk matrices PHASE 4 writes and PHASE 2
    reads where staged."""
    m = plan.ir
    x0 = next(iter(bound.inputs.values()))
    device = x0.device
    kernel = _kernel(plan, device, form)
    n, H, T = bound.n_seqs, bound.H, bound.T
    slots = checkpoint_slots(bound, chunk_tokens)
    opts = _options(m, bound)
    tiles, splits = tiles or n_tiles(plan, bound, launch), n_splits(plan, bound, launch)
    o_shape = (bound.B, T, H) + tuple(bound.sizes[d] for d in m.output.expr.shape)
    # split blocks write partial outputs (float32, summed below)
    out = _empty(((splits,) if splits > 1 else ()) + o_shape if write_out else (1,),
                 torch.float32 if splits > 1 else out_dtype or x0.dtype, device)
    v = dict(launch)
    v.update({("input", d.name): bound.inputs[d.name].contiguous() for d in m.inputs})
    v.update(group_values(m, bound.inputs, H))
    v.update({("param", d.name): bound.params[d.name].contiguous() for d in m.params})
    v.update({("option", o.name): opts[o.name] for o in m.options if o.kind == "float"})
    finals, ckpts = {}, dict(ckpts_in or {})
    for s in plan.kernel_ir.states:          # the spec's, and a stabilizer's m (starts at 0)
        shape = tuple(bound.sizes[d] for d in s.shape)
        init = out
        if bound.initial_state is not None and ckpts_in is None:
            init = (bound.initial_state[s.name].to(torch.float32).contiguous() if s.name in bound.initial_state
                    else torch.zeros((n, H) + shape, dtype=torch.float32, device=device))
        if output_final_state:
            finals[s.name] = (finals_into[s.name] if finals_into is not None
                              else _empty((n, H) + shape, torch.float32, device))
        if checkpoints:
            ckpts[s.name] = _empty((slots, H) + shape, checkpoint_dtype(form == "chunk_fwd", x0.dtype, s.name,
                                                                       plan.layout.half_states), device)
        v["init", s.name], v["final", s.name], v["ckpt", s.name] = init, finals.get(s.name, out), ckpts.get(s.name, out)
        v["dense", s.name] = (dense_into or {}).get(s.name, out)
    v["out"] = out
    v["intra"], v["staged_intra"] = (intra if intra is not None else out), staged
    v["cu_seqlens"] = bound.cu_seqlens.to(device) if bound.cu_seqlens is not None else out
    v["T"], v["H"] = T, H
    v.update({("fsize", d): float(bound.sizes[d]) for d in m.dim_names})
    v.update(use_initial=bound.initial_state is not None and ckpts_in is None, store_final=output_final_state,
             varlen=bound.cu_seqlens is not None, store_ckpt=checkpoints)
    args = plan.layout.kernel_args[form]
    args.launch(kernel, (grid0 or n * H, tiles, splits), v)
    log = getattr(_RECORDING, "log", None)
    if log is not None:
        log.append(dict(module=load_module(plan), kernel=load_module(plan).METADATA["kernels"][form],
                        grid=(grid0 or n * H, tiles, splits), args=args, values=v, x0=x0, splits=splits,
                        final_dtype=x0.dtype if out_dtype is None else out_dtype, inplace=finals_into is not None,
                        states=[(s.name, (n, H) + tuple(bound.sizes[d] for d in s.shape),
                                 "none" if bound.initial_state is None else
                                 "given" if s.name in bound.initial_state else "zeros")
                                for s in plan.kernel_ir.states]))
    if splits > 1:
        out = out.sum(0).to(out_dtype or x0.dtype)
    return (out if write_out else None), (finals if output_final_state else None), (ckpts if checkpoints else None)


def recurrent_forward(plan: Plan, bound: Bound, *, output_final_state: bool, out_dtype=None,
                      checkpoints: bool = False, CK: int = 32, inplace: bool = False,
                      state_indices: torch.Tensor | None = None):
    """Run the fused recurrent forward kernel.

    Returns (o, final states or None, checkpoints or None): with checkpoints=True the state at
    the start of every chunk of CK tokens is kept for the backward ([slots, H, *dims]).
    inplace=True (decode, runtime/decode.py): the final states overwrite bound.initial_state's
    buffers (float32, contiguous); state_indices [n] int: sequence i's state is row
    state_indices[i] of those buffers (a cache of slots)."""
    x0 = next(iter(bound.inputs.values()))

    def run(cfg):
        kw = dim_kwargs(plan, bound, cfg) | (cfg.launch() if cfg is not None else {})
        tile = plan.layout.tile
        if inplace and tile is not None and any(tile not in s.shape for s in plan.kernel_ir.states):
            # every tile program reads and writes a state without the tile dim whole: with one
            # buffer, a later program could read what an earlier one wrote. One tile block.
            kw["block", tile] = block(bound.sizes[tile])
        kw.update(ck=CK, state_indices=state_indices if state_indices is not None else x0,
                  use_indices=state_indices is not None)
        return _forward(plan, bound, "recurrent_fwd", output_final_state=output_final_state,
                        checkpoints=checkpoints, chunk_tokens=CK, out_dtype=out_dtype, launch=kw,
                        finals_into=bound.initial_state if inplace else None)
    if inplace:     # no timing runs: each would advance the state again (and no capture-time tuning)
        cuda = x0.device.type == "cuda" and not interpreting()
        return run(autotune.default(plan, "recurrent_fwd", bound.sizes) if cuda else None)
    return run(_tuned(plan, bound, "recurrent_fwd", run))


def recurrent_backward(plan: Plan, bound: Bound, ckpts: dict, do: torch.Tensor, dfinal: dict | None,
                       CK: int = 32):
    """Gradients of the inputs ([B, T, H, ...], their dtypes), the params ([H, ...]) and the
    initial states ([N, H, ...] float32) from the output's and the final states' gradients."""
    def run(cfg):
        kw = dim_kwargs(plan, bound, cfg)
        programs = bound.n_seqs * bound.H * n_tiles(plan, bound, kw) * n_splits(plan, bound, kw)

        def per_state(s, shape, dfin, dinit, device):
            scratch = _empty((programs * CK,) + shape, torch.float32, device)
            return dict(ckpt=ckpts[s.name], scratch=scratch, dfinal=dfin if dfin is not None else scratch,
                        dinit=dinit)

        return _backward(plan, bound, "recurrent_bwd", per_state, do, dfinal,
                         launch=kw | {"ck": CK} | (cfg.launch() if cfg is not None else {}))
    return run(_tuned(plan, bound, "recurrent_bwd", run))


def _tuned(plan: Plan, bound: Bound, form: str, run, C: int | None = None) -> autotune.Config | None:
    """The launch config of one kernel form: None (the untuned launch, exactly as before
    autotuning existed) under the interpreter and on CPU tensors; on CUDA the config chosen by
    mixc.runtime.autotune for this key (timed on the first call, then cached), or the list's
    first with tuning off."""
    x0 = next(iter(bound.inputs.values()))
    if not autotune.active(x0.device):
        # CUDA without tuning: the list's first config (chunked: two launches, 8 warps, 3 stages
        # for the walk and 1 for PHASE 2: no spills in the forward at K = V = 128 on sm_90, and
        # shared memory that fits, where Triton's default 4 warps spill)
        return autotune.default(plan, form, bound.sizes) if x0.device.type == "cuda" and not interpreting() else None
    programs = bound.n_seqs * bound.H
    if form.startswith("recurrent"):
        kw = dim_kwargs(plan, bound)
        programs *= n_tiles(plan, bound, kw) * n_splits(plan, bound, kw)
    else:
        programs *= n_tiles(plan, bound, chunk_blocks(plan, bound))
    k = autotune.key(plan, form, bound.sizes, x0.dtype, programs, x0.device, C)
    return autotune.pick(k, autotune.configs(plan, form, bound.sizes), run)


def chunk_size_for(plan: Plan, bound: Bound) -> int:
    """C for the chunked kernels: plan.layout.chunk_size, or on CUDA the fastest forward + backward
    over autotune.chunk_candidates(plan) for these dims, dtype and parallelism (cached). While
    torch.compile traces, the default (C is a Python int in the traced call)."""
    x0 = next(iter(bound.inputs.values()))
    if not autotune.active(x0.device) or torch.compiler.is_compiling():
        return plan.layout.chunk_size

    def run(cfg):
        _, _, ck = chunk_forward(plan, bound, output_final_state=False, checkpoints=True, C=cfg.C)
        o_shape = (bound.B, bound.T, bound.H) + tuple(bound.sizes[d] for d in plan.ir.output.expr.shape)
        chunk_backward(plan, bound, ck, torch.ones(o_shape, dtype=x0.dtype, device=x0.device), None, C=cfg.C)

    k = autotune.key(plan, "chunk", bound.sizes, x0.dtype, bound.n_seqs * bound.H, x0.device)
    return autotune.pick(k, autotune.configs(plan, "chunk"), run).C


def _backward(plan: Plan, bound: Bound, form: str, per_state, do: torch.Tensor, dfinal: dict | None, *,
              launch: dict, write=("inputs", "params", "dinit"), grid0: int | None = None,
              param_rows: int | None = None, tile_programs: int | None = None):
    """Launch a backward kernel: its arguments (plan.layout.kernel_args[form]) keyed by role,
    per_state(...) a state's buffers by role, `launch` as _forward's; returns the gradients of
    the inputs, the params (summed over sequences) and the initial states, None for what this
    launch does not `write`. grid0: programs along axis 0
    (default: sequences x heads); param_rows: the params' partial rows per tile block (default:
    one per sequence); tile_programs: programs along axis 1 (default: one per block of the tile
    dim; the chunked PHASE 2 takes 1, its programs looping over the blocks)."""
    m = plan.ir
    device = next(iter(bound.inputs.values())).device
    kernel = _kernel(plan, device, form)
    n, H, T = bound.n_seqs, bound.H, bound.T
    inputs = [bound.inputs[d.name].contiguous() for d in m.inputs]
    params = [bound.params[d.name].contiguous() for d in m.params]
    opts = _options(m, bound)
    # what lacks the tile (split) dim gets one gradient partial per tile (split) block, summed below
    tiles, splits = tile_programs or n_tiles(plan, bound, launch), n_splits(plan, bound, launch)
    tile, split = plan.layout.tile, plan.layout.split

    def parts(dims) -> int:
        return ((tiles if tile is not None and tile not in dims else 1)
                * (splits if split is not None and split not in dims else 1))

    v = dict(launch)
    v.update({("input", d.name): x for d, x in zip(m.inputs, inputs)})
    v.update(group_values(m, bound.inputs, H))
    v.update({("param", d.name): x for d, x in zip(m.params, params)})
    v.update({("option", o.name): opts[o.name] for o in m.options if o.kind == "float"})
    dinit = {}
    for s in plan.kernel_ir.states:
        shape = tuple(bound.sizes[d] for d in s.shape)
        dinit[s.name] = _empty((parts(s.shape) * n, H) + shape, torch.float32, device) if "dinit" in write else do
        dfin = None
        if dfinal:
            dfin = (dfinal[s.name].to(torch.float32).contiguous() if s.name in dfinal
                    else torch.zeros((n, H) + shape, dtype=torch.float32, device=device))
        v.update({(role, s.name): x for role, x in per_state(s, shape, dfin, dinit[s.name], device).items()})
    # a grouped input's gradient per head (float32), its groups summed below
    dinputs = {d.name: (_empty(x.shape, x.dtype, device) if parts(d.shape) == 1 and x.shape[2] == H
                        else _empty((parts(d.shape),) + per_head(x, H), torch.float32, device))
               if "inputs" in write else do for d, x in zip(m.inputs, inputs)}
    dparams = {d.name: _empty((parts(d.shape) * (param_rows or n),) + tuple(x.shape), torch.float32, device)
               if "params" in write else do for d, x in zip(m.params, params)}
    v["do"] = do.contiguous()
    v.update({("dinput", k): x for k, x in dinputs.items()})
    v.update({("dparam", k): x for k, x in dparams.items()})
    v["cu_seqlens"] = bound.cu_seqlens.to(device) if bound.cu_seqlens is not None else do
    v["T"], v["H"] = T, H
    v.update({("fsize", d): float(bound.sizes[d]) for d in m.dim_names})
    v.update(use_dfinal=dfinal is not None, varlen=bound.cu_seqlens is not None)
    plan.layout.kernel_args[form].launch(kernel, (grid0 or n * H, tiles, splits), v)
    dparams = {k: v.sum(0).to(bound.params[k].dtype) for k, v in dparams.items()} if "params" in write else None
    dinputs = ({k: v if v.shape == bound.inputs[k].shape else sum_groups(v.sum(0), bound.inputs[k])
                for k, v in dinputs.items()} if "inputs" in write else None)
    dinit = ({k: v if v.shape[0] == n else v.reshape((-1, n) + tuple(v.shape[1:])).sum(0) for k, v in dinit.items()}
             if "dinit" in write else None)
    return dinputs, dparams, dinit


def group_values(m, inputs: dict, H: int) -> dict:
    """The kernels' _group_x (standalone/kernel_args.py's role "group"): heads per head of each
    input [B, T, H_x, *dims], H / H_x (1 where it has every head)."""
    return {("group", d.name): H // inputs[d.name].shape[2] if inputs[d.name].shape[2] else 1 for d in m.inputs}


def per_head(x: torch.Tensor, H: int) -> tuple:
    """An input's shape with H heads: its gradient as the kernels write it, one per head."""
    return tuple(x.shape[:2]) + (H,) + tuple(x.shape[3:])


def sum_groups(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A gradient per head [B, T, H, *dims] (float32) summed over each group of heads that
    shares one head of the input x [B, T, H_x, *dims], in x's dtype. The kernels write every
    head's part and the host sums them: a float32 [B, T, H, *dims] buffer written and read
    once. That is what a caller who repeated x per head paid anyway (the repeated gradient,
    then autograd's sum), so grouping saves the forward's bytes and costs nothing extra here;
    atomics into [B, T, H_x] would make the sum's order (and its bits) vary between runs, and
    one program per shared head walking its group would serialize the group's states."""
    Hx = x.shape[2]
    if g.shape[2] != Hx:
        g = g.unflatten(2, (Hx, g.shape[2] // Hx)).sum(3)
    return g.to(x.dtype)


def _dot_code(dtype: torch.dtype, half_matmuls: bool = True) -> int:
    """Matmul inputs of the chunked kernels: the inputs' precision on a GPU (tensor cores), fp32
    otherwise. Triton's interpreter (3.9) computes a bf16 tl.dot wrongly (garbage of 1e10,
    while fp16 and fp32 are right), so under the interpreter bf16 inputs multiply in fp32."""
    if not half_matmuls and dtype in (torch.bfloat16, torch.float16):
        # plan.layout.half_matmuls (derive/layout.py): fp32 operands on tensor cores (tf32x3), as
        # accurate as fp32's own (ieee on CUDA cores compiled 10x slower and ran without them)
        return 3
    if dtype == torch.bfloat16 and interpreting():
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


def output_blocks(plan: Plan, bound: Bound) -> dict:
    """The forward PHASE 2's block of the tile dim where its class sets one (classes/<unit>.py
    output_tile: the scalar decay's 32), else nothing (chunk_blocks'): PHASE 2 reads the
    checkpoints by element, so its tile blocks need not be PHASE 1's."""
    return _class_tile(plan, bound, classes.unit(plan.transition).output_tile)


def backward_blocks(plan: Plan, bound: Bound) -> dict:
    """The chunked backward's block of the tile dim where its class sets one (backward_tile: the
    rank-1 class's 32), else nothing: the backward reads the states and writes dL/dS by element."""
    return _class_tile(plan, bound, classes.unit(plan.transition).backward_tile)


def _class_tile(plan: Plan, bound: Bound, size: int | None) -> dict:
    tile = plan.layout.tile
    if tile is None or size is None:
        return {}
    return {("block", tile): max(16, min(block(bound.sizes[tile]), size, CHUNK_TILE))}


def chunk_blocks(plan: Plan, bound: Bound) -> dict:
    """Sizes and blocks of the chunked kernels (keyed as dim_kwargs'): each dim whole (at least
    16: tl.dot's minimum), but the tile dim (V, Mamba-2's P) in blocks of up to CHUNK_TILE, one
    program each (fla's BV), in the forward and the backward alike."""
    dims = plan.ir.dim_names
    blocks = {("size", d): bound.sizes[d] for d in dims}
    blocks.update({("block", d): max(16, block(bound.sizes[d])) for d in dims})
    tile = plan.layout.tile
    if tile is not None:
        blocks["block", tile] = max(16, min(block(bound.sizes[tile]), CHUNK_TILE))
    return blocks


# The chunked kernels in two launches each (forward: PHASE 1 walks the chunks for the states,
# PHASE 2 computes every chunk's output at once, fla's chunk_fwd_h + chunk_fwd_o; backward:
# PHASE 1 walks back for dL/dS at every chunk's end, PHASE 2 computes every chunk's gradients
# at once, fla's dh + dq/dk/dv kernels) or in one walk each (PHASE 0). None: the tuned config's
# choice on CUDA (two without tuning), one under the interpreter; 1 or 2 forces it everywhere
# (the tests run both; gpu_check's correctness section checks both on the GPU).
CHUNK_PHASES: int | None = None
# The forward in two launches stages the intra-chunk matrices of the classes that stage them
# (plan.layout.intra_matrices: the key-diagonal decay's): PHASE 4 computes each chunk's once and
# PHASE 2, every tile block, reads them. False: PHASE 2 computes them per tile block (the tests
# compare the two bit for bit; gpu_check can time both).
STAGE_INTRA = True
# The rank-1 class's staged inverse (classes/<unit>.py stages_solve): PHASE 4 solves for each
# chunk's (I - M)^-1 before the walk, which then takes U as one matmul instead of C - 1 dependent
# substitution rows; off by default: the delta rules' forward moves 2580 -> 3222 B per
# token-head (3.14x the floor: k and beta read again, the inverse written and read twice) and
# the gated delta rule's walk spills 28 B on sm_90 (bench/README.md); the walk's latency is what
# a GPU run must weigh against it (bench/gpu_check times both).
STAGE_SOLVE = False


def stages(plan: Plan, stage_solve: bool | None = None) -> bool:
    """Whether the two-launch forward runs PHASE 4 and PHASE 1 and 2 read what it staged (the
    plan's staged matrices: the readouts', STAGE_INTRA, or the setup's inverse, STAGE_SOLVE
    unless stage_solve says)."""
    if not plan.layout.intra_matrices:
        return False
    if any(classes.unit(st.transition).stages_solve for st in plan.states):
        return STAGE_SOLVE if stage_solve is None else stage_solve
    return STAGE_INTRA


def _phases(cfg: autotune.Config | None, device: torch.device) -> int:
    """CHUNK_PHASES where set (a forced choice: the tests, gpu_check's correctness modes), else
    the launch config's, else two on CUDA and one under the interpreter."""
    if CHUNK_PHASES:
        return CHUNK_PHASES
    if cfg is not None and cfg.phases:
        return cfg.phases
    return 2 if device.type == "cuda" and not interpreting() else 1


def _one_stage(kw: dict) -> dict:
    """A PHASE 2 (or 3) launch's arguments: one stage where stages are set (the forward's chunk
    loop has one iteration per program, or CKPT_EVERY (4-8 on a GPU), the backward's loop over
    the tile blocks a few: left unpipelined, as pipelining would hold the next chunk's inputs
    or block's state slices in shared memory; not measured on a GPU)."""
    return kw | {"num_stages": 1} if "num_stages" in kw else kw


def _chunk_launch(plan: Plan, bound: Bound, C: int, every: int = 1) -> tuple[int, dict]:
    """(programs per head of a PHASE 2 launch, the chunked kernels' launch arguments), each
    program taking `every` chunks (one checkpoint's: the forward's CKPT_EVERY; the backward's
    PHASE 2 one chunk). Packed sequences take one program per checkpoint slot, each told its
    sequence by a table: sequence i's checkpoints have the slots bos_i // (C every) + i, ...
    (codegen.recurrent.state_base), so a slot's sequence is the last whose first slot is at
    most the slot (no host sync)."""
    x0 = next(iter(bound.inputs.values()))
    device, n, span = x0.device, bound.n_seqs, C * every
    if bound.cu_seqlens is None:
        programs, chunk_seq = n * (-(-bound.T // span)), x0
    else:
        programs = checkpoint_slots(bound, span)
        chunk_seq = chunk_seqs(bound.cu_seqlens, span, n, programs, device)
    blocks = chunk_blocks(plan, bound)
    return programs, blocks | dict(chunk=C, unit=16, dot=_dot_code(x0.dtype, plan.layout.half_matmuls), n_seqs=n, chunk_seq=chunk_seq,
                                   ckpt_every=every, key_block=key_block(plan, blocks, C))


# The key dim's block in the chunked forward's PHASE 4 and 2 (one chunk a program): where less
# than the key dim's block, those launches loop over the key blocks (codegen/key_split.py). None:
# KEY_BLOCK_AT where the chunk's [C, K] blocks exceed C * K = KEY_BLOCK_ELEMENTS (at C = 32 and
# K = 128 the forward spills nothing whole on sm_90; at C = 64 the key-diagonal decay's PHASE 4
# and 2 spill 0.4-1.0 KB whole: bench/README.md), else the whole dim; an int forces it (the
# tests: several blocks at small K under the interpreter).
KEY_BLOCK: int | None = None
KEY_BLOCK_AT = 64
KEY_BLOCK_ELEMENTS = 32 * 128


def key_block(plan: Plan, blocks: dict, C: int) -> int:
    """KEY_BLOCK for chunks of C tokens and these blocks (a key dim's block where the forward
    keeps the whole dim, or the spec has no key loop: key_split.key_dim); a class may set a
    smaller block (classes/<unit>.py key_block)."""
    key = key_dim(plan)
    # a spec without dims (RWKV-4's per-channel wkv: `state a[], b[]`) has no block at all: the
    # unit block (its scalars ride a [16] unit axis, _chunk_launch's unit=16)
    whole = blocks["block", key] if key is not None else max((v for k, v in blocks.items() if k[0] == "block"),
                                                              default=16)
    if key is None:
        return whole
    if KEY_BLOCK:
        return min(KEY_BLOCK, whole)
    at = min([KEY_BLOCK_AT] + [b for st in plan.states if (b := classes.unit(st.transition).key_block)])
    at = max(at, whole // STATIC_BLOCKS)           # the walk's static blocks cover the key dim
    return at if C * whole > KEY_BLOCK_ELEMENTS and whole > at else whole


# Chunks between the chunked forward's checkpoints (CKPT_EVERY = R): PHASE 1 stores the state at
# every R-th chunk start only and PHASE 2 walks each checkpoint's R chunks from it (one program
# per checkpoint, the state advanced in registers between its chunks), so the checkpoints that
# PHASE 1 writes and PHASE 2 reads (and the training forward keeps for the backward) are 1/R of
# the dense ones: at K = V = 128 bf16 and C = 64, 1 KB of simple_gla's 2.6 KB per token-head
# forward were the checkpoints (written and read; bench/traffic_report). A forward and its
# backward must see the same R: chunk_states checks the checkpoints' size. The backward, which reads a state per
# chunk, first refills them (chunk_states: PHASE 3, every checkpoint's R chunks at once), as fla's
# backward recomputes its h. None: the policy below on a GPU (and the sm_90 stand-in), 1 under
# the interpreter (the tests force other values); an int forces it everywhere.
CHECKPOINT_EVERY: int | None = None
CHECKPOINT_TOKENS = 256         # tokens per checkpoint the policy aims at
MIN_PROGRAMS = 512              # ... unless PHASE 2 would have fewer programs than this (132 SMs x ~4)


def checkpoint_tokens(plan: Plan) -> int:
    """CHECKPOINT_TOKENS, or the fewest a state's class asks for (classes/<unit>.py)."""
    return min((t for st in plan.states if (t := classes.unit(st.transition).checkpoint_tokens(st))),
               default=CHECKPOINT_TOKENS)


def checkpoint_every(plan: Plan, bound: Bound, C: int) -> int:
    """R for chunks of C tokens on these shapes (a shape-only rule: torch.compile's fake
    checkpoints take the same): checkpoint_tokens // C, halved while PHASE 2's programs (one per
    checkpoint, head and tile block) would number fewer than MIN_PROGRAMS."""
    if CHECKPOINT_EVERY:
        return CHECKPOINT_EVERY
    if interpreting():
        return 1
    every = max(1, checkpoint_tokens(plan) // C)
    programs = bound.H * n_tiles(plan, bound, chunk_blocks(plan, bound))
    while every > 1 and programs * (bound.B * bound.T // (C * every)) < MIN_PROGRAMS:
        every //= 2
    return every


def chunk_seqs(cu_seqlens: torch.Tensor, C: int, n: int, programs: int, device) -> torch.Tensor:
    """Each checkpoint slot's sequence (PHASE 2 of packed sequences, int32 [programs]): the last
    whose first slot (cu_seqlens[i] // C + i) is at most the slot; made on the device (no sync).
    runtime/fastpath.py makes it per replayed call."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts = cu[:-1] // C + torch.arange(n, device=device)
    return (torch.searchsorted(starts, torch.arange(programs, device=device), right=True) - 1).to(torch.int32)


def chunk_forward(plan: Plan, bound: Bound, *, output_final_state: bool, out_dtype=None,
                  checkpoints: bool = False, C: int | None = None):
    """Run the chunked forward kernel (two launches or one: CHUNK_PHASES). Same returns as
    recurrent_forward; its checkpoints (the states at chunk starts) serve the chunked backward
    and the recurrent one with CK = C."""
    C = C or plan.layout.chunk_size
    x0 = next(iter(bound.inputs.values()))
    every = checkpoint_every(plan, bound, C)
    programs, common = _chunk_launch(plan, bound, C, every)

    def run(cfg):
        kw = dict(output_final_state=output_final_state, chunk_tokens=C * every, out_dtype=out_dtype)
        launch = common | (cfg.launch() if cfg is not None else {})
        if _phases(cfg, x0.device) == 1:
            return _forward(plan, bound, "chunk_fwd", checkpoints=checkpoints, launch=launch | {"phase": 0}, **kw)
        intra = None
        if stages(plan):      # PHASE 4: the intra-chunk matrices (or inverses), once per chunk
            # in the dtype PHASE 2's matmul takes A in (_dot_code: so the same bits as computed)
            dot_dtype = {1: torch.bfloat16, 2: torch.float16}.get(common["dot"], torch.float32)
            intra = _empty((x0.shape[0] * x0.shape[1], bound.H, plan.layout.intra_matrices, C), dot_dtype, x0.device)
            _forward(plan, bound, "chunk_fwd", checkpoints=False, ckpts_in={}, write_out=False,
                     grid0=programs * bound.H, tiles=1, intra=intra, launch=_one_stage(launch) | {"phase": 4},
                     **(kw | {"output_final_state": False}))
        # PHASE 1 walks the chunks for the states (checkpoints, final states; the staged inverses
        # where PHASE 4 wrote them); PHASE 2 the outputs
        _, finals, ckpts = _forward(plan, bound, "chunk_fwd", checkpoints=True, write_out=False,
                                    intra=intra, staged=intra is not None, launch=launch | {"phase": 1}, **kw)
        kw["output_final_state"] = False
        o, _, _ = _forward(plan, bound, "chunk_fwd", checkpoints=False, ckpts_in=ckpts, grid0=programs * bound.H,
                           intra=intra, staged=intra is not None,
                           launch=_one_stage(launch) | {"phase": 2} | output_blocks(plan, bound), **kw)
        return o, finals, (ckpts if checkpoints else None)
    return run(_tuned(plan, bound, "chunk_fwd", run, C))


def chunk_states(plan: Plan, bound: Bound, ckpts: dict, C: int) -> dict:
    """The state at every chunk start (what the chunked backward reads) from the chunked
    forward's checkpoints, which hold every CKPT_EVERY-th (checkpoint_every): PHASE 3 of the
    forward kernel, one program per checkpoint walking its chunks (no output). The checkpoints
    themselves where they are dense already."""
    every = checkpoint_every(plan, bound, C)
    have, want = next(iter(ckpts.values())).shape[0], checkpoint_slots(bound, C * every)
    if have != want:
        raise ValueError(f"chunked backward: the forward's checkpoints have {have} slots, {want} expected for a "
                         f"checkpoint every {every} chunks of {C} tokens: launch.CHECKPOINT_EVERY (or the chunk "
                         "size) changed between the forward and its backward")
    if every == 1:
        return ckpts
    x0 = next(iter(bound.inputs.values()))
    programs, common = _chunk_launch(plan, bound, C, every)
    slots = checkpoint_slots(bound, C)
    dense = {s.name: _empty((slots, bound.H) + tuple(bound.sizes[d] for d in s.shape), ckpts[s.name].dtype,
                            x0.device) for s in plan.kernel_ir.states}

    def run(cfg):
        _forward(plan, bound, "chunk_fwd", output_final_state=False, checkpoints=False, chunk_tokens=C * every,
                 ckpts_in=ckpts, write_out=False, grid0=programs * bound.H, dense_into=dense,
                 launch=_one_stage(common | (cfg.launch() if cfg is not None else {})) | {"phase": 3})
    run(_tuned(plan, bound, "chunk_fwd", run, C))
    return dense


def tile_loop(plan: Plan) -> bool:
    """Whether the chunked backward's PHASE 2 runs one program per (chunk, head), looping over
    the tile dim's blocks inside: then what lacks the tile dim (dq, dk, dg) is summed in
    registers and written once in the inputs' dtype, where one program per block would write
    float32 partials for torch to sum and cast (fla's dqkwg loops over V likewise; at K = V = 128
    bf16 that is 6.1 KB of 13.7 KB per token-head for simple_gla: bench/traffic_report). A
    param over the tile dim is loaded once per program, so such a spec keeps a program per
    block (no library spec has one)."""
    tile = plan.layout.tile
    return tile is not None and not any(tile in p.shape for p in plan.ir.params)


def chunk_backward(plan: Plan, bound: Bound, ckpts: dict, do: torch.Tensor, dfinal: dict | None, C: int):
    """The chunked backward kernel (two launches or one: CHUNK_PHASES): same returns as
    recurrent_backward, from the chunked forward's checkpoints (chunks of C tokens)."""
    x0 = next(iter(bound.inputs.values()))
    H = bound.H
    ckpts = chunk_states(plan, bound, ckpts, C)
    slots = checkpoint_slots(bound, C)
    chunk_programs, launch_kw = _chunk_launch(plan, bound, C)
    launch_kw |= backward_blocks(plan, bound)
    tiles = n_tiles(plan, bound, launch_kw)
    tile = plan.layout.tile

    def run(cfg):
        common = launch_kw | (cfg.launch() if cfg is not None else {})
        if _phases(cfg, x0.device) == 1:
            def per_state(s, shape, dfin, dinit, device):
                return dict(ckpt=ckpts[s.name], dfinal=dfin if dfin is not None else dinit, dinit=dinit, dh=dinit)
            return _backward(plan, bound, "chunk_bwd", per_state, do, dfinal, launch=common | {"phase": 0})
        dh = {}

        def per_state(s, shape, dfin, dinit, device):
            parts = tiles if tile is not None and tile not in s.shape else 1
            # dL/dS at chunk ends in the checkpoints' dtype (bf16 for bf16 inputs: half the
            # bytes PHASE 1 writes and PHASE 2 reads; both accumulate in fp32)
            dh[s.name] = _empty((slots * parts, H) + shape, checkpoint_dtype(True, x0.dtype, s.name,
                                                                                  plan.layout.half_states), device)
            return dict(ckpt=ckpts[s.name], dfinal=dfin if dfin is not None else dinit, dinit=dinit, dh=dh[s.name])
        # PHASE 1 writes dh and the initial states' gradients; PHASE 2 (same buffers) the rest
        _, _, dinit = _backward(plan, bound, "chunk_bwd", per_state, do, dfinal, write=("dinit",),
                                launch=common | {"phase": 1})
        dinputs, dparams, _ = _backward(plan, bound, "chunk_bwd",
                                        lambda s, *a: dict(ckpt=ckpts[s.name], dfinal=do, dinit=do, dh=dh[s.name]),
                                        do, dfinal, write=("inputs", "params"), grid0=chunk_programs * H,
                                        param_rows=chunk_programs, launch=_one_stage(common) | {"phase": 2},
                                        tile_programs=1 if tile_loop(plan) else None)
        return dinputs, dparams, dinit
    return run(_tuned(plan, bound, "chunk_bwd", run, C))

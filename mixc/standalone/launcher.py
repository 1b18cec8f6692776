"""The launcher: the one place where a call's bound arguments become kernel launches.

mixc.load's op (runtime/launch.py, through its custom ops and the replay fast path) and a
compiled module's op (support.py) launch through this file, so both take the same grids, blocks,
constexprs, buffers, checkpoint dtypes and scratch sizes, and the same checks, by construction.
It is driven by plain data:

- a LaunchPlan (launch_data.py): what the launches need to know of a spec (names and dims of
  the inputs, params, options and kernel states, the tile, split and key dims, the chunk size,
  the class units' launch policies), derived from the derive-stage Plan by codegen/launch_plan.py and
  written into a generated module's METADATA["launch"], so that a compiled module rebuilds it
  without mixc.derive (LaunchPlan.from_metadata);
- LaunchSettings: the knobs (two launches or one, tile and split blocks, sparse checkpoints,
  staging, key blocks, fp32 checkpoints, whether Triton interprets): runtime/launch.py fills
  them from its module attributes (what tests and bench/gpu_check set); a compiled module
  takes the defaults (LaunchSettings.from_env);
- a tuner (optional): a function (form, run, C) -> LaunchConfig that times launches; without
  one, the untuned launch (default_config on CUDA, Triton's defaults under the interpreter).

Launches made inside `recording()` are logged (kernel, grid, argument values): the replay
fast path (runtime/fastpath.py) replays a call's forward launches from that log, and the tests
compare what mixc.load's op and a compiled module launch."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import triton

from .buffers import checkpoint_slots, chunk_seqs, empty, one_stage as _one_stage  # noqa: F401
from .segments import backward as _segmented_backward, forward as _segmented_forward, unsupported as _unsupported
from .kernel_args import STAGE_VARIANTS
from .launch_data import (CHUNK_DEFAULT, STATIC_BLOCKS, LaunchConfig, LaunchPlan, LaunchSettings,  # noqa: F401
                          env_segments)


# ---- rules that need no plan ----


def _unsegmented(v: dict, states, dummy: torch.Tensor) -> None:
    """The segmented walk's arguments where the launch does not set them (segments.py does):
    SEGMENTED off, its pointers a buffer the kernel never reads then."""
    v.setdefault("segmented", False)
    for name, _ in states:
        v.setdefault(("seg_start", name), dummy)
        v.setdefault(("seg_decay", name), dummy)


def default_config(lp: LaunchPlan, form: str, sizes: dict, s: LaunchSettings) -> LaunchConfig:
    """The launch config without tuning (CUDA): the tuner's list's first."""
    if form.startswith("chunk"):
        return CHUNK_DEFAULT
    tile = min(s.recurrent_tile, block(sizes[lp.tile])) if lp.tile is not None else None
    split = min(s.recurrent_split, block(sizes[lp.split])) if lp.split is not None else None
    return LaunchConfig(tile=tile, split=split)


def block(size: int) -> int:
    """A dim's block: its next power of two (at least 1)."""
    return max(triton.next_power_of_2(size), 1)


def checkpoint_dtype(chunked: bool, dtype: torch.dtype, s: LaunchSettings, fp32_state: bool = False,
                     half: bool = True) -> torch.dtype:
    """The dtype of a state's checkpoints for inputs of `dtype`: the chunked forward's in the
    inputs' dtype where that is bf16 or fp16 (half the bytes of fp32; the kernels accumulate in
    fp32), unless fp32_checkpoints, the plan forbids it (half) or the state is the stabilizer's
    m; the recurrent kernels' float32."""
    if chunked and half and not s.fp32_checkpoints and dtype in (torch.bfloat16, torch.float16) and not fp32_state:
        return dtype
    return torch.float32


def dot_code(dtype: torch.dtype, half_matmuls: bool, interpreting: bool) -> int:
    """Matmul inputs of the chunked kernels: the inputs' precision on a GPU (tensor cores), fp32
    otherwise. Triton's interpreter (3.9) computes a bf16 tl.dot wrongly (garbage of 1e10,
    while fp16 and fp32 are right), so under the interpreter bf16 inputs multiply in fp32."""
    if not half_matmuls and dtype in (torch.bfloat16, torch.float16):
        # fp32 operands on tensor cores (tf32x3), as accurate as fp32's own
        return 3
    if dtype == torch.bfloat16 and interpreting:
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


def per_head(x: torch.Tensor, H: int) -> tuple:
    """An input's shape with H heads: its gradient as the kernels write it, one per head."""
    return tuple(x.shape[:2]) + (H,) + tuple(x.shape[3:])


def sum_groups(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A gradient per head [B, T, H, *dims] (float32) summed over each group of heads that
    shares one head of the input x [B, T, H_x, *dims], in x's dtype. The kernels write every
    head's part and the host sums them: a float32 [B, T, H, *dims] buffer written and read
    once, what a caller who repeated x per head paid anyway; atomics into [B, T, H_x] would make
    the sum's order (and its bits) vary between runs."""
    Hx = x.shape[2]
    if g.shape[2] != Hx:
        g = g.unflatten(2, (Hx, g.shape[2] // Hx)).sum(3)
    return g.to(x.dtype)


def group_values(inputs: dict, H: int) -> dict:
    """The kernels' _group_x (role "group"): heads per head of each input [B, T, H_x, *dims],
    H / H_x (1 where it has every head)."""
    return {("group", k): H // x.shape[2] if x.shape[2] else 1 for k, x in inputs.items()}


# ---- recording ----

# While recording, each launch leaves its kernel, grid, argument list and values here; the
# replay fast path (runtime/fastpath.py) rebuilds a call's forward launches from them.
_RECORDING = threading.local()


@contextmanager
def recording():
    """Collect the launches made inside (a list of dicts in launch order, each with its "form";
    tuning runs come first; the chunked forward's intra and walk kernels before its output kernel). Recordings
    nest: a launch is logged in every one open (the fast path records inside a test's)."""
    logs = getattr(_RECORDING, "logs", ())
    log = []
    _RECORDING.logs = logs + (log,)
    try:
        yield log
    finally:
        _RECORDING.logs = logs


def _record(**entry) -> None:
    for log in getattr(_RECORDING, "logs", ()):
        log.append(entry)


# ---- the launcher ----


class Launcher:
    """A LaunchPlan's launches on one module's kernels.

    module: the kernels by name (an attribute per kernel: the generated module, or a compiled
    module's namespace); settings: the knobs; tune(form, run, C): the launch config, timing
    run(config) where it tunes (None: the untuned launch); refuse(device): raises where the
    kernels cannot run on that device (called before every launch)."""

    def __init__(self, lp: LaunchPlan, module, settings: LaunchSettings, tune=None, refuse=None):
        self.lp, self.module, self.s, self.tune, self.refuse = lp, module, settings, tune, refuse

    def kernel(self, form: str, device, stage: str | None = None, v: dict | None = None):
        """(name, kernel) of what a launch of `form` runs: a chunked form's kernel for its
        stage, the variant the launch's values v call for (variant)."""
        if self.refuse is not None:
            self.refuse(device)
        parts = self.variant(form, stage, v) if v is not None else ()
        name = self.lp.kernel_name(form, stage, parts)
        if "keyblocks" in parts and not hasattr(self.module, name):
            # no key-blocked variant: its split does not apply to this spec (the kernel generated
            # in its place says why, codegen/key_split.py), so the whole key dim, as that kernel's
            name = self.lp.kernel_name(form, stage, tuple(p for p in parts if p != "keyblocks"))
        return name, getattr(self.module, name)

    def variant(self, form: str, stage: str | None, v: dict) -> tuple[str, ...]:
        """Which variant of a chunked stage a launch with values v runs (kernel_args.VARIANT_PARTS;
        each a kernel of its own, codegen/chunk_kernels.py): the output kernel's "rewalk" where a
        program takes CKPT_EVERY > 1 chunks; the output's and the rank-1 walk's "staged" where the
        intra kernel staged its matrices; the intra, output and tiles kernels' "keyblocks" where
        KEY_BLOCK is less than the key dim's block (the output walking chunks: its static blocks
        cover the dim, at most STATIC_BLOCKS of them)."""
        if (form, stage) not in STAGE_VARIANTS:
            return ()
        key, parts = self.lp.key, []
        # a segmented launch (SEGMENTED: the checkpoint's correction, standalone/segments.py) runs the
        # whole-dim kernel: the key-blocked ones are split with SEGMENTED folded off (key_split.py)
        keyed = key is not None and v["key_block"] < v["block", key] and not v.get("segmented")
        if stage == "output":
            rewalk = v["ckpt_every"] > 1
            parts += ["rewalk"] if rewalk else []
            parts += ["staged"] if v.get("staged_intra") else []
            if keyed and (not rewalk or v["block", key] <= STATIC_BLOCKS * v["key_block"]):
                parts.append("keyblocks")
        elif stage == "walk":
            parts += ["staged"] if v.get("staged_intra") and self.lp.stages_solve else []
        elif keyed:
            parts.append("keyblocks")
        return tuple(parts)

    # ---- blocks and grids ----
    def dim_blocks(self, b, config: LaunchConfig | None = None) -> dict:
        """Sizes and blocks of the recurrent kernels, keyed as their arguments (("size", dim),
        ("block", dim)); a config may set the tile and split blocks."""
        lp, s = self.lp, self.s
        tile_block = config.tile if config is not None and config.tile else s.recurrent_tile
        split_block = config.split if config is not None and config.split else s.recurrent_split
        kw = {}
        for d in lp.dims:
            kw["size", d] = b.sizes[d]
            limit = tile_block if d == lp.tile else split_block if d == lp.split else None
            kw["block", d] = block(b.sizes[d]) if limit is None else min(block(b.sizes[d]), limit)
        return kw

    def chunk_blocks(self, b) -> dict:
        """Sizes and blocks of the chunked kernels: each dim whole (at least 16: tl.dot's
        minimum), but the tile dim in blocks of up to chunk_tile, one program each (fla's BV)."""
        blocks = {("size", d): b.sizes[d] for d in self.lp.dims}
        blocks.update({("block", d): max(16, block(b.sizes[d])) for d in self.lp.dims})
        if self.lp.tile is not None:
            blocks["block", self.lp.tile] = max(16, min(block(b.sizes[self.lp.tile]), self.s.chunk_tile))
        return blocks

    def output_blocks(self, b) -> dict:
        """The forward output kernel's block of the tile dim where its class sets one (output_tile),
        else nothing (chunk_blocks'): it reads the checkpoints by element, so its tile blocks
        need not be the walk's."""
        return self._class_tile(b, self.lp.output_tile)

    def backward_blocks(self, b) -> dict:
        """The chunked backward's block of the tile dim where its class sets one (backward_tile,
        the rank-1 class's), else nothing: the backward reads states and writes dL/dS by element."""
        return self._class_tile(b, self.lp.backward_tile)

    def _class_tile(self, b, size: int | None) -> dict:
        tile = self.lp.tile
        if tile is None or size is None:
            return {}
        return {("block", tile): max(16, min(block(b.sizes[tile]), size, self.s.chunk_tile))}

    def n_tiles(self, b, blocks: dict) -> int:
        """Programs along the tile dim: 1 for specs without a tile dim."""
        tile = self.lp.tile
        return 1 if tile is None else -(-b.sizes[tile] // blocks["block", tile])

    def n_splits(self, b, blocks: dict) -> int:
        """Programs along the split dim: 1 for the chunked kernels and specs without a split dim;
        at least one: a split dim of size 0 still needs block 0, which writes the state-free part
        of the output and every gradient."""
        split = self.lp.split
        if split is None or "chunk" in blocks:
            return 1
        return max(1, -(-b.sizes[split] // blocks["block", split]))

    def key_block(self, blocks: dict, C: int) -> int:
        """The key dim's block in the intra and output kernels for chunks of C tokens (the whole dim where the
        forward keeps it, or the spec has no key loop); a class may set a smaller block."""
        key, s = self.lp.key, self.s
        # a spec without dims (RWKV-4's `state a[], b[]`) has no block at all: the unit block
        whole = blocks["block", key] if key is not None else max((v for k, v in blocks.items() if k[0] == "block"),
                                                                  default=16)
        if key is None:
            return whole
        if s.key_block:
            return min(s.key_block, whole)
        at = min(s.key_block_at, self.lp.key_block or s.key_block_at)
        at = max(at, whole // STATIC_BLOCKS)           # the walk's static blocks cover the key dim
        return at if C * whole > s.key_block_elements and whole > at else whole

    def checkpoint_tokens(self) -> int:
        """Tokens per checkpoint the policy aims at: the fewest a state's class asks for, else the setting's."""
        return self.lp.checkpoint_tokens or self.s.checkpoint_tokens

    def checkpoint_every(self, b, C: int) -> int:
        """R for chunks of C tokens on these shapes (a shape-only rule: torch.compile's fake
        checkpoints take the same): checkpoint_tokens // C, halved while the output kernel's programs (one
        per checkpoint, head and tile block) would number fewer than min_programs."""
        s = self.s
        if s.checkpoint_every:
            return s.checkpoint_every
        if s.interpreting:
            return 1
        every = max(1, self.checkpoint_tokens() // C)
        programs = b.H * self.n_tiles(b, self.chunk_blocks(b))
        while every > 1 and programs * (b.B * b.T // (C * every)) < s.min_programs:
            every //= 2
        return every

    def segments(self, b, C: int) -> int:
        """S, the segments each sequence's chunk walk is cut into (standalone/segments.py): the
        setting's where forced; else 1 off CUDA, for a spec or call the segments do not serve,
        and where the walk's programs (sequences x heads x tile blocks) fill the SMs already;
        else the fewest segments that fill them, at most half the sequences' average spans of
        checkpoint_every chunks (a shape-only rule, as checkpoint_every: the backward finds the
        forward's S again)."""
        s = self.s
        if s.segments == 1 or self.module is None or b.n_seqs == 0 or b.T == 0:
            return 1
        if _unsupported(self.lp, self.module, b) is not None:
            return 1
        if s.segments is not None:
            return s.segments
        x0 = next(iter(b.inputs.values()))
        sms = s.sm_count
        if sms is None:
            if x0.device.type != "cuda" or s.interpreting:
                return 1
            sms = torch.cuda.get_device_properties(x0.device).multi_processor_count
        programs = b.n_seqs * b.H * self.n_tiles(b, self.chunk_blocks(b))
        if programs >= sms:
            return 1
        spans = (b.B * b.T) // (b.n_seqs * C * self.checkpoint_every(b, C))
        S = min(-(-sms // programs), spans // 2)
        return S if S >= 2 else 1

    def checkpoint_count(self, b, C: int) -> int:
        """Slots of the chunked forward's checkpoints for chunks of C tokens (the segmented
        stream's where segments are on: one more slot per segment)."""
        return checkpoint_slots(b, C * self.checkpoint_every(b, C)) + b.n_seqs * (self.segments(b, C) - 1)

    def stages(self, stage_solve: bool | None = None) -> bool:
        """Whether the two-launch forward runs the intra kernel, and the walk and output kernels read what it staged."""
        if not self.lp.intra_matrices:
            return False
        if self.lp.stages_solve:
            return self.s.stage_solve if stage_solve is None else stage_solve
        return self.s.stage_intra

    def phases(self, cfg: LaunchConfig | None, device: torch.device) -> int:
        """chunk_phases where set, else the launch config's, else two on CUDA, one interpreted."""
        if self.s.chunk_phases:
            return self.s.chunk_phases
        if cfg is not None and cfg.phases:
            return cfg.phases
        return 2 if device.type == "cuda" and not self.s.interpreting else 1

    def checkpoint_dtype(self, chunked: bool, dtype: torch.dtype, state: str) -> torch.dtype:
        return checkpoint_dtype(chunked, dtype, self.s, state in self.lp.fp32_states, self.lp.half_states)

    def chunk_launch(self, b, C: int, every: int = 1) -> tuple[int, dict]:
        """(programs per head of an output launch, the chunked kernels' launch arguments), each
        program taking `every` chunks. Packed sequences take one program per checkpoint slot,
        each told its sequence by a table (chunk_seqs: no host sync)."""
        x0 = next(iter(b.inputs.values()))
        device, n, span = x0.device, b.n_seqs, C * every
        if b.cu_seqlens is None:
            programs, chunk_seq = n * (-(-b.T // span)), x0
        else:
            programs = checkpoint_slots(b, span)
            chunk_seq = chunk_seqs(b.cu_seqlens, span, n, programs, device)
        blocks = self.chunk_blocks(b)
        dot = dot_code(x0.dtype, self.lp.half_matmuls, self.s.interpreting)
        return programs, blocks | dict(chunk=C, unit=16, dot=dot, n_seqs=n, chunk_seq=chunk_seq, ckpt_every=every,
                                       key_block=self.key_block(blocks, C))

    def tuned(self, b, form: str, run, C: int | None = None) -> LaunchConfig | None:
        """The launch config of one kernel form: the tuner's; without one, default_config on
        CUDA and None (Triton's defaults) under the interpreter."""
        if self.tune is not None:
            return self.tune(form, run, C)
        x0 = next(iter(b.inputs.values()))
        return (default_config(self.lp, form, b.sizes, self.s)
                if x0.device.type == "cuda" and not self.s.interpreting else None)

    # ---- one launch ----
    def _values(self, b, launch: dict) -> dict:
        """The values every kernel takes: the inputs, params and options, T, H, dims as floats."""
        v = dict(launch)
        v.update({("input", k): b.inputs[k].contiguous() for k, _ in self.lp.inputs})
        v.update(group_values(b.inputs, b.H))
        v.update({("param", k): b.params[k].contiguous() for k, _ in self.lp.params})
        v.update({("option", k): b.options[k] for k in self.lp.options})
        v["T"], v["H"] = b.T, b.H
        v.update({("fsize", d): float(b.sizes[d]) for d in self.lp.dims})
        return v

    def _launch(self, form: str, device, grid: tuple, v: dict, **record) -> None:
        """kernel[grid] on v: a chunked form's kernel for the stage v names (v["stage"])."""
        stage = v.get("stage")
        name, kernel = self.kernel(form, device, stage, v if stage is not None else None)
        args = self.lp.kernel_args[form]
        args.launch(kernel, grid, v)
        _record(form=form, module=self.module, kernel=name, grid=grid, args=args,
                values=v, **record)

    def forward(self, b, form: str, *, output_final_state: bool, checkpoints: bool, chunk_tokens: int,
                launch: dict, out_dtype=None, ckpts_in: dict | None = None, write_out: bool = True,
                grid0: int | None = None, finals_into: dict | None = None, dense_into: dict | None = None,
                tiles: int | None = None, intra: torch.Tensor | None = None, staged: bool = False):
        """Launch a forward kernel; `launch` the sizes, blocks and constexprs the caller chose
        and Triton's options. chunk_tokens: tokens per checkpoint; ckpts_in: checkpoints to read
        (the chunked output and refill kernels); write_out=False: no output (the walk, refill,
        intra), None returned for it; grid0: programs along axis 0 (default: sequences x heads);
        finals_into: the final states' buffers (a step in place); dense_into: the refill's
        buffers; tiles: programs along axis 1 (default: the tile dim's blocks); intra: the
        matrices the intra kernel writes and the output kernel reads where staged. A chunked
        launch names its kernel's stage in launch["stage"]. Returns (o, finals or None,
        checkpoints or None)."""
        lp = self.lp
        x0 = next(iter(b.inputs.values()))
        device, n, H = x0.device, b.n_seqs, b.H
        slots = checkpoint_slots(b, chunk_tokens)
        tiles, splits = tiles or self.n_tiles(b, launch), self.n_splits(b, launch)
        o_shape = (b.B, b.T, H) + tuple(b.sizes[d] for d in lp.output)
        # split blocks write partial outputs (float32, summed below)
        out = empty(((splits,) if splits > 1 else ()) + o_shape if write_out else (1,),
                    torch.float32 if splits > 1 else out_dtype or x0.dtype, device)
        v = self._values(b, launch)
        finals, ckpts = {}, dict(ckpts_in or {})
        for name, dims in lp.states:          # the spec's, and a stabilizer's m (starts at 0)
            shape = tuple(b.sizes[d] for d in dims)
            init = out
            if b.initial_state is not None and ckpts_in is None:
                init = (b.initial_state[name].to(torch.float32).contiguous() if name in b.initial_state
                        else torch.zeros((n, H) + shape, dtype=torch.float32, device=device))
            if output_final_state:
                finals[name] = finals_into[name] if finals_into is not None else empty((n, H) + shape,
                                                                                      torch.float32, device)
            if checkpoints:
                ckpts[name] = empty((slots, H) + shape, self.checkpoint_dtype(form == "chunk_fwd", x0.dtype, name),
                                    device)
            v["init", name], v["final", name], v["ckpt", name] = init, finals.get(name, out), ckpts.get(name, out)
            v["dense", name] = (dense_into or {}).get(name, out)
        v["out"] = out
        _unsegmented(v, lp.states, out)
        v["intra"], v["staged_intra"] = (intra if intra is not None else out), staged
        v["cu_seqlens"] = b.cu_seqlens.to(device) if b.cu_seqlens is not None else out
        v.update(use_initial=b.initial_state is not None and ckpts_in is None, store_final=output_final_state,
                 varlen=b.cu_seqlens is not None,
                 # the segmented output kernel stores its corrected checkpoints back (segments.py)
                 store_ckpt=checkpoints or bool(launch.get("store_ckpt", False)))
        self._launch(form, device, (grid0 or n * H, tiles, splits), v, x0=x0, splits=splits,
                     final_dtype=x0.dtype if out_dtype is None else out_dtype, inplace=finals_into is not None,
                     states=[(name, (n, H) + tuple(b.sizes[d] for d in dims),
                              "none" if b.initial_state is None else
                              "given" if name in b.initial_state else "zeros") for name, dims in lp.states])
        if splits > 1:
            out = out.sum(0).to(out_dtype or x0.dtype)
        return (out if write_out else None), (finals if output_final_state else None), (ckpts if checkpoints else None)

    def backward(self, b, form: str, per_state, do: torch.Tensor, dfinal: dict | None, *, launch: dict,
                 write=("inputs", "params", "dinit"), grid0: int | None = None, param_rows: int | None = None,
                 tile_programs: int | None = None, intra: torch.Tensor | None = None):
        """Launch a backward kernel: per_state(name, shape, dfin, dinit, device) a state's
        buffers by role, `launch` as forward's; returns the gradients of the inputs, the params
        (summed over sequences) and the initial states, None for what this launch does not
        `write`. grid0: programs along axis 0 (default: sequences x heads); param_rows: the
        params' partial rows per tile block (default: one per sequence); tile_programs: programs
        along axis 1 (default: one per block of the tile dim; the chunked tiles kernel takes 1);
        intra: the rank-1 inverses the intra kernel staged (the walk's staged variant reads them)."""
        lp = self.lp
        device, n, H = next(iter(b.inputs.values())).device, b.n_seqs, b.H
        # what lacks the tile (split) dim gets one gradient partial per tile (split) block, summed below
        tiles, splits = tile_programs or self.n_tiles(b, launch), self.n_splits(b, launch)

        def parts(dims) -> int:
            return ((tiles if lp.tile is not None and lp.tile not in dims else 1)
                    * (splits if lp.split is not None and lp.split not in dims else 1))

        v = self._values(b, launch)
        dinit = {}
        for name, dims in lp.states:
            shape = tuple(b.sizes[d] for d in dims)
            dinit[name] = empty((parts(dims) * n, H) + shape, torch.float32, device) if "dinit" in write else do
            dfin = None
            if dfinal:
                dfin = (dfinal[name].to(torch.float32).contiguous() if name in dfinal
                        else torch.zeros((n, H) + shape, dtype=torch.float32, device=device))
            v.update({(role, name): x for role, x in per_state(name, shape, dfin, dinit[name], device).items()})
        # a grouped input's gradient per head (float32), its groups summed below
        dinputs = {}
        for k, dims in lp.inputs:
            x = b.inputs[k]
            dinputs[k] = ((empty(x.shape, x.dtype, device) if parts(dims) == 1 and x.shape[2] == H
                           else empty((parts(dims),) + per_head(x, H), torch.float32, device))
                          if "inputs" in write else do)
        dparams = {k: empty((parts(dims) * (param_rows or n),) + tuple(b.params[k].shape), torch.float32, device)
                   if "params" in write else do for k, dims in lp.params}
        v["do"] = do.contiguous()
        v["intra"], v["staged_intra"] = (intra if intra is not None else v["do"]), intra is not None
        _unsegmented(v, lp.states, v["do"])
        v.update({("dinput", k): x for k, x in dinputs.items()})
        v.update({("dparam", k): x for k, x in dparams.items()})
        v["cu_seqlens"] = b.cu_seqlens.to(device) if b.cu_seqlens is not None else do
        v.update(use_dfinal=dfinal is not None, varlen=b.cu_seqlens is not None)
        self._launch(form, device, (grid0 or n * H, tiles, splits), v)
        dparams = {k: x.sum(0).to(b.params[k].dtype) for k, x in dparams.items()} if "params" in write else None
        dinputs = ({k: x if x.shape == b.inputs[k].shape else sum_groups(x.sum(0), b.inputs[k])
                    for k, x in dinputs.items()} if "inputs" in write else None)
        dinit = ({k: x if x.shape[0] == n else x.reshape((-1, n) + tuple(x.shape[1:])).sum(0) for k, x in dinit.items()}
                 if "dinit" in write else None)
        return dinputs, dparams, dinit

    # ---- the forms ----
    def recurrent_forward(self, b, *, output_final_state: bool, out_dtype=None, checkpoints: bool = False,
                          CK: int = 32, inplace: bool = False, state_indices: torch.Tensor | None = None):
        """The fused recurrent forward: (o, final states or None, checkpoints or None), with
        checkpoints the state at the start of every chunk of CK tokens ([slots, H, *dims]).
        inplace: the final states overwrite b.initial_state's buffers (float32, contiguous);
        state_indices [n] int: sequence i's state is row state_indices[i] of those buffers."""
        x0 = next(iter(b.inputs.values()))

        def run(cfg):
            kw = self.dim_blocks(b, cfg) | (cfg.launch() if cfg is not None else {})
            tile = self.lp.tile
            if inplace and tile is not None and any(tile not in dims for _, dims in self.lp.states):
                # every tile program reads and writes a state without the tile dim whole: with one
                # buffer, a later program could read what an earlier one wrote. One tile block.
                kw["block", tile] = block(b.sizes[tile])
            kw.update(ck=CK, state_indices=state_indices if state_indices is not None else x0,
                      use_indices=state_indices is not None)
            return self.forward(b, "recurrent_fwd", output_final_state=output_final_state, checkpoints=checkpoints,
                                chunk_tokens=CK, out_dtype=out_dtype, launch=kw,
                                finals_into=b.initial_state if inplace else None)
        if inplace:     # no timing runs: each would advance the state again
            cuda = x0.device.type == "cuda" and not self.s.interpreting
            return run(default_config(self.lp, "recurrent_fwd", b.sizes, self.s) if cuda else None)
        return run(self.tuned(b, "recurrent_fwd", run))

    def recurrent_backward(self, b, ckpts: dict, do: torch.Tensor, dfinal: dict | None, CK: int = 32):
        """Gradients of the inputs ([B, T, H, ...], their dtypes), the params ([H, ...]) and the
        initial states ([N, H, ...] float32) from the output's and the final states' gradients."""
        def run(cfg):
            kw = self.dim_blocks(b, cfg)
            programs = b.n_seqs * b.H * self.n_tiles(b, kw) * self.n_splits(b, kw)

            def per_state(name, shape, dfin, dinit, device):
                scratch = empty((programs * CK,) + shape, torch.float32, device)
                return dict(ckpt=ckpts[name], scratch=scratch, dfinal=dfin if dfin is not None else scratch,
                            dinit=dinit)
            return self.backward(b, "recurrent_bwd", per_state, do, dfinal,
                                 launch=kw | {"ck": CK} | (cfg.launch() if cfg is not None else {}))
        return run(self.tuned(b, "recurrent_bwd", run))

    def chunk_forward(self, b, *, output_final_state: bool, out_dtype=None, checkpoints: bool = False,
                      C: int | None = None):
        """The chunked forward (two launches or one: phases); same returns as
        recurrent_forward, its checkpoints the states at every checkpoint_every-th chunk start."""
        C = C or self.lp.chunk_size
        x0 = next(iter(b.inputs.values()))
        every = self.checkpoint_every(b, C)
        S = self.segments(b, C)
        if S > 1:
            def run_segmented(cfg):
                return _segmented_forward(self, b, S, C, every, cfg, output_final_state=output_final_state,
                                         out_dtype=out_dtype, checkpoints=checkpoints)
            return run_segmented(self.tuned(b, "chunk_fwd", run_segmented, C))
        programs, common = self.chunk_launch(b, C, every)

        def run(cfg):
            kw = dict(output_final_state=output_final_state, chunk_tokens=C * every, out_dtype=out_dtype)
            launch = common | (cfg.launch() if cfg is not None else {})
            if self.phases(cfg, x0.device) == 1:
                return self.forward(b, "chunk_fwd", checkpoints=checkpoints, launch=launch | {"stage": "fused"}, **kw)
            intra = None
            if self.stages():      # the intra kernel: the intra-chunk matrices (or inverses), once per chunk
                # in the dtype the output kernel's matmul takes A in (dot_code: so the same bits as computed)
                dot_dtype = {1: torch.bfloat16, 2: torch.float16}.get(common["dot"], torch.float32)
                intra = empty((x0.shape[0] * x0.shape[1], b.H, self.lp.intra_matrices, C), dot_dtype, x0.device)
                self.forward(b, "chunk_fwd", checkpoints=False, ckpts_in={}, write_out=False, grid0=programs * b.H,
                             tiles=1, intra=intra, launch=_one_stage(launch) | {"stage": "intra"},
                             **(kw | {"output_final_state": False}))
            # the walk: the chunks for the states (checkpoints, final states); then the outputs
            _, finals, ckpts = self.forward(b, "chunk_fwd", checkpoints=True, write_out=False, intra=intra,
                                            staged=intra is not None, launch=launch | {"stage": "walk"}, **kw)
            kw["output_final_state"] = False
            o, _, _ = self.forward(b, "chunk_fwd", checkpoints=False, ckpts_in=ckpts, grid0=programs * b.H,
                                   intra=intra, staged=intra is not None,
                                   launch=_one_stage(launch) | {"stage": "output"} | self.output_blocks(b),
                                   **kw)
            return o, finals, (ckpts if checkpoints else None)
        return run(self.tuned(b, "chunk_fwd", run, C))

    def staged_inverses(self, b, C: int, launch: dict) -> torch.Tensor:
        """The forward's intra kernel run again for the backward's walk: each chunk's staged
        matrices [rows, H, n, C] (the rank-1 inverses among them) in the matmuls' dtype, one
        program per chunk (no state: every chunk at once)."""
        x0 = next(iter(b.inputs.values()))
        programs, common = self.chunk_launch(b, C)
        dot_dtype = {1: torch.bfloat16, 2: torch.float16}.get(launch["dot"], torch.float32)
        intra = empty((x0.shape[0] * x0.shape[1], b.H, self.lp.intra_matrices, C), dot_dtype, x0.device)
        self.forward(b, "chunk_fwd", output_final_state=False, checkpoints=False, chunk_tokens=C, ckpts_in={},
                     write_out=False, grid0=programs * b.H, tiles=1, intra=intra,
                     launch=_one_stage(common | {k: launch[k] for k in ("dot", "num_warps", "num_stages") if k in launch})
                     | {"stage": "intra"})
        return intra

    def chunk_states(self, b, ckpts: dict, C: int) -> dict:
        """The state at every chunk start (what the chunked backward reads) from the forward's
        checkpoints at every checkpoint_every-th: the refill kernel, one program per checkpoint walking
        its chunks; the checkpoints themselves where they are dense already."""
        every = self.checkpoint_every(b, C)
        have, want = next(iter(ckpts.values())).shape[0], checkpoint_slots(b, C * every)
        if have != want:
            raise ValueError(f"chunked backward: the forward's checkpoints have {have} slots, {want} expected for a "
                             f"checkpoint every {every} chunks of {C} tokens: launch.CHECKPOINT_EVERY (or the chunk "
                             "size) changed between the forward and its backward")
        if every == 1:
            return ckpts
        x0 = next(iter(b.inputs.values()))
        programs, common = self.chunk_launch(b, C, every)
        slots = checkpoint_slots(b, C)
        dense = {name: empty((slots, b.H) + tuple(b.sizes[d] for d in dims), ckpts[name].dtype, x0.device)
                 for name, dims in self.lp.states}

        def run(cfg):
            self.forward(b, "chunk_fwd", output_final_state=False, checkpoints=False, chunk_tokens=C * every,
                         ckpts_in=ckpts, write_out=False, grid0=programs * b.H, dense_into=dense,
                         launch=_one_stage(common | (cfg.launch() if cfg is not None else {})) | {"stage": "refill"})
        run(self.tuned(b, "chunk_fwd", run, C))
        return dense

    def chunk_backward(self, b, ckpts: dict, do: torch.Tensor, dfinal: dict | None, C: int):
        """The chunked backward (two launches or one): same returns as recurrent_backward, from
        the chunked forward's checkpoints (chunks of C tokens)."""
        x0 = next(iter(b.inputs.values()))
        H, tile = b.H, self.lp.tile
        S = self.segments(b, C)
        if S > 1:
            def run_segmented(cfg):
                return _segmented_backward(self, b, S, ckpts, do, dfinal, C, cfg)
            return run_segmented(self.tuned(b, "chunk_bwd", run_segmented, C))
        ckpts = self.chunk_states(b, ckpts, C)
        slots = checkpoint_slots(b, C)
        chunk_programs, launch_kw = self.chunk_launch(b, C)
        launch_kw |= self.backward_blocks(b)
        tiles = self.n_tiles(b, launch_kw)

        def run(cfg):
            common = launch_kw | (cfg.launch() if cfg is not None else {})
            if self.phases(cfg, x0.device) == 1:
                def per_state(name, shape, dfin, dinit, device):
                    return dict(ckpt=ckpts[name], dfinal=dfin if dfin is not None else dinit, dinit=dinit, dh=dinit)
                return self.backward(b, "chunk_bwd", per_state, do, dfinal, launch=common | {"stage": "fused"})
            dh = {}

            def per_state(name, shape, dfin, dinit, device):
                parts = tiles if tile is not None and tile not in dict(self.lp.states)[name] else 1
                # dL/dS at chunk ends in the checkpoints' dtype (bf16 for bf16 inputs)
                dh[name] = empty((slots * parts, H) + shape, self.checkpoint_dtype(True, x0.dtype, name), device)
                return dict(ckpt=ckpts[name], dfinal=dfin if dfin is not None else dinit, dinit=dinit, dh=dh[name])
            # the rank-1 inverses, staged again (the intra kernel: every chunk at once), so that the
            # walk takes them as matmuls (its _staged variant), no triangular solve on its dependent path
            intra = self.staged_inverses(b, C, common) if self.lp.stages_solve and self.stages() else None
            # the walk writes dh and the initial states' gradients; the tiles kernel (same buffers) the rest
            _, _, dinit = self.backward(b, "chunk_bwd", per_state, do, dfinal, write=("dinit",), intra=intra,
                                        launch=common | {"stage": "walk"})
            dinputs, dparams, _ = self.backward(
                b, "chunk_bwd", lambda name, *a: dict(ckpt=ckpts[name], dfinal=do, dinit=do, dh=dh[name]),
                do, dfinal, write=("inputs", "params"), grid0=chunk_programs * H, param_rows=chunk_programs,
                launch=_one_stage(common) | {"stage": "tiles"}, tile_programs=1 if self.lp.tile_loop else None)
            return dinputs, dparams, dinit
        return run(self.tuned(b, "chunk_bwd", run, C))

"""The launcher's data (mixc/standalone/launcher.py): LaunchPlan, what the launches read of a
spec (plain names and numbers, derived from the derive-stage Plan by codegen/launch_plan.py
and carried by a generated module as METADATA["launch"]); LaunchSettings, the launch knobs;
LaunchConfig, one launch configuration (the tuner's unit, runtime/autotune.py). Frozen
dataclasses of plain values: a compiled module rebuilds its LaunchPlan from METADATA without
mixc.derive."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from functools import cached_property

from .kernel_args import CHUNK_STAGES, KernelArgs, kernel_args, stage_kernel

@dataclass(frozen=True)
class LaunchPlan:
    """What the launches read of a spec (all plain names and numbers)."""
    mixer: str
    kernels: tuple[tuple[str, str], ...]                # (form, the kernel's name in the module)
    dims: tuple[str, ...]                               # the dims, in declared order
    inputs: tuple[tuple[str, tuple[str, ...]], ...]     # (name, dims), the kernels' order
    params: tuple[tuple[str, tuple[str, ...]], ...]
    options: tuple[str, ...]                            # the number options, the kernels' order
    states: tuple[tuple[str, tuple[str, ...]], ...]     # the kernels' states (a stabilizer's m last)
    output: tuple[str, ...]                             # the output's dims
    chunk_size: int
    tile: str | None = None              # the dim split into programs (V, Mamba-2's P)
    split: str | None = None             # the recurrent kernels' split dim (K, Mamba's N)
    key: str | None = None               # the dim the chunked forward loops over in blocks (key_split.key_dim)
    fp32_states: tuple[str, ...] = ()    # states whose checkpoints stay float32 (the stabilizer's m)
    half_states: bool = True             # half-precision checkpoints allowed (plan.layout.half_states)
    half_matmuls: bool = True            # half-precision matmul operands (plan.layout.half_matmuls)
    intra_matrices: int = 0              # intra-chunk matrices the intra kernel can stage (plan.layout.intra_matrices)
    stages_solve: bool = False           # a state's class stages an inverse (STAGE_SOLVE decides)
    output_tile: int | None = None       # the forward output kernel's tile block (the class's output_tile)
    backward_tile: int | None = None     # the chunked backward's tile block (the class's backward_tile)
    key_block: int | None = None         # the classes' smallest key block (None: KEY_BLOCK_AT)
    checkpoint_tokens: int | None = None  # the classes' fewest tokens per checkpoint (None: the setting's)

    def to_metadata(self) -> dict:
        """Plain lists, dicts and numbers (METADATA["launch"] of a generated module)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("kernels", "inputs", "params", "states"):
                v = {k: (list(x) if isinstance(x, tuple) else x) for k, x in v}
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_metadata(cls, d: dict) -> "LaunchPlan":
        kw = {}
        for f in fields(cls):
            v = d[f.name]
            if f.name in ("kernels", "inputs", "params", "states"):
                v = tuple((k, tuple(x) if isinstance(x, list) else x) for k, x in v.items())
            elif isinstance(v, list):
                v = tuple(v)
            kw[f.name] = v
        return cls(**kw)

    @cached_property
    def kernel_names(self) -> dict[str, str]:
        """form -> a recurrent kernel's name, or a chunked form's stem (kernel_name)."""
        return dict(self.kernels)

    def kernel_name(self, form: str, stage: str | None = None, parts: tuple[str, ...] = ()) -> str:
        """The kernel a launch of `form` runs: a chunked form's kernel for `stage`, the variant
        `parts` names (kernel_args.CHUNK_STAGES, STAGE_VARIANTS: gla_chunk_fwd_walk,
        gla_chunk_fwd_output_rewalk_staged ...), a recurrent form's own."""
        stem = self.kernel_names[form]
        if form not in CHUNK_STAGES:
            return stem
        if stage not in CHUNK_STAGES[form]:
            raise ValueError(f"{form}: a launch names its stage, one of {', '.join(CHUNK_STAGES[form])}; "
                             f"got {stage!r}")
        return stage_kernel(stem, stage, parts)

    @cached_property
    def kernel_args(self) -> dict[str, KernelArgs]:
        """Each form's argument list (standalone/kernel_args.py), from the names above."""
        names = (tuple(n for n, _ in self.inputs), tuple(n for n, _ in self.params), self.options,
                 tuple(n for n, _ in self.states), self.dims)
        return {form: kernel_args(form, *names) for form, _ in self.kernels}

    @cached_property
    def tile_loop(self) -> bool:
        """Whether the chunked backward's tiles kernel runs one program per (chunk, head), looping over
        the tile dim's blocks inside: then what lacks the tile dim (dq, dk, dg) is summed in
        registers and written once in the inputs' dtype, where one program per block would write
        float32 partials for torch to sum and cast (fla's dqkwg loops over V likewise; at K = V =
        128 bf16 that is 6.1 KB of 13.7 KB per token-head for simple_gla: bench/traffic_report).
        A param over the tile dim is loaded once per program, so such a spec keeps a program per
        block (no library spec has one)."""
        return self.tile is not None and not any(self.tile in dims for _, dims in self.params)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchSettings:
    """The launch knobs (runtime/launch.py's module attributes carry mixc.load's values)."""
    # The chunked kernels in two launches each (forward: the walk kernel for the states, the
    # output kernel for every chunk's output at once, fla's chunk_fwd_h + chunk_fwd_o; backward:
    # the walk for dL/dS at every chunk's end, the tiles kernel for every chunk's gradients at
    # once, fla's dh + dq/dk/dv kernels) or in one walk each (the fused kernels). None: the launch
    # config's choice on CUDA (two untuned), one under the interpreter; 1 or 2 forces it.
    chunk_phases: int | None = None
    # Block of the tile dim (V, Mamba-2's P) in the chunked kernels: the state per program is
    # [K, chunk_tile] instead of [K, V] (sm_90 at K = V = 128 spilled 0.9-5 KB whole).
    chunk_tile: int = 64
    # The recurrent kernels' tile and split blocks (fla's fused recurrent kernels: BV <= 32, BK <= 64).
    recurrent_tile: int = 32
    recurrent_split: int = 64
    # Every checkpoint float32: else the chunked forward's checkpoints (and the backward's dL/dS)
    # are stored in the inputs' dtype where that is bf16 or fp16, as fla stores its h.
    fp32_checkpoints: bool = False
    # Chunks between the chunked forward's checkpoints (R): the walk stores the state at every
    # R-th chunk start only, the output kernel walks each checkpoint's R chunks, the backward
    # refills them (the refill kernel). None: checkpoint_tokens // C on a GPU (at least
    # min_programs output programs),
    # 1 under the interpreter; an int forces it. checkpoint_tokens 64 (R = 1 at C = 64, a
    # checkpoint per chunk as fla's h) since 2026-12-06, chosen by the time model (bench/time_model,
    # "The checkpoint span"; bench/README.md): at T = 8192, H = 16 the output kernel walking R = 4
    # chunks on one block per SM waits 8 waves x 4 dependent chunk-steps, while one chunk a program
    # is bytes-bound: simple_gla 0.688 -> 0.612 ms forward, 1.491 -> 1.275 forward + backward (no
    # refill launch; fwd+bwd bytes 6860 -> 6458, FLOPs 409600 -> 344064), though the inference
    # forward moves 1812 -> 2580 B per token-head. It was 256 (R = 4), chosen by bytes.
    checkpoint_every: int | None = None
    checkpoint_tokens: int = 64
    min_programs: int = 512
    # The forward in two launches stages the intra-chunk matrices (the intra kernel) of the classes that
    # stage them (the key-diagonal decay's A); stage_solve: the rank-1 class's inverse too, so
    # the walk takes U as one matmul instead of C - 1 dependent substitution rows. On since
    # 2026-12-05 by the time model (bench/time_model, bench/README.md): the delta rules' forward
    # models 1.66 -> 0.75 ms on an H100 at T = 8192, H = 16, though it moves 2580 -> 3222 B per
    # token-head; the two tie only if a solve row took 0.008 us (two cross-warp reductions take
    # ~0.1). Unmeasured on a GPU: bench/gpu_check's "chunk staged solve" and the default time both.
    stage_intra: bool = True
    stage_solve: bool = True
    # The key dim's block in the chunked forward's intra and output kernels: None: key_block_at where the
    # chunk's [C, K] blocks exceed key_block_elements, else the whole dim; an int forces it.
    key_block: int | None = None
    key_block_at: int = 64
    key_block_elements: int = 32 * 128
    # The segmented walk (standalone/segments.py): each sequence's chunk walk (forward and
    # backward) cut into this many segments walked at once, their summaries folded, the
    # checkpoints (dL/dS) corrected in place. None: the policy (Launcher.segments: on a GPU whose
    # SMs the walk's grid leaves idle, from sm_count and the shape); 1: off; an int forces it
    # (MIXC_SEGMENTS; the tests force 2 and 3 under the interpreter).
    segments: int | None = None
    # The SMs the policy fills: None: torch.cuda's count for the device (no segments off CUDA)
    sm_count: int | None = None
    # Triton runs kernels in its interpreter (TRITON_INTERPRET=1): the CPU path the tests take
    interpreting: bool = False

    @classmethod
    def from_env(cls) -> "LaunchSettings":
        """The defaults, with the environment's TRITON_INTERPRET and MIXC_FP32_CHECKPOINTS."""
        return cls(interpreting=_env_flag("TRITON_INTERPRET"),
                   fp32_checkpoints=os.environ.get("MIXC_FP32_CHECKPOINTS") == "1", segments=env_segments())


def env_segments() -> int | None:
    """MIXC_SEGMENTS: the segmented walk's count forced (1: off), unset or empty: the policy."""
    text = os.environ.get("MIXC_SEGMENTS", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MIXC_SEGMENTS: expected a positive integer (1: off), got {text!r}")
    return int(text)


# The output kernel's walk covers the key dim in at most this many static blocks (codegen/key_walk.py)
STATIC_BLOCKS = 8


@dataclass(frozen=True)
class LaunchConfig:
    """One launch configuration (the tuner's unit, runtime/autotune.py's Config). C: the chunk
    size (form "chunk"); tile / split: the recurrent kernels' blocks of the tile and split dims;
    phases: the chunked kernels in one launch or two."""
    num_warps: int = 4
    num_stages: int = 3
    C: int | None = None
    tile: int | None = None
    split: int | None = None
    phases: int | None = None

    def launch(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# The untuned chunked launch on CUDA: two launches, 8 warps, 3 stages for the walk and 1 for
# the output kernel (no spills in the forward at K = V = 128 on sm_90 and shared memory that fits, where
# Triton's default 4 warps spill); the tuner's list starts with it (runtime/autotune.py).
CHUNK_DEFAULT = LaunchConfig(8, 3, phases=2)

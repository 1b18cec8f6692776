"""mixc.load's launches: the Plan's LaunchPlan, this module's knobs and the tuner, handed to the
one launcher (mixc/standalone/launcher.py, which a compiled module's runtime calls too).

The rules that turn bound arguments into kernel launches (grids, blocks, constexprs, buffers,
checkpoint dtypes, scratch) live in the launcher; what is mixc.load's own lives here: the
LaunchPlan derived from the Plan (codegen/launch_plan.py, once per plan), the knobs below as
module attributes (tests and bench/gpu_check set them; current_settings() reads them per call),
autotuning on CUDA (runtime/autotune.py: _tuned, chunk_size_for) and the device check
(KernelUnavailable). The functions below take a Plan and a Bound as before and call the
launcher; custom_op.py, decode.py and the tests call them."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..codegen.launch_plan import launch_plan
from ..derive.plan import Plan
from ..derive.stabilize import M as STABILIZER_M
from ..standalone import launcher as _launcher
from ..standalone.launcher import (Launcher, LaunchSettings, block, checkpoint_slots, chunk_seqs,  # noqa: F401
                                   recording, sum_groups)
from . import autotune
from .cache import interpreting, load_module
from .signature import Bound, option_values

# The knobs (what each does: standalone/launcher.py, LaunchSettings), as module attributes so
# that tests and bench/gpu_check can set them. MIXC_FP32_CHECKPOINTS=1 keeps every checkpoint fp32.
_DEFAULT = LaunchSettings()
CHUNK_PHASES: int | None = _DEFAULT.chunk_phases
CHUNK_TILE = _DEFAULT.chunk_tile
RECURRENT_TILE, RECURRENT_SPLIT = _DEFAULT.recurrent_tile, _DEFAULT.recurrent_split
FP32_CHECKPOINTS = os.environ.get("MIXC_FP32_CHECKPOINTS") == "1"
CHECKPOINT_EVERY: int | None = _DEFAULT.checkpoint_every
CHECKPOINT_TOKENS, MIN_PROGRAMS = _DEFAULT.checkpoint_tokens, _DEFAULT.min_programs
STAGE_INTRA, STAGE_SOLVE = _DEFAULT.stage_intra, _DEFAULT.stage_solve
KEY_BLOCK: int | None = _DEFAULT.key_block
KEY_BLOCK_AT, KEY_BLOCK_ELEMENTS = _DEFAULT.key_block_at, _DEFAULT.key_block_elements
# the segmented walk (LaunchSettings.segments, sm_count): MIXC_SEGMENTS forces a count
SEGMENTS: int | None = _launcher.env_segments()
SM_COUNT: int | None = _DEFAULT.sm_count


def current_settings() -> LaunchSettings:
    """The knobs above, and whether Triton interprets."""
    return LaunchSettings(chunk_phases=CHUNK_PHASES, chunk_tile=CHUNK_TILE, recurrent_tile=RECURRENT_TILE,
                          recurrent_split=RECURRENT_SPLIT, fp32_checkpoints=FP32_CHECKPOINTS,
                          checkpoint_every=CHECKPOINT_EVERY, checkpoint_tokens=CHECKPOINT_TOKENS,
                          min_programs=MIN_PROGRAMS, stage_intra=STAGE_INTRA, stage_solve=STAGE_SOLVE,
                          key_block=KEY_BLOCK, key_block_at=KEY_BLOCK_AT, key_block_elements=KEY_BLOCK_ELEMENTS,
                          segments=SEGMENTS, sm_count=SM_COUNT, interpreting=interpreting())


def settings() -> tuple:
    """What a launch depends on besides its arguments: the knobs, the tuner and its mode. Part of
    a replayed launch's key (runtime/fastpath.py), so changing one takes the bound path again."""
    return current_settings(), _tuned, os.environ.get("MIXC_AUTOTUNE")


class KernelUnavailable(RuntimeError):
    """The generated kernels cannot run on these tensors here."""


def _refuse(device: torch.device) -> None:
    if device.type == "cpu" and not interpreting():
        raise KernelUnavailable(
            "Triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before Python starts (before triton is imported), or use mode='reference'")
    if device.type not in ("cpu", "cuda"):
        raise KernelUnavailable(f"no Triton kernels for device type '{device.type}'")


def module_for(plan: Plan, device: torch.device):
    _refuse(device)
    return load_module(plan)


_PLANS: dict[int, tuple] = {}       # id(plan) -> (plan, its LaunchPlan): the plan kept, so its id stays its


def plan_of(plan: Plan) -> _launcher.LaunchPlan:
    """The plan's LaunchPlan (codegen/launch_plan.py: the one its module's METADATA carries)."""
    hit = _PLANS.get(id(plan))
    if hit is None or hit[0] is not plan:
        hit = _PLANS[id(plan)] = (plan, launch_plan(plan))
    return hit[1]


def launcher(plan: Plan, bound: Bound) -> Launcher:
    """The launcher of one call: the plan's module (checked for the tensors' device), the knobs
    as they are now, the tuner."""
    device = next(iter(bound.inputs.values())).device
    return Launcher(plan_of(plan), module_for(plan, device), current_settings(),
                    tune=lambda form, run, C=None: _tuned(plan, bound, form, run, C), refuse=_refuse)


def with_options(plan: Plan, bound: Bound) -> Bound:
    """The bound call with every number option's value (the defaults evaluated where not passed):
    the launcher reads them from bound.options."""
    if all(name in bound.options for name in plan_of(plan).options):
        return bound
    return replace(bound, options=option_values(plan.ir, bound))


def recurrent_forward(plan: Plan, bound: Bound, **kw):
    """Launcher.recurrent_forward: (o, final states or None, checkpoints or None)."""
    bound = with_options(plan, bound)
    return launcher(plan, bound).recurrent_forward(bound, **kw)


def recurrent_backward(plan: Plan, bound: Bound, ckpts: dict, do: torch.Tensor, dfinal: dict | None, CK: int = 32):
    bound = with_options(plan, bound)
    return launcher(plan, bound).recurrent_backward(bound, ckpts, do, dfinal, CK)


def chunk_forward(plan: Plan, bound: Bound, **kw):
    """Launcher.chunk_forward: the chunked forward (two launches or one)."""
    bound = with_options(plan, bound)
    return launcher(plan, bound).chunk_forward(bound, **kw)


def chunk_states(plan: Plan, bound: Bound, ckpts: dict, C: int) -> dict:
    bound = with_options(plan, bound)
    return launcher(plan, bound).chunk_states(bound, ckpts, C)


def chunk_backward(plan: Plan, bound: Bound, ckpts: dict, do: torch.Tensor, dfinal: dict | None, C: int):
    bound = with_options(plan, bound)
    return launcher(plan, bound).chunk_backward(bound, ckpts, do, dfinal, C)


def _tuned(plan: Plan, bound: Bound, form: str, run, C: int | None = None) -> autotune.Config | None:
    """The launch config of one kernel form: None (the untuned launch) under the interpreter and
    on CPU tensors; on CUDA the config chosen by mixc.runtime.autotune for this key (timed on the
    first call, then cached), or the list's first (launcher.default_config) with tuning off."""
    x0 = next(iter(bound.inputs.values()))
    kernels = rules(plan)
    if not autotune.active(x0.device):
        return (_launcher.default_config(kernels.lp, form, bound.sizes, kernels.s)
                if x0.device.type == "cuda" and not interpreting() else None)
    programs = bound.n_seqs * bound.H
    if form.startswith("recurrent"):
        kw = kernels.dim_blocks(bound)
        programs *= kernels.n_tiles(bound, kw) * kernels.n_splits(bound, kw)
    else:
        programs *= kernels.n_tiles(bound, kernels.chunk_blocks(bound))
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


# ---- the launcher's rules for a plan (tools/aot.py, the custom ops' fake shapes, the tests) ----

def rules(plan: Plan) -> Launcher:
    """A launcher that launches nothing: its block and policy rules (chunk_blocks, key_block,
    checkpoint_every, stages, ...) for this plan and the knobs as they are now."""
    return Launcher(plan_of(plan), load_module(plan), current_settings())


def checkpoint_dtype(chunked: bool, dtype: torch.dtype, state: str = "", half: bool = True) -> torch.dtype:
    """The dtype of a state's checkpoints for inputs of `dtype` (launcher.checkpoint_dtype)."""
    return _launcher.checkpoint_dtype(chunked, dtype, current_settings(), state == STABILIZER_M, half)


def checkpoint_every(plan: Plan, bound: Bound, C: int) -> int:
    """Chunks between the chunked forward's checkpoints (Launcher.checkpoint_every)."""
    return rules(plan).checkpoint_every(bound, C)

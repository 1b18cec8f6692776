"""Decode for serving: one token per sequence, the state updated in place.

    o, state = op.step(<one token of each input>, state=state, inplace=True)
    o, cache = op.step(<...>, state=cache, state_indices=idx, inplace=True)

With inplace=True the given state buffers are the step's output: the recurrent kernel reads
each program's block of the state and writes the same block back (no new state tensor, so a
step captured once in a CUDA graph replays without a copy back). With state_indices ([B]
int32/int64, as fla's and vLLM's fused recurrent kernels take ssm_state_indices) the state is
a cache of slots: each buffer is [N_slots, H, *state dims] and sequence i reads and writes
slot state_indices[i]; slots not named are untouched (continuous batching). Padding rows of a
captured batch point at a spare slot (vLLM's null block): every index names a slot, and no two
rows name the same one.

Graph safety: nothing on the kernel path reads a tensor on the host (no .item(), .cpu(),
.tolist() or nonzero) and every buffer it allocates has a size fixed by the shapes. The values
of state_indices are checked (range, duplicates) only when they live in CPU memory, where
reading them syncs with nothing; on CUDA they are the caller's promise, as in fla and vLLM.

On the torch backend the generated in-place step (codegen/torch_step.py: mul_, addcmul_ on the
buffers) updates them. Where the kernel cannot write the spec's state (a stabilized spec keeps S
exp(-m) in the kernel), with state_indices on the torch backend, and on the reference backend
the step is computed functionally and copied into the buffers (index_copy_ per slot), which is
graph-safe too.

A decode loop that binds once (the buffers, params and options fixed; per token only the
token's look and its declared ranges checked): op.decoder(state, ...), runtime/decoder.py."""
from __future__ import annotations

import dataclasses

import torch

from . import fastpath
from .launch import recording, recurrent_forward
from .signature import ArgumentError, bind
from .torch_step import TORCH_INPLACE, TorchStep, run_recipe, step_recipe, torch_step_inplace


def step_inplace(op, *, state, state_indices, mode: str, kwargs: dict):
    """op.step(..., inplace=True): returns (o [B, H, *dims], the state as given, updated)."""
    key = None
    if not torch.compiler.is_compiling():
        # a step like an earlier one replays its launch (runtime/fastpath.py); the indices' values
        # (on the CPU) are still checked, their look is in the key
        key = fastpath.step_key(("inplace", mode), kwargs, state)
        if key is not None and state_indices is not None:
            key = key + (fastpath._meta(state_indices),) if isinstance(state_indices, torch.Tensor) else None
        recipe = op._fast.get(key) if key is not None else None
        if isinstance(recipe, TorchStep):           # the torch backend's in-place step (no indices)
            return run_recipe(recipe, kwargs, state)
        if recipe is not None:
            idx = state_indices.contiguous() if state_indices is not None else None
            if idx is not None:
                _check_index_values(idx, recipe.rows)
            return fastpath.run_step(recipe, kwargs, state, idx)
    m = op.ir
    names = [s.name for s in m.states]
    buffers = _state_dict(m, state)
    bound = bind(m, dict(kwargs), step=True)
    x0 = next(iter(bound.inputs.values()))
    _refuse_gradients(bound, buffers)
    idx = _check_indices(state_indices, bound.B, x0.device)
    rows = _check_buffers(m, buffers, bound, idx, x0.device)
    if idx is not None:
        _check_index_values(idx, rows)
    asked, mode = mode, op._resolve(mode, x0.device)
    plan = op._plan_for(bound.flags)
    # while torch.compile traces, the functional step (the kernels' custom op) and index_copy_
    # below: the in-place launch writes the buffers outside any op torch can trace (and loads
    # the module under a lock, a context manager dynamo refuses)
    if mode in ("auto", "recurrent", "chunk") and plan.stabilizer is None and not torch.compiler.is_compiling():
        seq = {k: v.unsqueeze(1) for k, v in bound.inputs.items()}        # [B, 1, H, ...]: T = 1
        b = dataclasses.replace(bound, T=1, inputs=seq, initial_state={k: buffers[k] for k in names})
        with recording() as log:
            o, _, _ = recurrent_forward(plan, b, output_final_state=True, inplace=True, state_indices=idx)
        if key is not None and not (torch.is_grad_enabled() and _needs_grad(bound)):
            recipe = fastpath.recipe_from(log, m, kwargs, None, state_indices=idx, rows=rows)
            if recipe is not None:
                if len(op._fast) >= fastpath.MAX_RECIPES:
                    op._fast.clear()
                op._fast[key] = recipe
        return o[:, 0], state
    if mode == "torch" and idx is None and all(x.dtype != torch.float64 for x in (*bound.inputs.values(),
                                                                                 *bound.params.values())):
        # the generated in-place step: mul_ / addcmul_ on the buffers (runtime/torch_step.py)
        if key is not None and (recipe := step_recipe(plan, bound, True, kwargs)) is not None:
            op._keep(key, recipe)
            if asked == "torch":            # op.step's own look-up for mode "torch" (no launch settings)
                op._keep(fastpath.step_key(TORCH_INPLACE, kwargs, state, launches=False), recipe)
        return torch_step_inplace(plan, bound, buffers), state
    # functional step on the named rows, then copied into them
    rows_in = {k: (v.index_select(0, idx) if idx is not None else v) for k, v in buffers.items()}
    o, new = op._step(**kwargs, state=rows_in, mode=mode)     # the derived prev(x) inputs are in kwargs already
    with torch.no_grad():
        for k, v in buffers.items():
            if idx is not None:
                v.index_copy_(0, idx, new[k].to(v.dtype))
            else:
                v.copy_(new[k])
    return o, state


def _refuse_gradients(bound, buffers) -> None:
    """An in-place step writes the cache outside autograd: an input, param or state that
    requires grad (with grad enabled) would silently get none back through it (issue 30)."""
    if not torch.is_grad_enabled():
        return
    named = [*bound.inputs.items(), *bound.params.items(), *((f"state['{k}']", v) for k, v in buffers.items())]
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ArgumentError(f"{name}: requires grad, but op.step(..., inplace=True) updates the state in "
                                "place outside autograd, so no gradient would flow back; use inplace=False (it "
                                "returns the new state, with gradients) or call under torch.no_grad()")


def _needs_grad(bound) -> bool:
    return any(t.requires_grad for t in (*bound.inputs.values(), *bound.params.values()))


def _state_dict(m, state) -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        if len(m.states) != 1:
            raise ArgumentError(f"state: mixer '{m.name}' has several states "
                                f"({', '.join(s.name for s in m.states)}); pass a dict")
        return {m.states[0].name: state}
    if not isinstance(state, dict):
        raise ArgumentError(f"state: expected a dict keyed by state name, got {type(state).__name__}")
    names = [s.name for s in m.states]
    for k in state:
        if k not in names:
            raise ArgumentError(f"state: unknown state '{k}'; mixer '{m.name}' has {', '.join(names)}")
    for k in names:
        if k not in state:
            raise ArgumentError(f"state: missing state '{k}'")
    return dict(state)


def _check_indices(idx, B: int, device: torch.device):
    if idx is None:
        return None
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
        got = f"dtype {idx.dtype}, shape {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ArgumentError(f"state_indices: expected a 1-D int32 or int64 tensor of cache slots [B={B}], got {got}")
    if idx.shape[0] != B:
        raise ArgumentError(f"state_indices: one slot per sequence, expected shape [B={B}], got {list(idx.shape)}")
    if idx.device != device:
        raise ArgumentError(f"state_indices: on device {idx.device}, but the inputs are on {device}")
    return idx.contiguous()


def _check_buffers(m, buffers: dict, bound, idx, device) -> int:
    """Each state buffer: float32 (the kernels' state dtype: written in place as is),
    contiguous, on the inputs' device, [B or N_slots, H, *state dims]. Returns the rows."""
    rows = None
    for decl in m.states:
        x = buffers[decl.name]
        arg = f"state['{decl.name}']"
        want_tail = (bound.H,) + tuple(bound.sizes[d] for d in decl.shape)
        lead = "N_slots" if idx is not None else "B"
        label = f"[{lead}, H={bound.H}, " + ", ".join(f"{d}={bound.sizes[d]}" for d in decl.shape) + "]"
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{arg}: expected a tensor {label}, got {type(x).__name__}")
        if x.dim() != 2 + len(decl.shape) or tuple(x.shape[1:]) != want_tail:
            raise ArgumentError(f"{arg}: expected shape {label}, got {list(x.shape)}")
        if idx is None and x.shape[0] != bound.B:
            raise ArgumentError(f"{arg}: expected shape {label.replace('[B,', f'[B={bound.B},')}, got {list(x.shape)}")
        if rows is not None and x.shape[0] != rows:
            raise ArgumentError(f"{arg}: {x.shape[0]} slots, but another state has {rows}; one cache, one slot count")
        rows = x.shape[0]
        if x.dtype != torch.float32:
            raise ArgumentError(f"{arg}: inplace=True writes the state as the kernels keep it, float32; got {x.dtype}")
        if not x.is_contiguous():
            raise ArgumentError(f"{arg}: inplace=True needs a contiguous buffer (a copy would not be updated); "
                                f"got strides {list(x.stride())}")
        if x.device != device:
            raise ArgumentError(f"{arg}: on device {x.device}, but the inputs are on {device}")
    return rows


def _check_index_values(idx: torch.Tensor, rows: int) -> None:
    """Range and duplicates, read only where that costs no sync: indices in CPU memory."""
    if idx.device.type != "cpu":
        return
    values = idx.numpy()        # a view of CPU memory: no device, no sync
    bad = [int(v) for v in values if not 0 <= v < rows]
    if bad:
        raise ArgumentError(f"state_indices: slots must be in [0, {rows}) (the cache's rows), got {bad[:4]}")
    if len(set(values.tolist())) != len(values):
        raise ArgumentError("state_indices: two sequences name the same slot; each row needs its own")

"""The kernel calls' fast path (issue 17): op.step() (in place too, runtime/decode.py) and op()
of one launch, on arguments that look like an earlier call's, replay that call's launch
without binding them again. (The chunked forward's two launches, CUDA's default, are not:
the call's last launch reads the first's checkpoints, which a recipe does not carry, so such
a call is not recorded.)

What a step's launch needs is fixed by what its arguments look like: the bound sizes, the
option values, the plan, the launch config, the output and state buffers' shapes and dtypes,
the grid, the kernel's arguments (their order from derive/kernel_args.py, as the recorded
launch's) with their numbers and constexprs. step_key() reduces
the arguments to that look (per tensor its shape, dtype, device, contiguity and requires_grad;
numbers and flags by type and value; the grad mode, the mode asked and launch.settings()), and the first step with a key
records its launch (launch.recording) into a StepRecipe. A later step with the same key does a
dict lookup, the .contiguous() and state .to(float32) of the slow path, allocates the output
and the new states, and launches: no bind, no plan or module lookup, no option evaluation.

Every check bind makes depends only on the key: a new shape, dtype, device, flag or number
is a new key, which takes the slow path and its ArgumentError. A recipe is kept only for a
step whose tensors are all inputs and params (a number option passed as a tensor is read, so
not in the key) and that needs no gradient (those go through autograd on the slow path)."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..derive.kernel_args import LAUNCH_OPTIONS
from . import launch

_F32 = torch.float32
MAX_RECIPES = 64          # per op: a serving loop sees a few batch sizes; a key per shape beyond is a leak


class StepRecipe(NamedTuple):
    module: object            # the generated module: the kernel is looked up per call (tests patch it)
    kernel: str
    grid: tuple
    args: list                # the positional arguments: the recorded numbers, None where a tensor goes
    tensors: tuple            # (position, kwarg name) of each input and param
    outs: tuple               # positions taking the output buffer (the output; unused pointers' dummies)
    consts: dict              # constexprs by name, and Triton's launch options
    x0_slot: int | str | None  # where the first input (a dummy pointer) or the indices go: a position or a name
    first_input: str          # the first input's kwarg name
    inplace: bool             # the given state buffers are the new states (runtime/decode.py)
    one_token: bool           # step(): the output without its T axis
    store_final: bool         # the new states are written (and returned)
    rows: int | None          # slots of a cache whose CPU indices are checked per call (decode.py)
    states: tuple             # (name, [n, H, *dims], "given" | "zeros" | "none", init pos, final pos) per kernel state
    out_shape: tuple
    out_dtype: torch.dtype
    splits: int
    final_dtype: torch.dtype
    device: torch.device
    unstabilize: object       # (finals dict) -> the spec's states: op._unstabilize bound to the plan


def _meta(x):
    return (x.shape, x.dtype, x.device, x.requires_grad, x.is_contiguous())


def step_key(mode, kwargs: dict, state) -> tuple | None:
    """What a step's arguments look like, or None where a value cannot be keyed (take the slow
    path): type(v) is part of a number's key, so 1 and True (equal, same hash) differ."""
    key = [mode, torch.is_grad_enabled(), launch.settings()]
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            key.append((k, _meta(v)))
        elif v is None or type(v) in (bool, int, float):
            key.append((k, type(v), v))
        else:
            return None
    if isinstance(state, torch.Tensor):
        key.append(_meta(state))
    elif state is None:                     # op() without an initial state
        key.append(None)
    elif isinstance(state, dict):
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                return None
            key.append((k, _meta(v)))
    else:
        return None
    return tuple(key)


def recipe_from(log: list, m, kwargs: dict, unstabilize, state_indices=None, rows=None,
                one_token: bool = True) -> StepRecipe | None:
    """The recipe of the launch a slow step just made (the log's last entry), or None where it
    cannot be replayed from the arguments alone. state_indices: the checked indices the launch
    took (their slot is filled per call); rows: the cache's slots, to check CPU indices against."""
    if not log or log[-1] is None:
        return None
    tensor_args = {d.name for d in (*m.inputs, *m.params)}
    if any(isinstance(v, torch.Tensor) and k not in tensor_args for k, v in kwargs.items()):
        return None             # a number option given as a tensor: its value is not in the key
    r = log[-1]
    out_shape = r["out_shape"]
    if one_token and r["splits"] == 1:         # [B, H, *dims]: the same memory as [B, 1, H, *dims]
        out_shape, one_token = out_shape[:1] + out_shape[2:], False
    # the recorded launch's positional arguments (the definition's order), the tensors' places
    # left for each call: the inputs and params, the state buffers, the output (and the unused
    # pointers, which took the output as a dummy: a replayed launch has no checkpoints and no
    # cu_seqlens); a tensor anywhere else must be the first input (a dummy) or the indices
    values, args, tensors, outs, places, x0_slot = r["values"], [], [], [], {}, None
    for i, k in enumerate(r["args"].positional):
        role = k[0] if isinstance(k, tuple) else k
        v = values[k]
        args.append(None if isinstance(v, torch.Tensor) else v)
        if role in ("input", "param"):
            tensors.append((i, k[1]))
        elif role in ("init", "final"):
            places[k] = i
        elif role in ("out", "ckpt", "cu_seqlens"):
            outs.append(i)
        elif isinstance(v, torch.Tensor):
            if not (v is r["x0"] or v is state_indices) or x0_slot is not None:
                return None
            x0_slot = i
    consts = {}
    for name, k in r["args"].named:                     # constexprs; p_state_indices
        v = values[k]
        if isinstance(v, torch.Tensor):
            if not (v is r["x0"] or v is state_indices) or x0_slot is not None:
                return None
            x0_slot = name
        else:
            consts[name] = v
    consts.update({k: values[k] for k in LAUNCH_OPTIONS if k in values})
    states = tuple((name, shape, kind, places["init", name], places["final", name])
                   for name, shape, kind in r["states"])
    return StepRecipe(r["module"], r["kernel"], r["grid"], args, tuple(tensors), tuple(outs), consts, x0_slot,
                      m.inputs[0].name, r["inplace"], one_token, values["store_final"], rows, states, out_shape,
                      r["out_dtype"], r["splits"], r["final_dtype"], r["x0"].device, unstabilize)


def run_step(r: StepRecipe, kwargs: dict, state, state_indices=None):
    """The recorded launch on this step's tensors: (o [B, H, *dims], the new states; in place:
    the state as given, updated). state_indices: checked by the caller."""
    given_state = state
    if state is None:
        state = {}
    elif isinstance(state, torch.Tensor):
        state = {r.states[0][0]: state}
    device = r.device
    poison = os.environ.get("MIXC_POISON") == "1"       # as launch._empty: unwritten elements show
    out = torch.empty(r.out_shape, dtype=r.out_dtype, device=device)
    args = r.args.copy()
    for i, n in r.tensors:
        args[i] = kwargs[n].contiguous()
    finals = {}
    for name, shape, kind, i_init, i_final in r.states:
        given = state.get(name) if kind == "given" else None      # a stabilizer's m is not given: 0
        init = (given.to(_F32).contiguous() if given is not None
                else out if kind == "none" else torch.zeros(shape, dtype=_F32, device=device))
        if r.inplace:
            finals[name] = fin = init            # float32 and contiguous: checked by the key's slow path
        elif not r.store_final:
            fin = out
        else:
            finals[name] = fin = torch.empty(shape, dtype=_F32, device=device)
            if poison:
                fin.fill_(float("nan"))
        args[i_init], args[i_final] = init, fin
    if poison:
        out.fill_(float("nan"))
    for i in r.outs:
        args[i] = out
    consts = r.consts
    if r.x0_slot is not None:
        x0 = kwargs[r.first_input] if state_indices is None else state_indices
        if isinstance(r.x0_slot, str):
            consts = {**consts, r.x0_slot: x0}
        else:
            args[r.x0_slot] = x0
    getattr(r.module, r.kernel)[r.grid](*args, **consts)
    if r.splits > 1:
        out = out.sum(0).to(r.final_dtype)
    if r.one_token:
        out = out[:, 0]
    return out, (given_state if r.inplace else r.unstabilize(finals) if r.store_final else None)

"""The kernel calls' fast path (issue 17): op.step() (in place too, runtime/decode.py) and op()
without gradients, on arguments that look like an earlier call's, replay that call's launches
without binding them again: one launch (the recurrent forward, a step, the chunked forward in
one walk) or the chunked forward's two (CUDA's default: the walk kernel writes the checkpoints
and final states, the output kernel every chunk's output from its checkpoint), fixed
length or packed (cu_seqlens).

What a call's launches need is fixed by what its arguments look like: the bound sizes, the
option values, the plan, the launch config, the buffers' shapes and dtypes, the grids, each
kernel's arguments (their order from standalone/kernel_args.py, as the recorded launch's) with
their numbers and constexprs. step_key() reduces the arguments to that look (per tensor its
shape, dtype, device, contiguity and requires_grad; numbers and flags by type and value; the
grad mode, the mode asked and launch.settings()), and the first call with a key records the
launches the one launcher made (standalone/launcher.py, recording()) into a StepRecipe: per
launch its kernel, grid, numbers and where each tensor comes from (a "source": an input or
param, a given state, the packed offsets and the output kernel's chunk table made from them, or a buffer
the call allocates, by recorded shape and dtype). A buffer one launch writes and a later one reads (the walk's checkpoints, read by
the output kernel) is one source, allocated once per call. A later call with the same key does a dict
lookup, the .contiguous() and state .to(float32) of the slow path, allocates the buffers, and
launches: no bind, no plan or module lookup, no option evaluation.

Every check bind makes depends only on the key, but for the packed offsets' values, which
replay checks on every call as bind does (binding.cu_seqlens_values): a new shape, dtype,
device, flag or number is a new key, which takes the slow path and its ArgumentError. The
values are read on the host each call, never trusted from a cache keyed by the tensor: a write
through a numpy view (torch.from_numpy), .data or shared memory changes them without bumping
the tensor's _version, and offsets past T make the kernels write outside their buffers. The
kernels then read a tensor made from the checked values (not the caller's, which could change
after the check), cached by those values (_FROM_OFFSETS). The cost: N + 1 ints read per call;
on the CPU a copy of a few bytes, on CUDA a device-to-host copy that waits for the queued work
(a sync: pass cu_seqlens on the CPU to avoid it; the kernels get a device copy cached by the
values). fla reads its cu_seqlens on the host too, to build its chunk indices
(prepare_chunk_indices, .tolist()), but caches that by the tensor; a check that a changed
tensor can skip is no memory-safety check, so mixc pays the read.

A recipe is kept only for a call whose tensors are all inputs and params (a number option
passed as a tensor is read, so not in the key) and that needs no gradient (those go through
autograd on the slow path)."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..standalone.kernel_args import LAUNCH_OPTIONS
from ..standalone.launcher import chunk_seqs
from . import launch
from ..standalone.binding import cu_seqlens_values

_F32 = torch.float32
MAX_RECIPES = 64          # per op: a serving loop sees a few batch sizes; a key per shape beyond is a leak
# What replayed packed calls made from their checked offsets (the offsets on the device, the
# output kernel's chunk table), by what was made: (the offsets' values, the result). A model's layers pass
# one cu_seqlens, so each layer after the first reuses the first's; other values make it anew
# (one entry per kind of thing made: bounded).
_FROM_OFFSETS: dict = {}


class Launch(NamedTuple):
    """One recorded kernel launch of a call."""
    kernel: str               # its name in the module
    grid: tuple
    args: list                # the positional arguments: the recorded numbers, None where a tensor goes
    fills: tuple              # (position, source index) of each positional tensor
    consts: dict              # constexprs by name, and Triton's launch options
    named_fills: tuple        # (name, source index) of each tensor passed by name (p_state_indices)


class StepRecipe(NamedTuple):
    module: object            # the generated module: the kernel is looked up per call (tests patch it)
    launches: tuple           # Launch, in the call's order
    sources: tuple            # per source, how a call makes its tensor (run_step)
    out: int                  # the output's source (the last launch's)
    finals: tuple             # (state name, source) of the final states written (none: not asked)
    first_input: str          # the first input's kwarg name (the dummy pointer)
    first_state: str          # the state a bare tensor given as the state is
    inplace: bool             # the given state buffers are the new states (runtime/decode.py)
    one_token: bool           # step(): the output without its T axis
    rows: int | None          # slots of a cache whose CPU indices are checked per call (decode.py)
    packed: tuple | None      # (B, T) of a packed call: its cu_seqlens values are checked per call
    splits: int
    final_dtype: torch.dtype
    device: torch.device
    unstabilize: object       # (finals dict) -> the spec's states: op._unstabilize bound to the plan


def _meta(x):
    return (x.shape, x.dtype, x.device, x.requires_grad, x.is_contiguous())


def step_key(mode, kwargs: dict, state, launches: bool = True) -> tuple | None:
    """What a step's arguments look like, or None where a value cannot be keyed (take the slow
    path): type(v) is part of a number's key, so 1 and True (equal, same hash) differ.
    launches=False: without the launch settings (the torch backend launches no kernel)."""
    key = [mode, torch.is_grad_enabled(), launch.settings() if launches else None]
    append, strided, tensor = key.append, torch.strided, torch.Tensor     # (a decode token pays this per input)
    for k, v in kwargs.items():
        if isinstance(v, tensor):
            if v.layout is not strided or v.is_nested:    # no shape to key: the binder names it
                return None
            append((k, v.shape, v.dtype, v.device, v.requires_grad, v.is_contiguous()))
        elif v is None or type(v) in (bool, int, float):
            append((k, type(v), v))
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


def _call_launches(log: list) -> list | None:
    """The launches of the call a log ends with (tuning runs come first): its last, and the walk
    (after the intra kernel of staged intra-chunk matrices) before an output kernel. The
    launcher logs backward launches too: the forward's are read."""
    log = [r for r in log if r["form"] in ("recurrent_fwd", "chunk_fwd")]
    if not log or log[-1] is None:
        return None
    if log[-1]["values"].get("stage") != "output":
        return log[-1:]
    if log[-1]["values"].get("segments", 1) > 1:
        return None         # the segmented walk folds its segments' summaries between its launches (torch, not recorded)
    before = ["intra", "walk"] if log[-1]["values"].get("staged_intra") else ["walk"]  # Launcher.chunk_forward's order
    n = len(before) + 1
    if len(log) < n or any(r is None for r in log[-n:]) or [r["values"].get("stage") for r in log[-n:-1]] != before:
        return None
    return log[-n:]


def recipe_from(log: list, m, kwargs: dict, unstabilize, state_indices=None, rows=None,
                one_token: bool = True) -> StepRecipe | None:
    """The recipe of the launches a slow call just made (the log's last call), or None where
    they cannot be replayed from the arguments alone. state_indices: the checked indices the
    launch took (their slot is filled per call); rows: the cache's slots, to check CPU indices
    against."""
    launches = _call_launches(log)
    if launches is None:
        return None
    tensor_args = {d.name for d in (*m.inputs, *m.params)}
    if any(isinstance(v, torch.Tensor) and k not in tensor_args for k, v in kwargs.items()):
        return None             # a number option given as a tensor: its value is not in the key
    first, last = launches[0], launches[-1]
    x0 = first["x0"]
    # each tensor a launch took, by identity: the first time it is seen decides its source, so
    # a buffer passed again (the walk's checkpoints in the output kernel, the output as an unused pointer's
    # dummy) is the same source; a tensor of no known role is not replayed
    sources, seen = [], {}
    fixed = {c.name for c in getattr(m, "consts", ())}     # const W[E] = [...]: no argument; kept here

    def source(t, what, unique=False) -> int:
        if id(t) not in seen:
            if not unique and what in sources:
                seen[id(t)] = sources.index(what)
            else:
                seen[id(t)] = len(sources)
                sources.append(what)
        return seen[id(t)]

    source(x0, ("x0",))
    if state_indices is not None:
        source(state_indices, ("indices",))
    recorded, finals, out = [], [], None
    for r in launches:
        values, kinds = r["values"], {name: kind for name, shape, kind in r["states"]}
        packed, reads_ckpts = values.get("varlen", False), values.get("stage") == "output"

        def classify(k, t):
            role, of = (k[0], k[1]) if isinstance(k, tuple) else (k, None)
            if id(t) in seen:
                return seen[id(t)]
            if role == "param" and of in fixed:       # the const's tensor the launch read (its values)
                return source(t, ("fixed", of, t), unique=True)
            if role in ("input", "param"):
                return source(t, ("kw", of))
            if role == "init" and values["use_initial"] and kinds.get(of) == "given":
                return source(t, ("state", of, tuple(t.shape)))
            if role == "cu_seqlens" and packed:
                return source(t, ("cu",))
            if role == "chunk_seq" and packed:
                # slots of CKPT_EVERY chunks each (Launcher.chunk_launch)
                return source(t, ("chunk_seq", values["chunk"] * values.get("ckpt_every", 1), values["n_seqs"],
                                  t.shape[0]))
            if role == "ckpt" and reads_ckpts:
                return None                         # the output kernel reads checkpoints this call did not write
            if role in ("out", "final", "ckpt", "dense", "intra", "init", "cu_seqlens"):
                zeros = role == "init" and values["use_initial"]       # a state not given: 0
                return source(t, ("buf", tuple(t.shape), t.dtype, zeros), unique=True)
            return None
        args, fills = [], []
        for i, k in enumerate(r["args"].positional):
            t = values[k]
            if isinstance(t, torch.Tensor):
                j = classify(k, t)
                if j is None:
                    return None
                fills.append((i, j))
                if k == "out":
                    out = j
                elif k[0] == "final" and values["store_final"]:
                    finals.append((k[1], j))
                t = None
            args.append(t)
        consts, named_fills = {}, []
        for name, k in r["args"].named:                     # constexprs; p_state_indices
            t = values[k]
            if isinstance(t, torch.Tensor):
                j = classify(k, t)
                if j is None:
                    return None
                named_fills.append((name, j))
            else:
                consts[name] = t
        consts.update({k: values[k] for k in LAUNCH_OPTIONS if k in values})
        recorded.append(Launch(r["kernel"], r["grid"], args, tuple(fills), consts, tuple(named_fills)))
    if one_token and last["splits"] == 1:       # [B, H, *dims]: the same memory as [B, 1, H, *dims]
        kind, shape, dtype, zeros = sources[out]
        sources[out], one_token = (kind, shape[:1] + shape[2:], dtype, zeros), False
    packed = (x0.shape[0], x0.shape[1]) if last["values"].get("varlen") else None
    return StepRecipe(last["module"], tuple(recorded), tuple(sources), out, tuple(finals), m.inputs[0].name,
                      m.states[0].name, last["inplace"], one_token, rows, packed, last["splits"],
                      last["final_dtype"], x0.device, unstabilize)


def run_step(r: StepRecipe, kwargs: dict, state, state_indices=None, cu_seqlens=None):
    """The recorded launches on this call's tensors: (o [B, T, H, *dims] or a step's [B, H, *dims],
    the new states or None; in place: the state as given, updated). state_indices: checked by
    the caller; cu_seqlens: its values are checked here (bind's check: the key has its look)."""
    given_state = state
    if state is None:
        state = {}
    elif isinstance(state, torch.Tensor):
        state = {r.first_state: state}
    device = r.device
    offsets = None
    if r.packed is not None:            # every call: the values, not the tensor's _version (docstring)
        values = tuple(cu_seqlens_values(cu_seqlens, *r.packed, (device, r.first_input)))
        offsets = _from_offsets(("cu", cu_seqlens.dtype, device), values,
                                lambda: torch.tensor(values, dtype=cu_seqlens.dtype, device=device))
    poison = os.environ.get("MIXC_POISON") == "1"       # as launcher.empty: unwritten elements show
    made = []
    for s in r.sources:
        kind = s[0]
        if kind == "kw":
            t = kwargs[s[1]].contiguous()
        elif kind == "buf":
            if s[3]:
                t = torch.zeros(s[1], dtype=s[2], device=device)
            else:
                t = torch.empty(s[1], dtype=s[2], device=device)
                if poison:
                    t.fill_(float("nan"))
        elif kind == "state":               # float32 and contiguous in place: checked by the key's slow path
            given = state.get(s[1])         # a stabilizer's m is not given: 0
            t = given.to(_F32).contiguous() if given is not None else torch.zeros(s[2], dtype=_F32, device=device)
        elif kind == "x0":
            t = kwargs[r.first_input]
        elif kind == "fixed":               # a const: the spec's values, as the recorded launch read them
            t = s[2]
        elif kind == "indices":
            t = state_indices
        elif kind == "cu":
            t = offsets
        else:                               # "chunk_seq": the output kernel's table of each slot's sequence
            t = _from_offsets((s, device), values, lambda: chunk_seqs(offsets, *s[1:], device))
        made.append(t)
    for ln in r.launches:
        args = ln.args.copy()
        for i, j in ln.fills:
            args[i] = made[j]
        consts = ln.consts
        if ln.named_fills:
            consts = {**consts, **{name: made[j] for name, j in ln.named_fills}}
        getattr(r.module, ln.kernel)[ln.grid](*args, **consts)
    out = made[r.out]
    if r.splits > 1:
        out = out.sum(0).to(r.final_dtype)
    if r.one_token:
        out = out[:, 0]
    if r.inplace:
        return out, given_state
    return out, (r.unstabilize({name: made[j] for name, j in r.finals}) if r.finals else None)


def _from_offsets(what: tuple, values: tuple, make):
    """make()'s result for these checked offsets' values: made again only for other values."""
    hit = _FROM_OFFSETS.get(what)
    if hit is not None and hit[0] == values:
        return hit[1]
    t = make()
    _FROM_OFFSETS[what] = (values, t)
    return t

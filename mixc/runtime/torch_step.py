"""The torch backend one token at a time: op.step(mode="torch") (decode, functional or in
place) and the token loop of a prefill, over the generated module's torch_step, torch_step_
and torch_tokens (codegen/torch_step.py), driven by standalone/torch_tokens.py (the same
driver a compiled module uses).

Which prefill form mode "torch" takes (use_token_loop, measured: bench/README.md): the chunked
form (runtime/torch_chunk.py) does its work in matmuls over chunks of C = 64 tokens, which pays
where a state is a matrix (a token's update an outer product, a chunk's a matmul: GLA, the
delta rules, mLSTM). The token loop wins where the chunked form has no matmul to batch: the
elementwise and value-diagonal classes (Mamba, HGRN: 300x and 70x at T = 1024), whose chunked
form walks [C, C] pairs per element, and states that are vectors shorter than a chunk (RWKV-4
as transformers runs it: one head per channel, V = 1), where the chunk's [C, C] pair matrices
per head cost more than the state itself.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import classes
from ..derive.plan import Plan
from ..standalone import torch_tokens as _driver
from .cache import load_module
from .inputs import range_guard
from .signature import Bound, option_values

# a vector state shorter than this (the torch chunk's C) takes the token loop
LOOP_BELOW = 64


def use_token_loop(plan: Plan, bound: Bound) -> bool:
    """Whether mode "torch"'s prefill takes the token loop (the module docstring says why)."""
    if not plan.layout.torch_chunked:
        return True
    for st in plan.states:
        if classes.unit(st.transition).token_loop_prefill:
            return True
    return all(not s.key_dims and math.prod(bound.sizes[d] for d in s.value_dims) < LOOP_BELOW for s in plan.states)


def _args(plan: Plan, bound: Bound, dtype: torch.dtype):
    x = {n: t.to(dtype) for n, t in bound.inputs.items()}
    p = {n: t.to(dtype) for n, t in bound.params.items()}
    return x, p, option_values(plan.ir, bound), dict(bound.sizes)


def torch_step(plan: Plan, bound: Bound, dtype: torch.dtype):
    """op.step(mode="torch"): (o [B, H, *out dims] in the first input's dtype, the new state
    dict in dtype). bound: a step's (inputs [B, H, *dims], the given state)."""
    b = bound.expanded(axis=1)
    x, p, opt, sizes = _args(plan, b, dtype)
    o, st = _driver.step(load_module(plan), x, p, opt, sizes, b.B, b.H, b.initial_state, dtype)
    return o.to(next(iter(bound.inputs.values())).dtype), {k: v.to(dtype) for k, v in st.items()}


def torch_step_inplace(plan: Plan, bound: Bound, buffers: dict):
    """op.step(mode="torch", inplace=True) on float32 buffers [B, H, *dims]: o in the first
    input's dtype. The generated torch_step_ writes the buffers (no new state tensor)."""
    b = bound.expanded(axis=1)
    x, p, opt, sizes = _args(plan, b, torch.float32)
    o = _driver.step_inplace(load_module(plan), x, p, opt, sizes, b.B, b.H, buffers)
    return o.to(next(iter(bound.inputs.values())).dtype)


def torch_tokens(plan: Plan, bound: Bound, *, output_final_state: bool, dtype: torch.dtype):
    """The prefill as a loop over the tokens: (o [B, T, H, *out dims] in dtype, final states
    {name: [N, H, *dims]} or None). bound: expanded (grouped inputs repeated per head)."""
    x, p, opt, sizes = _args(plan, bound, dtype)
    init = dict(bound.initial_state) if bound.initial_state is not None else None
    return _driver.tokens(load_module(plan), x, p, opt, sizes, bound.B, bound.T, bound.H, initial_state=init,
                          cu_seqlens=bound.cu_seqlens, output_final_state=output_final_state)


# op.step(mode="torch", inplace=True)'s fast-path key tag (fastpath.step_key without launch settings)
TORCH_INPLACE = ("inplace", "torch", "no launches")


class TorchStep(NamedTuple):
    """A torch-backend step kept for replay: what binding an earlier call with the same look
    (runtime/fastpath.py's step_key: shapes, dtypes, devices, numbers, grad mode) gave, so a
    decode loop pays no bind, plan lookup or option evaluation per token."""
    mod: object               # the generated module
    inputs: tuple             # the inputs' and params' kwarg names
    params: tuple
    opt: dict                 # the option values
    sizes: dict
    B: int
    H: int
    dtype: torch.dtype        # the compute dtype
    out_dtype: torch.dtype    # the first input's
    first_state: str          # the state a bare tensor given as the state is
    inplace: bool
    direct: bool              # every input and param is in the compute dtype: the kwargs are passed as they are
    guard: object = None      # the declared ranges of the inputs, checked on every replay
                              # (inputs.range_guard), or None
    replay: object = None     # the in-place, direct case as one closure (_inplace_replay), or None
    consts: dict | None = None  # const W[E] = [...]: their tensors as the bound call had them (no kwargs)


def step_recipe(plan: Plan, bound: Bound, inplace: bool, kwargs: dict) -> TorchStep | None:
    """The replayable step of a bound call, or None where it cannot replay: grouped heads (the
    slow path repeats them), a number option passed as a tensor (its value is read, and the
    key holds only its look)."""
    if bound.groups or any(isinstance(kwargs.get(o.name), torch.Tensor) for o in plan.ir.options):
        return None
    x0 = next(iter(bound.inputs.values()))
    dtype = torch.float32 if inplace else _compute_dtype(bound)
    # the key holds every tensor's dtype: what needs no conversion now needs none on replay
    direct = all(t.dtype == dtype for t in (*bound.inputs.values(), *bound.params.values()))
    consts = {c.name: bound.params[c.name] for c in plan.ir.consts} or None
    r = TorchStep(load_module(plan), tuple(bound.inputs), tuple(bound.params), option_values(plan.ir, bound),
                  dict(bound.sizes), bound.B, bound.H, dtype, x0.dtype, plan.ir.states[0].name, inplace, direct,
                  range_guard(plan.ir, bound.inputs), consts=consts)
    replayable = inplace and direct and r.mod.torch_step_ is not None and consts is None
    return r._replace(replay=_inplace_replay(r)) if replayable else r


def _inplace_replay(r: TorchStep):
    """run_recipe's in-place, direct branch with every choice made: a decode loop's token pays
    its update and its range check, not the recipe's branches (a step is ~65 us at B = 1, and
    issue 33 allows 1.25x a hand-written update: each us counts)."""
    step, guard, opt, sizes, B, H, first, out = r.mod.torch_step_, r.guard, r.opt, r.sizes, r.B, r.H, r.first_state, r.out_dtype

    def replay(kwargs: dict, state):
        if guard is not None:
            guard(kwargs)
        o = step(kwargs, kwargs, opt, sizes, B, H, {first: state} if isinstance(state, torch.Tensor) else state)
        return (o if o.dtype is out else o.to(out)), state
    return replay


def run_recipe(r: TorchStep, kwargs: dict, state):
    """op.step on the replayed recipe: (o, the new states; in place: the state as given)."""
    if r.replay is not None:
        return r.replay(kwargs, state)
    dtype = r.dtype         # (a decode step is ~60 us of work at B = 1: each skipped call counts)
    if r.guard is not None:     # the declared ranges hold on every token, replayed or not: the
        # inputs (this token's values) are checked on every call, the params when the recipe was
        # bound (the key holds their look; a param changed in place between decode steps is not
        # seen again, a per-token check of each costs ~1-2 us against a ~60 us step)
        r.guard(kwargs)
    if r.direct:            # the generated functions read inputs and params by name
        x = p = kwargs if r.consts is None else {**kwargs, **r.consts}
    else:
        given = kwargs if r.consts is None else {**kwargs, **r.consts}
        x = {n: kwargs[n].to(dtype) for n in r.inputs}
        p = {n: given[n].to(dtype) for n in r.params}
    st = {r.first_state: state} if isinstance(state, torch.Tensor) else state
    if r.inplace:
        if r.mod.torch_step_ is not None:       # (the driver's own test, without its call)
            o = r.mod.torch_step_(x, p, r.opt, r.sizes, r.B, r.H, st)
        else:
            o = _driver.step_inplace(r.mod, x, p, r.opt, r.sizes, r.B, r.H, st)
        return (o if o.dtype is r.out_dtype else o.to(r.out_dtype)), state
    o, new = _driver.step(r.mod, x, p, r.opt, r.sizes, r.B, r.H, st, dtype)
    return (o if o.dtype is r.out_dtype else o.to(r.out_dtype)), new


def _compute_dtype(bound: Bound) -> torch.dtype:
    """As runtime/op.py's: float64 where an input or param is, else float32."""
    dtypes = {x.dtype for x in (*bound.inputs.values(), *bound.params.values())}
    return torch.float64 if torch.float64 in dtypes else torch.float32

"""The torch backend's recurrence, one token at a time: the driver of a generated module's
torch_step, torch_step_ and torch_tokens (codegen/torch_step.py prints them from the spec;
templates/torch_step.py.j2). mixc's op takes them in mode "torch" for op.step (decode) and for
the prefill of the specs whose chunked torch form is slow (runtime/op.py); a compiled module
takes them for CPU tensors without Triton's interpreter (support.py).

Everything here is plain torch over already-bound arguments: inputs {name: [B, (T,) H, *dims]}
in the compute dtype, params {name: [H, *dims]}, options {name: float}, states {name: [B, H,
*dims]}. With a stabilizer (an exponential input gate: derive/stabilize.py) the generated
functions keep S~ = S exp(-m) and the scale m per (sequence, head): a given state enters as
S~ = S with m = 0, no state as zeros with the module's STEP_M_EMPTY, and the state returned is
the spec's S = S~ exp(m) (inf where S itself exceeds the dtype, as the kernels return it),
while the outputs are formed from S~ and stay finite where the chunked form's do."""
from __future__ import annotations

import types

import torch

from .binding import expand_heads
from .buffers import empty


def _enter(mod, states: dict, B: int, H: int, dtype, device, given: bool) -> dict:
    """The states as the generated functions take them: with a stabilizer, m too."""
    if "_m" in mod.STEP_STATES:
        fill = 0.0 if given else mod.STEP_M_EMPTY
        states = dict(states, _m=torch.full((B, H), fill, dtype=dtype, device=device))
    return states


def _leave(mod, states: dict) -> dict:
    """The spec's states from the generated functions' (S = S~ exp(m) for the stabilized)."""
    if "_m" not in states:
        return states
    states = dict(states)
    m = states.pop("_m")
    for name in mod.STEP_STABILIZED:
        x = states[name]
        states[name] = x * torch.exp(m).reshape(m.shape + (1,) * (x.dim() - 2))
    return states


def step(mod, x: dict, p: dict, opt: dict, sizes: dict, B: int, H: int, states: dict, dtype):
    """One token, functional (autograd flows through it): (o [B, H, *out dims], new states in dtype)."""
    s = {k: v if v.dtype is dtype else v.to(dtype) for k, v in states.items()}
    if "_m" in mod.STEP_STATES:
        s = _enter(mod, s, B, H, dtype, next(iter(x.values())).device, True)
    o, new = mod.torch_step(x, p, opt, sizes, B, H, s)
    return o, _leave(mod, new)


def step_inplace(mod, x: dict, p: dict, opt: dict, sizes: dict, B: int, H: int, buffers: dict):
    """One token with the state buffers (the compute dtype, contiguous) updated in place:
    the generated torch_step_ where the module has one, else torch_step and a copy. Returns o."""
    if mod.torch_step_ is not None:
        return mod.torch_step_(x, p, opt, sizes, B, H, buffers)
    dtype = next(iter(x.values())).dtype
    o, new = step(mod, x, p, opt, sizes, B, H, buffers, dtype)
    with torch.no_grad():
        for k, v in buffers.items():
            v.copy_(new[k])
    return o


# The prefill's tokens per call of the generated torch_tokens: what it computes before its loop
# (the state-free values) is [B, TOKEN_BLOCK, H, ...] per block, not [B, T, H, ...]: fresh memory
# the size of the inputs, out of cache when the loop reads it back, cost more than a block's few
# extra calls (RWKV-4, C = 768, T = 1024, 1 thread: at B = 8 a block of 32-64 tokens 0.93x the
# whole sequence at once, 8 tokens 0.97x; at B = 1 0.96-0.98x; bench/decode_cpu)
TOKEN_BLOCK = 64


def tokens(mod, x: dict, p: dict, opt: dict, sizes: dict, B: int, T: int, H: int, *, initial_state=None,
           cu_seqlens=None, output_final_state: bool = False):
    """T tokens in order (each packed sequence of cu_seqlens on its own, in blocks of
    TOKEN_BLOCK tokens): (o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None),
    in the inputs' dtype. Without autograd the outputs are written into one buffer."""
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    if cu_seqlens is None:
        segments, rows = [(0, T)], B
    else:
        bounds = cu_seqlens.tolist()
        segments, rows = list(zip(bounds[:-1], bounds[1:])), 1
    graph = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*x.values(), *p.values(), *(initial_state or {}).values()))
    out = None
    if not graph:
        out_dims = tuple(sizes[d] for d in mod.METADATA["output"]["shape"])
        out = empty((B, T, H) + out_dims, dtype, device)      # (NaN under MIXC_POISON: a row not written shows)
    outs, finals = [], []
    for i, (start, end) in enumerate(segments):
        given = initial_state is not None
        if given:
            s = {k: (v if cu_seqlens is None else v[i:i + 1]).to(dtype) for k, v in initial_state.items()}
        else:
            s = {name: torch.zeros((rows, H) + tuple(sizes[d] for d in dims), dtype=dtype, device=device)
                 for name, dims in mod.METADATA["states"].items()}
        s = _enter(mod, s, rows, H, dtype, device, given)
        for b0 in range(start, end, TOKEN_BLOCK) if end > start else [start]:   # (no token: one empty call)
            b1 = min(b0 + TOKEN_BLOCK, end)
            xs = x if (b0, b1) == (0, T) else {k: v[:, b0:b1] for k, v in x.items()}
            o, s = mod.torch_tokens(xs, p, opt, sizes, rows, b1 - b0, H, s,
                                    None if out is None else out[:, b0:b1])
            outs.append(o)
        finals.append(_leave(mod, s))
    if out is not None:
        o = out
    else:
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if not output_final_state:
        return o, None
    return o, {k: torch.cat([f[k] for f in finals], 0) for k in finals[0]}


# ---- a compiled module's calls on CPU tensors without Triton's interpreter (support.py) ----

def _module(ns: dict):
    """The generated torch forms of a compiled module's namespace, as attributes."""
    return types.SimpleNamespace(**{k: ns[k] for k in ("METADATA", "STEP_STATES", "STEP_STABILIZED", "STEP_M_EMPTY",
                                                       "torch_step", "torch_step_", "torch_tokens")})


def _compute(b, axis: int):
    """(inputs with grouped heads repeated, params, compute dtype): float32 at least, float64
    where an input or param is (as mixc.load's op, runtime/op.py)."""
    dtypes = {x.dtype for x in (*b.inputs.values(), *b.params.values())}
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    x = {k: expand_heads(v, b.groups[k], axis).to(dtype) if k in b.groups else v.to(dtype)
         for k, v in b.inputs.items()}
    return x, {k: v.to(dtype) for k, v in b.params.items()}, dtype


def compiled_call(ns: dict, b, output_final_state: bool):
    """A compiled module's op(...) by its token loop: (o in the first input's dtype, final states or None)."""
    x, p, dtype = _compute(b, 2)
    o, st = tokens(_module(ns), x, p, b.options, b.sizes, b.B, b.T, b.H, initial_state=b.initial_state,
                   cu_seqlens=b.cu_seqlens, output_final_state=output_final_state)
    return o.to(next(iter(b.inputs.values())).dtype), st


def compiled_step(ns: dict, b):
    """A compiled module's step(...) by its torch_step: (o in the first input's dtype, new states)."""
    x, p, dtype = _compute(b, 1)
    o, st = step(_module(ns), x, p, b.options, b.sizes, b.B, b.H, b.initial_state, dtype)
    return o.to(next(iter(b.inputs.values())).dtype), st

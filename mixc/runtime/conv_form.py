"""mode="conv": the convolution form of a time-invariant recurrence (derive/convform.py).

The spec's pieces (keys, values, log decays, readout queries and scales, the combine) come
from the generated module's torch code, as for the torch backend (runtime/torch_chunk.py).
With the FFT form each readout is a causal convolution of the value with a kernel built from
the params; otherwise the parallel form is the chunked algorithm with one chunk as long as
the sequence, (Q K^T * D) V. Gradients are torch autograd's."""
from __future__ import annotations

import torch

from ..derive.convform import conv_form
from ..derive.decay_sign import negative_decay
from ..derive.plan import Plan
from . import seqops
from .cache import load_module
from .signature import ArgumentError, Bound, option_values
from .torch_chunk import torch_chunked


def conv_forward(plan: Plan, bound: Bound, *, output_final_state: bool, dtype: torch.dtype):
    """(o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None)."""
    cf = conv_form(plan)
    # why there is no form is worked out (sympy) only on the way to the error, never per call
    negative = negative_decay(plan) if cf is None else None
    if cf is None and negative is not None and all(st.time_invariant for st in plan.states):
        raise ArgumentError(f"mode='conv': mixer '{plan.name}' has no convolution form here: {negative}; use "
                            "mode='recurrent' or 'torch'")
    if cf is None:
        slow = [s.name for s in plan.states if not s.time_invariant]
        raise ArgumentError(f"mode='conv': mixer '{plan.name}' has no convolution form: the transition of "
                            f"{', '.join(slow) or 'its states'} depends on the token (a convolution needs a "
                            "time-invariant transition); use mode='chunk', 'recurrent' or 'torch'")
    if not cf.fft or bound.T == 0:        # the parallel form: the chunked algorithm with a single chunk
        return torch_chunked(plan, bound, output_final_state=output_final_state, dtype=dtype, C=max(bound.T, 1))
    mod = load_module(plan)
    x = {n: t.to(dtype) for n, t in bound.inputs.items()}
    p = {n: t.to(dtype) for n, t in bound.params.items()}
    x0 = next(iter(x.values()))
    opt = {k: torch.tensor(v, dtype=dtype, device=x0.device) for k, v in option_values(plan.ir, bound).items()}
    B, T, H, sizes = bound.B, bound.T, bound.H, dict(bound.sizes)
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    states, readouts = mod.TORCH_STATES, mod.TORCH_READOUTS
    segments = [(0, T)] if bound.cu_seqlens is None else list(zip(bound.cu_seqlens.tolist()[:-1],
                                                                   bound.cu_seqlens.tolist()[1:]))
    rows = slice(None) if bound.cu_seqlens is None else slice(0, 1)
    vals = {r: [] for r in readouts}
    finals = {s: [] for s in states}
    for i, (start, end) in enumerate(segments):
        s0 = {}
        for name, st in states.items():
            if bound.initial_state is None:
                s0[name] = None
                continue
            s = bound.initial_state[name].to(dtype)
            s = s if bound.cu_seqlens is None else s[i:i + 1]
            kf, vf = pc["K"][name].shape[-1], pc["V"][name].shape[-1]
            s0[name] = s.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]]).reshape(
                s.shape[0], H, kf, vf)
        for r, rd in readouts.items():
            name = rd["state"]
            total = 0
            for Q, sc in pc["Q"][r]:
                val = _readout(states[name]["decay"], Q[0, 0], pc["K"][name][0, 0], pc["V"][name][rows, start:end],
                               pc["g"][name], s0[name], rd["prev"])
                total = total + (val * sc[rows, start:end] if sc is not None else val)
            vals[r].append(total)
        if output_final_state:
            for name, st in states.items():
                S = _final(states[name]["decay"], pc["K"][name][0, 0], pc["V"][name][rows, start:end],
                           pc["g"][name], s0[name])
                S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
                finals[name].append(S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]]))
    r = {}
    for name, rd in readouts.items():
        val = torch.cat(vals[name], 1)
        vd = states[rd["state"]]["vd"]
        r[name] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, None)
    final = {k: torch.cat(v, 0) for k, v in finals.items()} if output_final_state else None
    return o, final


def _log_decay(decay: str | None, g, kf: int, vf: int) -> torch.Tensor:
    """log a as [H, KF, VF] (broadcast), None for a prefix sum; g is time-invariant, read at
    token 0. decay: what it runs over (TORCH_STATES' "decay", the class unit's decay_axis)."""
    if decay is None or g is None:
        return None
    g = g[0, 0]
    return {"scalar": lambda: g[:, None, None], "key": lambda: g[:, :, None], "value": lambda: g[:, None, :]}[decay]()


def _readout(decay, Q, K, V, g, S0, prev):
    """The readout q . S_t (S_{t-1} with prev) for the tokens of V [B, T, H, VF]; Q, K [H, KF]."""
    Tn = V.shape[1]
    # causality under non-finite input: the FFT mixes every value into every output, so values
    # that are not finite are zeroed before it and the outputs from theirs on are NaN (poison)
    bad = ~torch.isfinite(V)
    V = V.masked_fill(bad, 0.0)
    poison = (torch.cumsum(bad.to(torch.int32), 1) - (bad.to(torch.int32) if prev else 0)) > 0
    return _readout_finite(decay, Q, K, V, g, S0, prev, Tn).masked_fill(poison, float("nan"))


def _readout_finite(decay, Q, K, V, g, S0, prev, Tn):
    lg = _log_decay(decay, g, K.shape[-1], V.shape[-1])
    QK = Q * K                                                             # [H, KF]
    if lg is None:                # a prefix sum: the kernel is constant, a cumulative sum
        y = QK.sum(-1)[None, None, :, None] * torch.cumsum(V, 1)
        if prev:
            y = y - QK.sum(-1)[None, None, :, None] * V
        if S0 is not None:
            y = y + torch.einsum("hk,bhkv->bhv", Q, S0).unsqueeze(1)
        return y
    lags = torch.arange(Tn, dtype=V.dtype, device=V.device)
    shift = 1 if prev else 0
    # K_j = sum_k q_k a_k^j key_k: [T, H, VF or 1]; prev() reads S_{t-1}: K shifted by one lag
    powers = torch.exp(lags[:, None, None, None] * lg)                            # [T, H, KF|1, VF|1]
    kern = torch.einsum("hk,thkv->thv", QK, powers.expand(-1, -1, QK.shape[-1], -1))
    if prev:
        kern = torch.cat([torch.zeros_like(kern[:1]), kern[:Tn - 1]], 0)
    y = seqops.causal_conv(kern.unsqueeze(0), V)
    if S0 is not None:            # q . (a^(t+1-shift) * S0)
        dec = torch.exp((lags + 1 - shift)[:, None, None, None] * lg)                  # [T, H, KF, VF|1]
        y = y + torch.einsum("hk,thkv,bhkv->bthv", Q, dec.expand(-1, -1, Q.shape[-1], -1), S0)
    return y


def _final(decay, K, V, g, S0):
    """S_{T-1} = a^T * S0 + sum_s a^(T-1-s) key (x) value_s as [B, H, KF, VF]."""
    Tn = V.shape[1]
    lg = _log_decay(decay, g, K.shape[-1], V.shape[-1])
    if lg is None:
        S = torch.einsum("hk,bshv->bhkv", K, V)
        return S if S0 is None else S + S0
    w = torch.exp((Tn - 1 - torch.arange(Tn, dtype=V.dtype, device=V.device))[:, None, None, None] * lg)
    S = torch.einsum("hk,shkv,bshv->bhkv", K, w.expand(-1, -1, K.shape[-1], -1), V)
    if S0 is not None:
        S = S + torch.exp(Tn * lg) * S0
    return S

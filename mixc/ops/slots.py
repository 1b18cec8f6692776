"""fla 0.6's Gated Slot Attention (fla.ops.gsa) on the library spec gsa: two slot memories
Kt [K, M] and Vt [M, V] with a forget gate per slot, o = softmax(scale q^T Kt) Vt.

fla's g=None is ABC (Peng et al. 2021): the write weights are s normalized by their running
logsumexp over the sequence and the gate is the ratio of consecutive normalizers,

    z_t = log sum_{r <= t} exp(s_r),   s~_t = exp(s_t - z_t),   g_t = z_{t-1} - z_t (0 at t = 0),

restarted at each sequence (fla's fused_additive_gate, before its GSA kernels); mixc computes
the same in torch (autograd differentiates it) and passes s~ and g to the spec. fla's states
are a pair (hk [N, H, K, M], hv [N, H, M, V]), the spec's {Kt, Vt}; with grouped query heads
(q's HQ a multiple of k's H) fla repeats each key head's initial state over its group and
returns the group's first, and so does this."""
from __future__ import annotations

import torch

from ..standalone.binding import cu_seqlens_values
from ..standalone.errors import ArgumentError
from .fla_call import HEAD_FIRST, Call, FlaOp, fla_function, scale_of

_NOTES = {
    "s": "[B, T, H, M] slot write weights (with g None: raw scores, normalized as fla's ABC gate)",
    "g": "[B, T, H, M] log forget gate per slot, <= 0; None: ABC's, from the running logsumexp of s",
    "initial_state": "(hk [N, H, K, M], hv [N, H, M, V]) float32, fla's pair; the spec's {Kt, Vt}",
    "output_final_state": "also return (hk, hv) after the last token (else (None, None), as fla)",
    "checkpoint_level": "a memory/speed choice of fla's backward: accepted, no effect on the results",
}


def additive_gate(s: torch.Tensor, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """(s~, g) of fla's ABC gate from raw scores s [B, T, H, M], float32, per sequence."""
    x = s.float()
    if cu_seqlens is None:
        spans = [(0, x.shape[1])]
    else:
        offsets = cu_seqlens_values(cu_seqlens, x.shape[0], x.shape[1], (x.device, "the inputs"))
        spans = list(zip(offsets, offsets[1:]))
    ks, gs = [], []
    for a, b in spans:
        z = torch.logcumsumexp(x[:, a:b], dim=1)
        ks.append(torch.exp(x[:, a:b] - z))
        gs.append(torch.cat([torch.zeros_like(z[:, :1]), z[:, :-1] - z[:, 1:]], 1))
    return torch.cat(ks, 1).to(s.dtype), torch.cat(gs, 1)


def _groups(a: Call) -> int:
    HQ, H = a.q.shape[2], a.k.shape[2]
    if HQ % H:
        raise ArgumentError(f"q: {a.fn} takes q's heads ({HQ}) as a multiple of k's ({H}), as fla")
    return HQ // H


def _gsa(a: Call) -> dict:
    s, g = (a.s, a.g) if a.g is not None else additive_gate(a.s, a.get("cu_seqlens"))
    return dict(q=a.q, k=a.k, v=a.v, s=s, g=g, **scale_of(a))


def _state_in(a: Call):
    h0 = a.get("initial_state")
    if h0 is None:
        return None
    if not (isinstance(h0, (tuple, list)) and len(h0) == 2 and all(isinstance(x, torch.Tensor) for x in h0)):
        raise ArgumentError(f"initial_state: {a.fn} takes fla's pair (hk [N, H, K, M], hv [N, H, M, V]), "
                            f"got {type(h0).__name__}")
    G = _groups(a)
    return {"Kt": h0[0].repeat_interleave(G, dim=1), "Vt": h0[1].repeat_interleave(G, dim=1)}


def _state_out(a: Call, st: dict):
    if not a.output_final_state:
        return [None, None]
    G = _groups(a)
    return [st["Kt"][:, ::G].contiguous(), st["Vt"][:, ::G].contiguous()]


_STATE = "initial_state=None, output_final_state=False"
chunk_gsa = fla_function(FlaOp(
    "chunk_gsa", "fla.ops.gsa", "gsa", "chunk",
    f"q, k, v, s, g=None, scale=None, {_STATE}, checkpoint_level=2, cu_seqlens=None, cu_seqlens_cpu=None, "
    "*, chunk_size=None, head_first=None",
    _gsa, refused={"head_first": HEAD_FIRST}, notes=_NOTES, state_in=_state_in, state_out=_state_out,
    always_state=lambda a: True))
fused_recurrent_gsa = fla_function(FlaOp(
    "fused_recurrent_gsa", "fla.ops.gsa", "gsa", "recurrent",
    f"q, k, v, s, g=None, scale=None, {_STATE}, reverse=False, cu_seqlens=None",
    _gsa, notes=_NOTES, state_in=_state_in, state_out=_state_out, always_state=lambda a: True))

__all__ = ["chunk_gsa", "fused_recurrent_gsa"]

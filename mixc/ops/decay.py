"""fla 0.6's linear recurrences with a decay, S = decay * S + k v^T (o = scale q^T S), on the
library specs linear_attn, lightning_attn, retention, simple_gla, gla, rwkv6 and hgrn.

fla writes several of them through simple_gla (retention and lightning_attn as a fixed decay
per head g_gamma); mixc has a spec for each, whose decay is the same number."""
from __future__ import annotations

import torch

from ..standalone.errors import ArgumentError
from .fla_call import HEAD_FIRST, Call, FlaOp, fla_function, scale_of

# the tail most of fla's functions share, in fla's order
STATE = "initial_state=None, output_final_state=False"
OUTPUT_ATTENTIONS = ("fla's materialized attention scores [B, H, T, T]: mixc computes the recurrence and "
                     "never forms them")
GV = ("a decay per value channel: no library spec has one (gla's decays the keys' channels; fla's "
      "gk is mixc's g)")


# ---- linear_attn: fla returns (S, z) with normalize, z the running key sum [N, 1, H, K] ----

def _linear_attn(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, **scale_of(a), normalize=a.normalize)


def _linear_attn_state_in(a: Call):
    h0 = a.initial_state
    if h0 is None:
        return None
    S, z = (h0 if isinstance(h0, tuple) else (h0, None))
    if isinstance(h0, tuple) and not a.normalize:
        raise ArgumentError("initial_state: a (S, z) tuple is read with normalize=True only (as fla); pass S alone")
    N, H = (S.shape[:2] if S is not None else (z.shape[0], z.shape[2]))
    K, V = a.q.shape[-1], a.v.shape[-1]
    S = S if S is not None else a.q.new_zeros(N, H, K, V, dtype=torch.float32)
    z = z.squeeze(1) if z is not None else a.q.new_zeros(N, H, K, dtype=torch.float32)
    return {"S": S, "z": z}


def _linear_attn_state_out(a: Call, st: dict):
    S = st["S"] if a.output_final_state else None
    return (S, st["z"].unsqueeze(1)) if a.normalize else S


def _linear_attn_op(name: str, form: str, params: str, normalize_default: bool) -> FlaOp:
    return FlaOp(
        name, "fla.ops.linear_attn", "linear_attn", form, params, _linear_attn,
        notes={"normalize": f"the spec's flag (fla's default here: {normalize_default}): o divided by "
                            "scale q . (sum of k) + 1e-10; final_state is then (S or None, z [N, 1, H, K]), "
                            "returned even without output_final_state, as fla",
               "initial_state": "S [N, H, K, V], or (S, z [N, 1, H, K]) with normalize=True"},
        state_in=_linear_attn_state_in, state_out=_linear_attn_state_out,
        always_state=lambda a: a.normalize)


_LINEAR_CHUNK = f"q, k, v, scale=None, {STATE}, normalize=True, cu_seqlens=None"
chunk_linear_attn = fla_function(_linear_attn_op("chunk_linear_attn", "chunk", _LINEAR_CHUNK, True))
fused_chunk_linear_attn = fla_function(_linear_attn_op("fused_chunk_linear_attn", "chunk", _LINEAR_CHUNK, True))
fused_recurrent_linear_attn = fla_function(_linear_attn_op(
    "fused_recurrent_linear_attn", "recurrent",
    f"q, k, v, scale=None, {STATE}, reverse=False, normalize=False, cu_seqlens=None", False))


# ---- lightning_attn: a fixed decay per head from layer_idx / num_layers ----

def _lightning_attn(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, **scale_of(a), layer_idx=a.layer_idx, num_layers=a.num_layers,
                num_heads=a.q.shape[2])


_LIGHTNING_NOTES = {"layer_idx": "the spec's option: log decay -(8 / H)(1 - layer_idx / num_layers) h for head h",
                    "num_layers": "the spec's option (num_heads is H, q's heads, as fla)"}
chunk_lightning_attn = fla_function(FlaOp(
    "chunk_lightning_attn", "fla.ops.lightning_attn", "lightning_attn", "chunk",
    f"q, k, v, layer_idx, num_layers, scale=None, {STATE}, cu_seqlens=None, *, chunk_size=None, head_first=None",
    _lightning_attn, refused={"head_first": HEAD_FIRST}, notes=_LIGHTNING_NOTES))
fused_recurrent_lightning_attn = fla_function(FlaOp(
    "fused_recurrent_lightning_attn", "fla.ops.lightning_attn", "lightning_attn", "recurrent",
    f"q, k, v, layer_idx, num_layers, scale=None, {STATE}, reverse=False, cu_seqlens=None",
    _lightning_attn, notes=_LIGHTNING_NOTES))


# ---- retention: gamma_h = 1 - 2 ** (-5 - h) ----

def _retention(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, **scale_of(a))


chunk_retention = fla_function(FlaOp(
    "chunk_retention", "fla.ops.retention", "retention", "chunk",
    f"q, k, v, scale=None, {STATE}, cu_seqlens=None, *, chunk_size=None, head_first=None",
    _retention, refused={"head_first": HEAD_FIRST}))
fused_chunk_retention = fla_function(FlaOp(
    "fused_chunk_retention", "fla.ops.retention", "retention", "chunk",
    f"q, k, v, scale=None, {STATE}, cu_seqlens=None", _retention))
fused_recurrent_retention = fla_function(FlaOp(
    "fused_recurrent_retention", "fla.ops.retention", "retention", "recurrent",
    f"q, k, v, scale=None, {STATE}, reverse=False, state_v_first=False, cu_seqlens=None, *, "
    "transpose_state_layout=None", _retention))
parallel_retention = fla_function(FlaOp(
    "parallel_retention", "fla.ops.retention", "retention", "parallel",
    "q, k, v, scale=None, output_attentions=False, cu_seqlens=None", _retention,
    refused={"output_attentions": OUTPUT_ATTENTIONS}, returns="attentions"))


# ---- simple_gla: a decay per head and token g [B, T, H], or per head g_gamma [H] ----

def _simple_gla_gate(a: Call) -> torch.Tensor:
    """fla decays by exp(g) and then exp(g_gamma) where both are given; neither is no decay."""
    gamma = a.get("g_gamma")
    if a.g is None and gamma is None:
        return a.q.new_zeros(a.q.shape[:3])
    if gamma is None:
        return a.g
    gamma = gamma.reshape(1, 1, -1).expand(*a.q.shape[:2], gamma.shape[-1])
    return gamma if a.g is None else a.g + gamma


def _simple_gla(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, g=_simple_gla_gate(a), **scale_of(a))


_SIMPLE_GLA_NOTES = {"g": "[B, T, H] log decay per token and head (None: no decay)",
                     "g_gamma": "[H] log decay per head, added to g where both are given (as fla's kernels)"}
chunk_simple_gla = fla_function(FlaOp(
    "chunk_simple_gla", "fla.ops.simple_gla", "simple_gla", "chunk",
    f"q, k, v, g=None, g_gamma=None, scale=None, {STATE}, state_v_first=False, cu_seqlens=None, "
    "cu_seqlens_cpu=None, *, chunk_size=None, head_first=None",
    _simple_gla, refused={"head_first": HEAD_FIRST}, notes=_SIMPLE_GLA_NOTES))
fused_chunk_simple_gla = fla_function(FlaOp(
    "fused_chunk_simple_gla", "fla.ops.simple_gla", "simple_gla", "chunk",
    f"q, k, v, g=None, g_gamma=None, scale=None, {STATE}, cu_seqlens=None", _simple_gla, notes=_SIMPLE_GLA_NOTES))
fused_recurrent_simple_gla = fla_function(FlaOp(
    "fused_recurrent_simple_gla", "fla.ops.simple_gla", "simple_gla", "recurrent",
    f"q, k, v, g=None, g_gamma=None, scale=None, {STATE}, reverse=False, state_v_first=False, "
    "cu_seqlens=None, *, transpose_state_layout=None", _simple_gla, notes=_SIMPLE_GLA_NOTES))
parallel_simple_gla = fla_function(FlaOp(
    "parallel_simple_gla", "fla.ops.simple_gla", "simple_gla", "parallel",
    "q, k, v, g=None, scale=None, output_attentions=False, cu_seqlens=None, cu_seqlens_cpu=None",
    _simple_gla, refused={"output_attentions": OUTPUT_ATTENTIONS}, notes=_SIMPLE_GLA_NOTES, returns="attentions"))


# ---- gla: a decay per key channel ----

def _gla_chunk(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, g=a.g, **scale_of(a))


def _gla_recurrent(a: Call) -> dict:
    g = a.gk if a.gk is not None else torch.zeros_like(a.k)      # fla: no gk, no decay
    return dict(q=a.q, k=a.k, v=a.v, g=g, **scale_of(a))


chunk_gla = fla_function(FlaOp(
    "chunk_gla", "fla.ops.gla", "gla", "chunk",
    f"q, k, v, g, scale=None, {STATE}, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None", _gla_chunk))
fused_recurrent_gla = fla_function(FlaOp(
    "fused_recurrent_gla", "fla.ops.gla", "gla", "recurrent",
    f"q, k, v, gk=None, gv=None, scale=None, {STATE}, reverse=False, state_v_first=False, cu_seqlens=None, *, "
    "transpose_state_layout=None", _gla_recurrent, refused={"gv": GV}, renamed={"gk": "g"},
    notes={"gk": "[B, T, H, K] log decay per key channel, the spec's g (None: no decay)"}))


# ---- rwkv6: o reads the state before the token, plus a bonus u on the token's own k v^T ----

def _rwkv6(a: Call) -> dict:
    return dict(r=a.r, k=a.k, v=a.v, w=a.w, u=a.u, **scale_of(a))


_RWKV6_NOTES = {"u": "[H, K] the bonus on the token's own k v^T (a param of the spec)"}
chunk_rwkv6 = fla_function(FlaOp(
    "chunk_rwkv6", "fla.ops.rwkv6", "rwkv6", "chunk",
    f"r, k, v, w, u, scale=None, {STATE}, cu_seqlens=None, cu_seqlens_cpu=None, *, chunk_size=None, "
    "head_first=None", _rwkv6, refused={"head_first": HEAD_FIRST}, notes=_RWKV6_NOTES))
fused_recurrent_rwkv6 = fla_function(FlaOp(
    "fused_recurrent_rwkv6", "fla.ops.rwkv6", "rwkv6", "recurrent",
    f"r, k, v, w, u, scale=None, {STATE}, reverse=False, cu_seqlens=None", _rwkv6, notes=_RWKV6_NOTES))


# ---- hgrn: fla's x, g are [B, T, D] with no heads; the spec's are per head (one head here) ----

def _hgrn(a: Call) -> dict:
    return dict(x=a.x.unsqueeze(2), g=a.g.unsqueeze(2))


def _hgrn_state_in(a: Call):
    return None if a.initial_state is None else {"h": a.initial_state.unsqueeze(1)}


_HGRN = dict(state_in=_hgrn_state_in, state_out=lambda a, st: st["h"].squeeze(1), output=lambda o: o.squeeze(2),
             notes={"x": "[B, T, D] (one head of the spec's x[D])", "g": "[B, T, D] log decay",
                    "initial_state": "[N, D] float32"})
chunk_hgrn = fla_function(FlaOp("chunk_hgrn", "fla.ops.hgrn", "hgrn", "chunk", f"x, g, {STATE}", _hgrn, **_HGRN))
fused_recurrent_hgrn = fla_function(FlaOp(
    "fused_recurrent_hgrn", "fla.ops.hgrn", "hgrn", "recurrent", f"x, g, {STATE}, cu_seqlens=None", _hgrn, **_HGRN))

__all__ = [
    "chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn",
    "chunk_lightning_attn", "fused_recurrent_lightning_attn",
    "chunk_retention", "fused_chunk_retention", "fused_recurrent_retention", "parallel_retention",
    "chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla", "parallel_simple_gla",
    "chunk_gla", "fused_recurrent_gla", "chunk_rwkv6", "fused_recurrent_rwkv6", "chunk_hgrn", "fused_recurrent_hgrn",
]

"""fla 0.6's delta rules and rank-1 updates, on the library specs delta_rule, gated_delta_rule,
kda, comba, gated_delta_product and rwkv7 (which also computes fla's dplr and iplr delta rules:
S = diag(exp(gk)) S + b (a^T S) + k v^T on fla's [K, V] state).

fla computes some inputs inside its kernels from raw values (use_gate_in_kernel: the decay from
logits with A_log and dt_bias; use_beta_sigmoid_in_kernel: beta = sigmoid(beta)); mixc computes
them here in float32 with torch, before the spec's op, with the same formulas."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..standalone.errors import ArgumentError
from .fla_call import CP_CONTEXT, HEAD_FIRST, Call, FlaOp, fla_function, ones_like_head, scale_of

STATE = "initial_state=None, output_final_state=False"
L2 = "use_qk_l2norm_in_kernel=False"
PER_VALUE_BETA = "a beta per value channel [B, T, HV, V]: the specs take one beta per token and head [B, T, HV]"
INTERMEDIATE = "fla's states at chunk starts (inference): mixc's ops return the final state only"
GV = "a decay per value channel: no library spec has one (gk runs kda, g gated_delta_rule)"

_GATE_NOTES = {
    "use_gate_in_kernel": "honoured in torch: g is the raw logit, the decay -exp(A_log) * softplus(g + dt_bias) "
                          "(kda with lower_bound: lower_bound * sigmoid(exp(A_log) * (g + dt_bias)))",
    "A_log": "[HV] with use_gate_in_kernel", "dt_bias": "[HV] ([HV * K] for kda) with use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel": "honoured in torch: beta = sigmoid(beta)",
    "allow_neg_eigval": "honoured in torch: beta = 2 * sigmoid(beta) (needs use_beta_sigmoid_in_kernel, as fla)",
    "lower_bound": "with use_gate_in_kernel the kda gate's bound; otherwise fla's promise gk >= lower_bound "
                   "(accepted, no effect)",
}


def _beta(a: Call) -> torch.Tensor:
    beta = a.beta if a.beta is not None else ones_like_head(a.q)
    if beta.dim() == a.v.dim():
        raise ArgumentError(f"beta: {PER_VALUE_BETA}")
    if a.get("allow_neg_eigval") and not a.get("use_beta_sigmoid_in_kernel"):
        raise ArgumentError("allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (as fla)")
    if a.get("use_beta_sigmoid_in_kernel"):
        beta = beta.float().sigmoid() * (2.0 if a.get("allow_neg_eigval") else 1.0)
    return beta


def _gate(a: Call, g: torch.Tensor, per_key: bool) -> torch.Tensor:
    """The decay from fla's raw gate where use_gate_in_kernel (fla's gdn / kda gate formulas)."""
    if not a.get("use_gate_in_kernel"):
        return g
    A_log, dt_bias, bound = a.get("A_log"), a.get("dt_bias"), a.get("lower_bound") if per_key else None
    if g is None:
        raise ArgumentError("g: the raw gate is needed with use_gate_in_kernel=True (as fla)")
    if A_log is None and bound is None:
        raise ArgumentError("A_log: needed with use_gate_in_kernel=True" + (" unless lower_bound is set" if per_key
                                                                           else "") + " (as fla)")
    x = g.float()
    H = x.shape[2]
    if dt_bias is not None:
        x = x + dt_bias.float().reshape((H, -1) if per_key else (H,))
    A = A_log.float().reshape((H, 1) if per_key else (H,)) if A_log is not None else None
    if bound is not None:                 # kda's bounded gate
        return bound * torch.sigmoid(x * A.exp() if A is not None else x)
    return -A.exp() * F.softplus(x)


def _check_safe_gate(a: Call) -> None:
    bound = a.get("lower_bound")
    if a.get("safe_gate") and a.get("use_gate_in_kernel"):
        if bound is None:
            raise ArgumentError("lower_bound: needed with safe_gate=True and use_gate_in_kernel=True (as fla)")
        if not -5 <= bound < 0:
            raise ArgumentError(f"lower_bound: must be in fla's safe range [-5, 0), got {bound}")


def _l2(a: Call) -> dict:
    return {"use_qk_l2norm_in_kernel": a.use_qk_l2norm_in_kernel}


# ---- delta_rule ----

def _delta_rule(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, beta=_beta(a), **scale_of(a), **_l2(a))


chunk_delta_rule = fla_function(FlaOp(
    "chunk_delta_rule", "fla.ops.delta_rule", "delta_rule", "chunk",
    f"q, k, v, beta, scale=None, {STATE}, {L2}, cu_seqlens=None, cu_seqlens_cpu=None, *, chunk_size=64, "
    "head_first=None", _delta_rule, refused={"head_first": HEAD_FIRST}))
fused_recurrent_delta_rule = fla_function(FlaOp(
    "fused_recurrent_delta_rule", "fla.ops.delta_rule", "delta_rule", "recurrent",
    f"q, k, v, beta=None, scale=None, {STATE}, {L2}, cu_seqlens=None", _delta_rule,
    notes={"beta": "[B, T, H] (None: ones, as fla)"}))


# ---- gated_delta_rule (fla's fused recurrent form takes gk too: that is kda) ----

def _gated_delta_rule(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, g=_gate(a, a.g, per_key=False), beta=_beta(a), **scale_of(a), **_l2(a))


def _gdn_recurrent_spec(a: Call) -> str:
    if a.gk is not None:
        return "kda"
    return "gated_delta_rule" if a.g is not None or a.use_gate_in_kernel else "delta_rule"


def _gdn_recurrent(a: Call) -> dict:
    """fla decays by exp(g), then exp(gk), then writes: one decay per key channel, g + gk."""
    args = dict(q=a.q, k=a.k, v=a.v, beta=_beta(a), **scale_of(a), **_l2(a))
    g = _gate(a, a.g, per_key=False)
    if a.gk is not None:
        args["g"] = a.gk if g is None else a.gk + g.unsqueeze(-1)
    elif g is not None:
        args["g"] = g
    return args


chunk_gated_delta_rule = fla_function(FlaOp(
    "chunk_gated_delta_rule", "fla.ops.gated_delta_rule", "gated_delta_rule", "chunk",
    f"q, k, v, g, beta, scale=None, {STATE}, {L2}, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, "
    "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, *, "
    "chunk_size=64, use_gate_in_kernel=False, A_log=None, dt_bias=None, transpose_state_layout=None, head_first=None",
    _gated_delta_rule, refused={"cp_context": CP_CONTEXT, "head_first": HEAD_FIRST}, notes=_GATE_NOTES))
chunk_gdn = chunk_gated_delta_rule          # fla's alias, the same function
fused_recurrent_gated_delta_rule = fla_function(FlaOp(
    "fused_recurrent_gated_delta_rule", "fla.ops.gated_delta_rule", "gated_delta_rule", "recurrent",
    f"q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, {STATE}, {L2}, use_gate_in_kernel=False, "
    "A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, "
    "cu_seqlens=None, *, transpose_state_layout=None", _gdn_recurrent, refused={"gv": GV},
    choose=_gdn_recurrent_spec, specs=("gated_delta_rule", "kda", "delta_rule"),
    notes=dict(_GATE_NOTES, g="[B, T, HV] log decay per head (gated_delta_rule)",
               gk="[B, T, HV, K] log decay per key channel (kda; with g: g + gk)",
               beta="[B, T, HV] (None: ones, as fla)")))
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


# ---- kda: a decay per key channel ----

def _kda(a: Call) -> dict:
    _check_safe_gate(a)
    return dict(q=a.q, k=a.k, v=a.v, g=_gate(a, a.g, per_key=True), beta=_beta(a), **scale_of(a), **_l2(a))


chunk_kda = fla_function(FlaOp(
    "chunk_kda", "fla.ops.kda", "kda", "chunk",
    f"q, k, v, g, beta, scale=None, {STATE}, {L2}, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
    "allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False, "
    "return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, "
    "use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64, transpose_state_layout=None",
    _kda, refused={"return_intermediate_states": INTERMEDIATE, "cp_context": CP_CONTEXT}, notes=_GATE_NOTES))
fused_recurrent_kda = fla_function(FlaOp(
    "fused_recurrent_kda", "fla.ops.kda", "kda", "recurrent",
    f"q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, {STATE}, {L2}, use_gate_in_kernel=False, "
    "use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False, "
    "cu_seqlens=None, *, transpose_state_layout=None", _kda, notes=_GATE_NOTES))


# ---- comba: the delta's read-out key p differs from the written key k ----

def _comba(a: Call) -> dict:
    p = a.p if a.p is not None else a.k         # fla: no p, p = k
    return dict(q=a.q, k=a.k, v=a.v, p=p, g=a.g, beta=_beta(a), **scale_of(a), **_l2(a))


_COMBA_NOTES = {"p": "[B, T, H, K] the key the correction reads (None: k, as fla)", "beta": "[B, T, H] (None: ones)"}
chunk_comba = fla_function(FlaOp(
    "chunk_comba", "fla.ops.comba", "comba", "chunk",
    f"q, k, v, p, g, beta=None, scale=None, {STATE}, {L2}, cu_seqlens=None, cu_seqlens_cpu=None",
    _comba, notes=_COMBA_NOTES))
fused_recurrent_comba = fla_function(FlaOp(
    "fused_recurrent_comba", "fla.ops.comba", "comba", "recurrent",
    f"q, k, p, v, g, beta=None, scale=None, {STATE}, {L2}, cu_seqlens=None", _comba, notes=_COMBA_NOTES))


# ---- gated_delta_product: num_householder delta steps per token, fla's k, v, beta interleaved ----

def _gdp_spec(a: Call) -> str:
    if a.num_householder == 2:
        return "gated_delta_product"
    if a.num_householder == 1:
        return "gated_delta_rule"
    raise ArgumentError(f"num_householder: mixc's specs take 1 (gated_delta_rule) or 2 (gated_delta_product) "
                        f"delta steps per token, got {a.num_householder!r}")


def _gdp(a: Call) -> dict:
    g = a.g if a.g is not None else a.q.new_zeros(a.q.shape[:3])       # fla: no g, no decay
    args = dict(q=a.q, g=g, **scale_of(a), **_l2(a))
    if a.num_householder == 1:
        return dict(args, k=a.k, v=a.v, beta=a.beta)
    return dict(args, k1=a.k[:, 0::2], k2=a.k[:, 1::2], v1=a.v[:, 0::2], v2=a.v[:, 1::2],
                beta1=a.beta[:, 0::2], beta2=a.beta[:, 1::2])


chunk_gated_delta_product = fla_function(FlaOp(
    "chunk_gated_delta_product", "fla.ops.gated_delta_product", "gated_delta_product", "chunk",
    f"q, k, v, g, beta, num_householder, scale=None, {STATE}, {L2}, cu_seqlens=None, cu_seqlens_cpu=None, "
    "cp_context=None", _gdp, refused={"cp_context": CP_CONTEXT}, choose=_gdp_spec,
    specs=("gated_delta_product", "gated_delta_rule"),
    notes={"k": "[B, T * num_householder, H, K], each token's keys in turn (the spec's k1, k2)",
           "v": "[B, T * num_householder, H, V] (the spec's v1, v2)",
           "beta": "[B, T * num_householder, H] (the spec's beta1, beta2)",
           "g": "[B, T, H] log decay, once per token (None: no decay)",
           "num_householder": "2 (gated_delta_product) or 1 (gated_delta_rule)"}))


# ---- rwkv7 and fla's dplr / iplr delta rules: S = diag(exp(w)) S + b (a^T S) + k v^T ----

def _dplr(a: Call, r, w, act_a, b) -> dict:
    bound = a.get("lower_bound")
    if bound is not None and bound >= 0:
        raise ArgumentError(f"lower_bound: must be negative (gk is a log decay < 0, as fla), got {bound}")
    # the spec's scale defaults to 1 (RWKV-7's); fla's dplr functions take K ** -0.5 for None
    return dict(r=r, w=w, k=a.k, v=a.v, a=act_a, b=b, **scale_of(a, default=a.k.shape[-1] ** -0.5))


def _rwkv7(a: Call) -> dict:
    return _dplr(a, a.r, a.w, a.a, a.b)


def _rwkv7_mul(a: Call) -> dict:
    """fla's fused_mul_recurrent_rwkv7 takes kk and a: the update's a is -kk, its b is kk * a."""
    return _dplr(a, a.r, a.w, -a.kk, a.kk * a.a)


def _dplr_delta_rule(a: Call) -> dict:
    return _dplr(a, a.q, a.gk, a.a, a.b)


def _iplr_delta_rule(a: Call) -> dict:
    return _dplr(a, a.q, torch.zeros_like(a.k), a.a, a.b)        # identity plus low rank: no decay


_HINTS = "safe_gate=False, chunk_size=None, disable_recompute=False, cp_context=None, lower_bound=None"
_RWKV7_NOTES = {"w": "[B, T, H, K] log decay", "a": "[B, T, H, K] the update's a (reads a^T S)",
                "b": "[B, T, H, K] the update's b (writes b (a^T S))"}
_DPLR_NOTES = dict(_RWKV7_NOTES, q="[B, T, H, K], the spec's r", gk="[B, T, H, K] log decay, the spec's w",
                   scale="multiplies q; None: K ** -0.5, fla's default")
chunk_rwkv7 = fla_function(FlaOp(
    "chunk_rwkv7", "fla.ops.rwkv7", "rwkv7", "chunk",
    f"r, w, k, v, a, b, scale=1.0, {STATE}, cu_seqlens=None, cu_seqlens_cpu=None, {_HINTS}",
    _rwkv7, refused={"cp_context": CP_CONTEXT},
    notes=dict(_RWKV7_NOTES, scale="multiplies r; fla's default 1.0 (None: K ** -0.5)")))
fused_recurrent_rwkv7 = fla_function(FlaOp(
    "fused_recurrent_rwkv7", "fla.ops.rwkv7", "rwkv7", "recurrent",
    "r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None", _rwkv7,
    notes=dict(_RWKV7_NOTES, scale="multiplies r; None: K ** -0.5 (fla's default here, unlike chunk_rwkv7)",
               output_final_state="fla's default here is True")))
fused_mul_recurrent_rwkv7 = fla_function(FlaOp(
    "fused_mul_recurrent_rwkv7", "fla.ops.rwkv7", "rwkv7", "recurrent",
    f"r, w, k, v, kk, a, scale=1.0, {STATE}, reverse=False, cu_seqlens=None", _rwkv7_mul,
    notes=dict(_RWKV7_NOTES, kk="[B, T, H, K]: the spec's a is -kk", a="[B, T, H, K]: the spec's b is kk * a")))
chunk_dplr_delta_rule = fla_function(FlaOp(
    "chunk_dplr_delta_rule", "fla.ops.generalized_delta_rule", "rwkv7", "chunk",
    f"q, k, v, a, b, gk, scale=None, {STATE}, cu_seqlens=None, cu_seqlens_cpu=None, {_HINTS}, *, head_first=None",
    _dplr_delta_rule, refused={"cp_context": CP_CONTEXT, "head_first": HEAD_FIRST}, renamed={"q": "r", "gk": "w"},
    notes=_DPLR_NOTES))
fused_recurrent_dplr_delta_rule = fla_function(FlaOp(
    "fused_recurrent_dplr_delta_rule", "fla.ops.generalized_delta_rule", "rwkv7", "recurrent",
    f"q, k, v, a, b, gk, scale=None, {STATE}, reverse=False, cu_seqlens=None", _dplr_delta_rule,
    renamed={"q": "r", "gk": "w"}, notes=_DPLR_NOTES))
chunk_iplr_delta_rule = fla_function(FlaOp(
    "chunk_iplr_delta_rule", "fla.ops.generalized_delta_rule", "rwkv7", "chunk",
    f"q, k, v, a, b, scale=None, {STATE}, cu_seqlens=None, cu_seqlens_cpu=None, *, chunk_size=None, head_first=None",
    _iplr_delta_rule, refused={"head_first": HEAD_FIRST}, renamed={"q": "r"},
    notes=dict(_DPLR_NOTES, a=_RWKV7_NOTES["a"] + "; the spec's w is 0 (no decay)")))
fused_recurrent_iplr_delta_rule = fla_function(FlaOp(
    "fused_recurrent_iplr_delta_rule", "fla.ops.generalized_delta_rule", "rwkv7", "recurrent",
    f"q, k, v, a, b, scale=None, {STATE}, cu_seqlens=None", _iplr_delta_rule, renamed={"q": "r"},
    notes=dict(_DPLR_NOTES, a=_RWKV7_NOTES["a"] + "; the spec's w is 0 (no decay)")))

__all__ = [
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "chunk_kda", "fused_recurrent_kda", "chunk_comba", "fused_recurrent_comba", "chunk_gated_delta_product",
    "chunk_rwkv7", "fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7",
    "chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule", "chunk_iplr_delta_rule",
    "fused_recurrent_iplr_delta_rule",
]

"""The core functions transformers' mixer layers call, backed by mixc's ops.

Each replacement takes the arguments of the function it stands in for (fla's
chunk_gated_delta_rule / fused_recurrent_gated_delta_rule / chunk_kda / fused_recurrent_kda,
mamba_ssm's mamba_chunk_scan_combined / selective_state_update / selective_scan_fn,
transformers' rwkv_linear_attention, in the layouts transformers passes them) and returns what that function returns, so the layer's own
projections, conv, norm and cache keep working. What the layouts need:

- grouped heads (Qwen3-Next's key heads < value heads, Mamba-2's n_groups): passed as they
  are, q/k (B/C) with G heads and the op's H the value heads'; head h reads group h // (H / G),
  the order transformers and mamba_ssm use, and the kernels read the shared head in place
  (docs/language.md, grouped heads);
- Mamba-2's state is [B, H, head_dim, state] in the cache and [B, H, N, P] in mixc (the spec's
  S[N, P]): transposed on the way in and out; Mamba's is [B, D, N] and mixc's [B, G, N, D/G];
- selective_state_update writes the state it is given (the cache's buffer): the new state is
  copied into it, as mamba_ssm does;
- per-channel D and the z gate are applied outside the op when the spec has no place for them
  (D[head, P] in Mamba-2, z everywhere), exactly as the replaced function does;
- the fused training paths (mamba_split_conv1d_scan_combined, mamba_inner_fn) return None,
  which makes the layer take its unfused path through the functions above;
- RWKV-4's cache keeps (num, den, max) with the real state num * exp(max); mixc's rwkv4 takes
  the unscaled state, so the keys are shifted by the state's scale (_rwkv4).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..runtime.signature import ArgumentError
from . import hf_packing

_OPS: dict = {}
_NO_LIMIT = 1e30        # the specs' dt_max default: options are finite numbers


def spec_op(spec: str):
    """The op of a library spec, loaded once per process."""
    if spec not in _OPS:
        from ..pipeline import load_op      # mixc.load
        _OPS[spec] = load_op(spec)
    return _OPS[spec]


# families whose layers do not pass the packing marks on to the core: their conv refuses them
# (with the marks the conv would keep the sequences apart and the scan would not)
UNPACKED = {"mamba": "transformers' Mamba layers (Mamba, FalconMamba, Jamba) pass no packing marks to their scan "
                     "(mamba_selective_scan), so mixc cannot keep packed sequences apart in it"}


def make(family: str, *, mode: str, op_kwargs: dict, module_globals: dict | None = None) -> dict:
    """{global name in the modeling module: replacement} for one layer. module_globals: the
    layer forward's globals; its causal_conv1d_fn, if any, is wrapped to keep packed sequences
    apart (conv)."""
    out = _FACTORIES[family](mode, dict(op_kwargs))
    original = (module_globals or {}).get("causal_conv1d_fn")
    if original is not None:
        out["causal_conv1d_fn"] = conv(family, original)
    return out


def conv(family: str, original):
    """transformers' causal_conv1d_fn of a layer of the family, keeping packed sequences apart
    (hf_packing.packed_conv), or refusing them where the family's core cannot (UNPACKED)."""
    return hf_packing.packed_conv(original, refuse=UNPACKED.get(family))


def _cast_state(st: dict | None, name: str = "S"):
    # "reference" mode computes in float64; the cache keeps the float32 state the others return
    return None if st is None else st[name].float()


def _grouped_heads(x: torch.Tensor, heads: int, dim: int, what: str) -> torch.Tensor:
    """x with its groups of heads as they are (the op shares each over H / G heads), checked
    in transformers' words: G must divide the layer's heads."""
    groups = x.shape[dim]
    if groups != heads and (groups > heads or heads % groups):
        raise ArgumentError(f"{what}: {groups} groups do not divide {heads} heads")
    return x


def _call(op, seqs: dict, *, init, final: bool, cu_seqlens, seq_idx, **kwargs):
    """op(**seqs, **kwargs) over [batch, T] inputs. Packed sequences: cu_seqlens as the op takes
    them (fla's: one row; each sequence's state in and out), or seq_idx (mamba_ssm's), mapped
    to cu_seqlens over the rows laid end to end with a state in and out per row."""
    if cu_seqlens is None and seq_idx is not None:
        first = next(iter(seqs.values()))
        segs = hf_packing.Segments(seq_idx.to(first.device), first.shape[0], first.shape[1])
        o, st = op(**{n: segs.flatten(x) for n, x in seqs.items()}, initial_state=segs.initial(init),
                   output_final_state=final, cu_seqlens=segs.cu_seqlens, **kwargs)
        return segs.unflatten(o), segs.final(st)
    return op(**seqs, initial_state=init, output_final_state=final, cu_seqlens=cu_seqlens, **kwargs)


# ---- Gated DeltaNet (Qwen3-Next, OlmoHybrid) and Kimi Delta Attention (Kimi-Linear) ----

def _delta_rule_family(spec: str, chunk_name: str, recurrent_name: str):
    def factory(mode: str, op_kwargs: dict) -> dict:
        op = spec_op(spec)

        def options(scale, use_qk_l2norm_in_kernel):
            out = {"use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel)}
            if scale is not None:
                out["scale"] = float(scale)
            return out

        def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, scale=None, **kwargs):
            heads = value.shape[2]
            q = _grouped_heads(query, heads, 2, "query")
            k = _grouped_heads(key, heads, 2, "key")
            o, st = _call(op, dict(q=q, k=k, v=value, g=g, beta=beta),
                          init=None if initial_state is None else {"S": initial_state},
                          final=bool(output_final_state), cu_seqlens=cu_seqlens if cu_seqlens is not None
                          else kwargs.get("cu_seq_lens_q"), seq_idx=kwargs.get("seq_idx"),
                          **options(scale, use_qk_l2norm_in_kernel), mode=mode, **op_kwargs)
            return o.to(query.dtype), _cast_state(st)

        def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, scale=None, **kwargs):
            cu = cu_seqlens if cu_seqlens is not None else kwargs.get("cu_seq_lens_q")
            if query.shape[1] != 1 or initial_state is None or cu is not None or kwargs.get("seq_idx") is not None:
                return chunk(query, key, value, g, beta, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu, seq_idx=kwargs.get("seq_idx"),
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=scale)
            heads = value.shape[2]
            q = _grouped_heads(query[:, 0], heads, 1, "query")
            k = _grouped_heads(key[:, 0], heads, 1, "key")
            o, st = op.step(q=q, k=k, v=value[:, 0], g=g[:, 0], beta=beta[:, 0],
                            **options(scale, use_qk_l2norm_in_kernel), state={"S": initial_state}, mode=mode)
            return o[:, None].to(query.dtype), (_cast_state(st) if output_final_state else None)

        return {chunk_name: chunk, recurrent_name: recurrent}
    return factory


# ---- Mamba-2 (Mamba2, Bamba, FalconH1, Zamba2, NemotronH, GraniteMoeHybrid) ----

def _dt_options(dt_softplus: bool, dt_limit) -> dict:
    out = {"dt_softplus": bool(dt_softplus)}
    if dt_limit is not None:
        lo, hi = (float(v) for v in dt_limit)
        if lo > 0.0 or hi < math.inf:
            out.update(dt_limit=True, dt_min=lo, dt_max=min(hi, _NO_LIMIT))
    return out


def _per_head(t: torch.Tensor, keep: int, what: str) -> torch.Tensor:
    """A tensor transformers expanded from one value per head (e.g. A[:, None, None].expand(
    -1, head_dim, state)) -> that value per head: its first `keep` dims. Strides of 0 say so
    without reading it; otherwise the values are compared."""
    tail = t.shape[keep:]
    if all(s == 0 or n == 1 for s, n in zip(t.stride()[keep:], tail)):
        return t[(...,) + (0,) * len(tail)]
    first = t[(...,) + (0,) * len(tail)]
    if not torch.equal(t, first.reshape(first.shape + (1,) * len(tail)).expand_as(t)):
        raise ArgumentError(f"{what}: mixc's mamba2 takes one value per head; got {list(t.shape)} varying "
                            "along head_dim (use the mamba spec for per-channel values)")
    return first


def _d_parts(D, heads: int, like: torch.Tensor):
    """(D per head for the op, D per channel to add outside it or None): mamba_ssm takes D [H]
    or [H, head_dim]; the spec's D[] is per head."""
    if D is None:
        return like.new_zeros(heads), None
    if D.dim() == 1:
        return D, None
    if D.stride(1) == 0 or D.shape[1] == 1:         # expanded from one value per head
        return D[:, 0], None
    return like.new_zeros(heads), D


def _mamba2(mode: str, op_kwargs: dict) -> dict:
    op = spec_op("mamba2")

    def chunk_scan(x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                   return_final_states=False, **kwargs):
        batch, T, heads, P = x.shape
        Bh = _grouped_heads(B, heads, 2, "B")
        Ch = _grouped_heads(C, heads, 2, "C")
        D_op, D_out = _d_parts(D, heads, A)
        bias = dt_bias if dt_bias is not None else A.new_zeros(heads)
        init = None if initial_states is None else {"S": initial_states.transpose(-1, -2)}
        if cu_seqlens is None and seq_idx is None:
            # flash-attention's marks (return_flash_attn_kwargs=True), which the Mamba-2 layers pass
            # on in their keyword arguments; mamba_ssm's scan would ignore them and mix the sequences
            cu_seqlens = kwargs.get("cu_seq_lens_q")
        y, st = _call(op, dict(x=x, dt=dt, B=Bh, C=Ch), init=init, final=bool(return_final_states),
                      cu_seqlens=cu_seqlens, seq_idx=seq_idx, A=A, D=D_op, dt_bias=bias,
                      **_dt_options(dt_softplus, dt_limit), mode=mode, **op_kwargs)
        if D_out is not None:
            y = y + x * D_out
        if z is not None:
            y = y * F.silu(z)
        y = y.to(x.dtype).contiguous()         # as mamba_ssm's (FalconH1 views it)
        if return_final_states:
            return y, _cast_state(st).transpose(-1, -2).contiguous()
        return y

    def state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, **kwargs):
        if state_batch_indices is not None:
            raise ArgumentError("state_batch_indices: not supported by mixc's transformers adapter")
        if x.dim() != 3:
            raise ArgumentError(f"x: expected [batch, heads, head_dim], got {list(x.shape)}")
        heads = x.shape[1]
        A_h = _per_head(A, 1, "A")
        dt_h = _per_head(dt, 2, "dt")
        bias = _per_head(dt_bias, 1, "dt_bias") if dt_bias is not None else A_h.new_zeros(heads)
        D_op, D_out = _d_parts(D, heads, A_h)
        o, st = op.step(x=x, dt=dt_h, B=_grouped_heads(B, heads, 1, "B"), C=_grouped_heads(C, heads, 1, "C"),
                        A=A_h, D=D_op, dt_bias=bias, dt_softplus=bool(dt_softplus),
                        state={"S": state.transpose(-1, -2).float()}, mode=mode)
        with torch.no_grad():
            state.copy_(st["S"].transpose(-1, -2))
        if D_out is not None:
            o = o + x * D_out
        if z is not None:
            o = o * F.silu(z)
        return o.to(x.dtype)

    def split_conv1d_scan_combined(*args, **kwargs):
        return None                     # the layer's unfused path runs (through the two above)

    return {"mamba2_chunk_scan": chunk_scan, "mamba2_selective_state_update": state_update,
            "mamba2_split_conv1d_scan_combined": split_conv1d_scan_combined}


# ---- Mamba (Mamba, FalconMamba, Jamba) ----

def _mamba(mode: str, op_kwargs: dict) -> dict:
    op = spec_op("mamba")

    def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, **kwargs):
        # mamba_ssm's layout: u, delta, z [batch, D, T]; A [D, N]; B, C [batch, N, T] or
        # [batch, G, N, T]. mixc: G heads of D/G channels, T first.
        batch, Dn, T = u.shape
        Bg = B if B.dim() == 4 else B[:, None]
        Cg = C if C.dim() == 4 else C[:, None]
        G, N = Bg.shape[1], Bg.shape[2]
        P = Dn // G
        seq = lambda t: t.transpose(1, 2).reshape(batch, T, G, P)          # [b, D, T] -> [b, T, G, P]
        y, st = op(x=seq(u), dt=seq(delta), B=Bg.permute(0, 3, 1, 2), C=Cg.permute(0, 3, 1, 2),
                   A=A.reshape(G, P, N).transpose(1, 2),
                   D=(D if D is not None else A.new_zeros(Dn)).reshape(G, P),
                   dt_bias=(delta_bias if delta_bias is not None else A.new_zeros(Dn)).reshape(G, P),
                   dt_softplus=bool(delta_softplus), output_final_state=bool(return_last_state),
                   mode=mode, **op_kwargs)
        y = y.reshape(batch, T, Dn).transpose(1, 2)
        if z is not None:
            y = y * F.silu(z)
        y = y.to(u.dtype).contiguous()         # [batch, D, T] as mamba_ssm's
        if return_last_state:
            return y, _cast_state(st).transpose(2, 3).reshape(batch, Dn, N)   # [b, G, N, P] -> [b, D, N]
        return y

    def state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, **kwargs):
        if state_batch_indices is not None:
            raise ArgumentError("state_batch_indices: not supported by mixc's transformers adapter")
        if x.dim() != 2:
            raise ArgumentError(f"x: expected [batch, channels], got {list(x.shape)}")
        batch, Dn = x.shape
        N = A.shape[-1]
        o, st = op.step(x=x[:, None], dt=dt[:, None], B=B[:, None], C=C[:, None], A=A.t()[None],
                        D=(D if D is not None else A.new_zeros(Dn))[None],
                        dt_bias=(dt_bias if dt_bias is not None else A.new_zeros(Dn))[None],
                        dt_softplus=bool(dt_softplus),
                        state={"S": state.transpose(1, 2)[:, None].float()}, mode=mode)
        with torch.no_grad():
            state.copy_(st["S"][:, 0].transpose(1, 2).reshape(batch, Dn, N))
        o = o[:, 0]
        if z is not None:
            o = o * F.silu(z)
        return o.to(x.dtype)

    def inner_fn(*args, **kwargs):
        return None                     # the layer's unfused path runs (through the two above)

    return {"mamba_selective_scan": selective_scan, "mamba_selective_state_update": state_update,
            "mamba_inner_fn": inner_fn}


# ---- RWKV-4 (transformers' Rwkv) ----

def _rwkv4(mode: str, op_kwargs: dict) -> dict:
    op = spec_op("rwkv4")

    def linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
        """transformers' rwkv_linear_attention: key, value [batch, T, C]; time_decay (w),
        time_first (u) [C]; state (num, den, max) [batch, C] each, the real numerator and
        denominator num * exp(max), den * exp(max). Returns (output [batch, T, C], the new
        (num, den, max) or None)."""
        if key.dim() != 3 or value.shape != key.shape:
            raise ArgumentError(f"key, value: expected [batch, T, channels] each, got {list(key.shape)} and "
                                f"{list(value.shape)}")
        # one head per channel (V = 1), computed in float32 as transformers' own loop does
        k, v = key.float(), value.float()[..., None]
        if state is None and not return_state:
            o, _ = op(k=k, v=v, w=time_decay, u=time_first, mode=mode, **op_kwargs)
            return o[..., 0].to(key.dtype), None
        # mixc's states are the unscaled num * exp(max), which overflows past max = 88. The
        # output does not change when a channel's keys and its state's log scale move by the same
        # c, so the op runs on k - c with the state at scale c = max(max, largest key): every
        # exponent it sees is <= 0 and the state it returns is the cache's num, den at max = c.
        # (A state below the call's largest exp(k) by more than exp(-87) underflows to 0, where
        # transformers' running max keeps it: it weighs less than that key does.)
        c = k.detach().amax(1)
        if state is None:
            init = None
        else:
            num, den, mx = (s.float() for s in state)
            c = torch.maximum(c, mx)
            rel = torch.exp(mx - c)
            init = {"a": (num * rel)[..., None], "b": den * rel}
        k = k - c[:, None]
        if key.shape[1] == 1 and init is not None:       # decode
            o, st = op.step(k=k[:, 0], v=v[:, 0], w=time_decay, u=time_first, state=init, mode=mode)
            o = o[:, None]
        else:
            o, st = op(k=k, v=v, w=time_decay, u=time_first, initial_state=init, output_final_state=True,
                       mode=mode, **op_kwargs)
        return o[..., 0].to(key.dtype), [_cast_state(st, "a")[..., 0], _cast_state(st, "b"), c]

    return {"rwkv_linear_attention": linear_attention}


_FACTORIES = {
    "gated_delta_rule": _delta_rule_family("gated_delta_rule", "torch_chunk_gated_delta_rule",
                                           "torch_recurrent_gated_delta_rule"),
    "kda": _delta_rule_family("kda", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    "mamba2": _mamba2,
    "mamba": _mamba,
    "rwkv4": _rwkv4,
}

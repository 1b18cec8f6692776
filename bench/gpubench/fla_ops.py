"""flash-linear-attention's chunked ops, called on the same tensors as mixc's library specs.

fla and mixc share the [B, T, H, dim] layout, log-space gates and the default scale
K ** -0.5 (docs/specs/NAME.md, /work/shared/CONVENTIONS.md); the differences are named here:

  linear_attn       fla normalizes by default: normalize=False (mixc's default)
  retention         no gate argument: both take gamma_h = 1 - 2^(-5-h) per head
  rwkv6             r, k, v, w (log decay), u [H, K]: the same names
  delta rules       the same (q, k, v, [g,] beta); the benchmark l2-normalizes k for both
  mamba2            fla's simple_gla path (what fla's Mamba2 layers call): q = C, k = B,
                    v = x * delta, g = delta * A with delta = softplus(dt + dt_bias), scale 1,
                    then + D * x; the softplus and products run in torch inside the timed call

`FLA_NAMES` maps each spec to fla's function; `call(spec, fns, kw)` runs it, with `fns` the
functions by name (fla's, or stand-ins in the tests)."""
from __future__ import annotations

import importlib

FLA_NAMES = {
    "linear_attn": ("fla.ops.linear_attn", "chunk_linear_attn"),
    "retention": ("fla.ops.retention", "chunk_retention"),
    "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
    "gla": ("fla.ops.gla", "chunk_gla"),
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "rwkv6": ("fla.ops.rwkv6", "chunk_rwkv6"),
    "mamba2": ("fla.ops.simple_gla", "chunk_simple_gla"),
}
SPECS = tuple(FLA_NAMES)
# fla's decode path: its fused recurrent kernels at T = 1 with a state in and out (the same
# [B, H, K, V] fp32 state as mixc's S[K, V]; mamba2's S[N, P] through simple_gla's)
FLA_DECODE = {
    "linear_attn": ("fla.ops.linear_attn", "fused_recurrent_linear_attn"),
    "retention": ("fla.ops.retention", "fused_recurrent_retention"),
    "simple_gla": ("fla.ops.simple_gla", "fused_recurrent_simple_gla"),
    "gla": ("fla.ops.gla", "fused_recurrent_gla"),
    "delta_rule": ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "rwkv6": ("fla.ops.rwkv6", "fused_recurrent_rwkv6"),
    "mamba2": ("fla.ops.simple_gla", "fused_recurrent_simple_gla"),
}


def load() -> tuple[dict | None, str]:
    """fla's functions by name, or (None, why not)."""
    fns = {}
    try:
        for module, name in set(FLA_NAMES.values()) | set(FLA_DECODE.values()):
            fns[name] = getattr(importlib.import_module(module), name)
    except Exception as err:                    # noqa: BLE001 - any failure means: no fla columns
        return None, f"fla not importable: {type(err).__name__}: {err}"[:300]
    import fla
    return fns, f"fla {getattr(fla, '__version__', '?')}"


def call(spec: str, fns: dict, kw: dict):
    """fla's output for mixc's keyword arguments kw (inputs and params of the spec)."""
    import torch.nn.functional as F
    f = fns[FLA_NAMES[spec][1]]
    if spec == "linear_attn":
        return f(kw["q"], kw["k"], kw["v"], normalize=False)[0]
    if spec == "retention":
        return f(kw["q"], kw["k"], kw["v"])[0]
    if spec in ("simple_gla", "gla"):
        return f(kw["q"], kw["k"], kw["v"], g=kw["g"])[0]
    if spec == "delta_rule":
        return f(kw["q"], kw["k"], kw["v"], kw["beta"])[0]
    if spec == "gated_delta_rule":
        return f(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])[0]
    if spec == "rwkv6":
        return f(kw["r"], kw["k"], kw["v"], kw["w"], kw["u"])[0]
    if spec == "mamba2":
        import torch
        x, dt, A, D = kw["x"], kw["dt"], kw["A"], kw["D"]
        ct = torch.promote_types(x.dtype, torch.float32)                      # gates in fp32 at least
        delta = F.softplus(dt.to(ct) + kw["dt_bias"].to(ct))                  # [B, T, H]
        o = f(kw["C"], kw["B"], (x * delta[..., None]).to(x.dtype), g=delta * A.to(ct), scale=1.0)[0]
        return o + D[:, None].to(x.dtype) * x
    raise KeyError(f"no fla counterpart for {spec!r}")


def call_step(spec: str, fns: dict, kw: dict, state):
    """fla's decode step: (o [B, 1, H, ...], the new state) for mixc's keyword arguments kw at
    T = 1 ([B, 1, H, ...] inputs) and state [B, H, K, V] (mamba2: [B, H, N, P])."""
    import torch.nn.functional as F
    f = fns[FLA_DECODE[spec][1]]
    io = {"initial_state": state, "output_final_state": True}
    if spec == "linear_attn":
        return f(kw["q"], kw["k"], kw["v"], normalize=False, **io)
    if spec == "retention":
        return f(kw["q"], kw["k"], kw["v"], **io)
    if spec == "simple_gla":
        return f(kw["q"], kw["k"], kw["v"], g=kw["g"], **io)
    if spec == "gla":
        return f(kw["q"], kw["k"], kw["v"], gk=kw["g"], **io)
    if spec == "delta_rule":
        return f(kw["q"], kw["k"], kw["v"], kw["beta"], **io)
    if spec == "gated_delta_rule":
        return f(kw["q"], kw["k"], kw["v"], g=kw["g"], beta=kw["beta"], **io)
    if spec == "rwkv6":
        return f(kw["r"], kw["k"], kw["v"], kw["w"], kw["u"], **io)
    if spec == "mamba2":
        import torch
        x, dt, A, D = kw["x"], kw["dt"], kw["A"], kw["D"]
        ct = torch.promote_types(x.dtype, torch.float32)
        delta = F.softplus(dt.to(ct) + kw["dt_bias"].to(ct))
        o, new = f(kw["C"], kw["B"], (x * delta[..., None]).to(x.dtype), g=delta * A.to(ct), scale=1.0, **io)
        return o + D[:, None].to(x.dtype) * x, new
    raise KeyError(f"no fla decode counterpart for {spec!r}")

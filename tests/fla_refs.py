"""What tests/ops/test_fla_ops*.py compare mixc.ops against: fla 0.6's own pure-torch naive
references and signatures, read from the installed fla package, and recurrences written out
here by hand in float64 (independent of mixc's code and of fla's, so every comparison runs
even without fla).

fla is not a dependency of mixc: .ci/run installs fla-core 0.6.0 (--no-deps) and sets
MIXC_FLA_REQUIRED=1, which turns a missing fla into a failure instead of a skip. The naive
files are loaded by path (they import torch and einops only): `import fla` loads every one of
fla's ops and layers (about 10 s) and warns that Triton is not supported on the CPU."""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import pytest
import torch

FLA_VERSION = "0.6.0"


@lru_cache(maxsize=None)
def _fla_root() -> Path | None:
    spec = importlib.util.find_spec("fla")          # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    version = importlib.metadata.version("fla-core")
    assert version == FLA_VERSION, f"these comparisons are against fla {FLA_VERSION}, found fla-core {version}"
    return Path(list(spec.submodule_search_locations)[0])


def fla_root() -> Path:
    root = _fla_root()
    if root is None:
        if os.environ.get("MIXC_FLA_REQUIRED") == "1":
            pytest.fail("MIXC_FLA_REQUIRED=1 but fla is not installed (pip install --no-deps fla-core==0.6.0 einops)")
        pytest.skip("fla not installed (.ci/run installs fla-core 0.6.0): the comparison with fla's own code")
    return root


@lru_cache(maxsize=None)
def _load(rel: str):
    path = fla_root() / "ops" / f"{rel}.py"
    spec = importlib.util.spec_from_file_location("fla_naive_" + rel.replace("/", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fla_naive(rel: str, name: str):
    """fla's function `name` from fla/ops/<rel>.py (a naive reference: torch and einops only)."""
    fla_root()
    return getattr(_load(rel), name)


def fla_signature(name: str, module: str) -> list[tuple[str, object, str]]:
    """(name, default or '<required>', kind) of each parameter of fla's public function `name`,
    read from its source under `module` (e.g. fla.ops.gla)."""
    folder = fla_root().joinpath(*module.split(".")[1:])
    for path in sorted(folder.rglob("*.py")):
        if "backends" in path.parts or f"def {name}(" not in path.read_text():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                a = node.args
                pos = a.posonlyargs + a.args
                defaults = ["<required>"] * (len(pos) - len(a.defaults)) + [_literal(d) for d in a.defaults]
                out = [(p.arg, d, "positional") for p, d in zip(pos, defaults)]
                out += [(p.arg, "<required>" if d is None else _literal(d), "keyword")
                        for p, d in zip(a.kwonlyargs, a.kw_defaults)]
                return out
    raise LookupError(f"fla 0.6 defines no function {name}")


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


# ---- recurrences written out, float64, [B, T, H, dim] inputs, states [B, H, K, V] ----

def _d(*xs):
    return [None if x is None else x.double() for x in xs]


def kv_loop(q, k, v, logd, scale, h0=None, a=None, b=None, u=None):
    """S = diag(exp(logd)) S + b (a^T S) + k v^T per token (the rank-1 term reads S before the
    token), o = scale q^T S; with u (RWKV-6): o = scale q^T (S_prev + diag(u) k v^T)."""
    q, k, v, logd, a, b, u, h0 = _d(q, k, v, logd, a, b, u, h0)
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if h0 is None else h0.clone()
    o = []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        if u is not None:
            o.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S + u[None, :, :, None] * kv))
        new = logd[:, t, :, :, None].exp() * S + kv
        if a is not None:
            new = new + b[:, t, :, :, None] * torch.einsum("bhk,bhkv->bhv", a[:, t], S)[:, :, None, :]
        S = new
        if u is None:
            o.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    return torch.stack(o, 1), S


def delta_loop(q, ks, vs, betas, logd, scale, h0=None, p=None):
    """S = diag(exp(logd)) S, then one delta step per (k, v, beta) of the token in turn:
    S += beta k (v - p^T S)^T (p = k unless given: comba), o = scale q^T S."""
    q, logd, p, h0 = _d(q, logd, p, h0)
    ks, vs, betas = [_d(*x) for x in (ks, vs, betas)]
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, vs[0].shape[-1], dtype=torch.float64) if h0 is None else h0.clone()
    o = []
    for t in range(T):
        S = logd[:, t, :, :, None].exp() * S
        for k, v, beta in zip(ks, vs, betas):
            read = (p if p is not None else k)[:, t]
            err = v[:, t] - torch.einsum("bhk,bhkv->bhv", read, S)
            S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * err[:, :, None, :]
        o.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    return torch.stack(o, 1), S


def l2(x):
    """fla's use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + 1e-6)."""
    return x / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)


def softmax_attention(q, k, v, scale, window=None):
    q, k, v = _d(q, k, v)
    s = torch.einsum("bthk,bshk->bhts", q * scale, k)
    t = torch.arange(q.shape[1])
    masked = t[None, :] > t[:, None]
    if window is not None:
        masked = masked | (t[:, None] - t[None, :] >= window)
    return torch.einsum("bhts,bshv->bthv", s.masked_fill(masked, float("-inf")).softmax(-1), v)


def based_attention(q, k, v, scale, use_norm=True):
    """o_t = sum_{s <= t} (1 + x + x^2 / 2) v_s, x = scale q_t . k_s, normalized by the weights' sum + 1e-6."""
    q, k, v = _d(q, k, v)
    x = torch.einsum("bthk,bshk->bhts", q * scale, k)
    w = (1 + x + x ** 2 / 2).tril()
    o = torch.einsum("bhts,bshv->bthv", w, v)
    return o / (w.sum(-1).transpose(1, 2)[..., None] + 1e-6) if use_norm else o


def slot_loop(q, k, v, s, g, scale, hk0=None, hv0=None):
    """Gated Slot Attention (Zhang et al. 2024) per head, slots first as the paper writes them:
    K~ = diag(exp(g)) K~ + s k^T [M, K], V~ = diag(exp(g)) V~ + s v^T [M, V], o = V~^T softmax(K~ scale q)
    over the M slots (the max subtracted). States returned in fla's layouts (hk [K, M], hv [M, V])."""
    q, k, v, s, g, hk0, hv0 = _d(q, k, v, s, g, hk0, hv0)
    B, T, H, K = q.shape
    M, V = s.shape[-1], v.shape[-1]
    Kp = torch.zeros(B, H, M, K, dtype=torch.float64) if hk0 is None else hk0.transpose(-1, -2)
    Vp = torch.zeros(B, H, M, V, dtype=torch.float64) if hv0 is None else hv0
    out = []
    for t in range(T):
        alpha = g[:, t].exp()[..., None]
        Kp = alpha * Kp + s[:, t, :, :, None] * k[:, t, :, None, :]
        Vp = alpha * Vp + s[:, t, :, :, None] * v[:, t, :, None, :]
        logits = torch.einsum("bhmk,bhk->bhm", Kp, scale * q[:, t])
        p = torch.exp(logits - logits.max(-1, keepdim=True).values)
        out.append(torch.einsum("bhmv,bhm->bhv", Vp, p / p.sum(-1, keepdim=True)))
    return torch.stack(out, 1), (Kp.transpose(-1, -2), Vp)


def abc_gate(s):
    """fla's g=None for GSA (ABC): s~ = exp(s - z), g_t = z_{t-1} - z_t (0 at t = 0), z the running
    logsumexp of s over T (float64, one sequence per row)."""
    s = s.double()
    z = torch.logcumsumexp(s, 1)
    return torch.exp(s - z), torch.cat([torch.zeros_like(z[:, :1]), z[:, :-1] - z[:, 1:]], 1)

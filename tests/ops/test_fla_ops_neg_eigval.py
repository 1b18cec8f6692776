"""Negative eigenvalues through mixc.ops (Grazzi et al. 2025): fla 0.6's allow_neg_eigval
(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda, fused_recurrent_kda take
raw beta logits with use_beta_sigmoid_in_kernel=True, and beta = 2 sigmoid(x) in (0, 2)), and
the functions without the flag (chunk_delta_rule, fused_recurrent_delta_rule), which take a beta
in (0, 2) as it is (fla's DeltaNet layer doubles its sigmoid). Each called as fla's callers
call it, in the kernels (Triton's interpreter: chunk_* the chunked form, fused_recurrent_* the
recurrent one): output and final state against fla's own naive reference with the same betas
and against a float64 loop (tests/fla_refs.py), and the gradients of every input (the raw
logits' included, through 2 sigmoid) and of the initial state against the loop's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixc.ops as ops
from fla_refs import delta_loop, fla_naive

from helpers import case_id

B, T, H, K, V = 1, 20, 2, 8, 6
SHAPE = case_id(B=B, T=T, H=H, K=K, V=V)
SCALE = K ** -0.5


def _draw(seed, per_key_gate):
    gen = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=gen)           # noqa: E731
    g = F.logsigmoid(n(B, T, H, *((K,) if per_key_gate else ())) + 2.0)
    x = dict(q=n(B, T, H, K), k=F.normalize(n(B, T, H, K), dim=-1), v=n(B, T, H, V), g=g,
             raw=1.5 * n(B, T, H), h0=0.5 * n(B, H, K, V))
    assert (2 * torch.sigmoid(x["raw"]) > 1.2).any()        # some eigenvalues 1 - beta well below 0
    return {k: t.requires_grad_() for k, t in x.items()}


def _call(name, x):
    """fla's call with raw beta logits (the flagged functions) or with beta in (0, 2) itself."""
    kw = dict(initial_state=x["h0"], output_final_state=True)
    if "delta_rule" in name and "gated" not in name:
        return getattr(ops, name)(x["q"], x["k"], x["v"], 2 * torch.sigmoid(x["raw"]), **kw)
    flags = dict(kw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    if name == "fused_recurrent_gated_delta_rule":            # g, gk, gv, beta by position there
        return getattr(ops, name)(x["q"], x["k"], x["v"], x["g"], None, None, x["raw"], **flags)
    return getattr(ops, name)(x["q"], x["k"], x["v"], x["g"], x["raw"], **flags)


def _fla(name, x):
    beta = 2 * torch.sigmoid(x["raw"].detach())
    q, k, v, g, h0 = (x[n].detach() for n in ("q", "k", "v", "g", "h0"))
    if "kda" in name:
        return fla_naive("kda/naive", "naive_recurrent_kda")(q, k, v, g, beta, initial_state=h0,
                                                             output_final_state=True)
    if "gated" in name:
        return fla_naive("gated_delta_rule/naive", "naive_recurrent_gated_delta_rule")(
            q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o, S = fla_naive("delta_rule/naive", "delta_rule_recurrence")(
        *(t.transpose(1, 2) for t in (q, k, v, beta)), initial_state=h0, output_final_state=True)
    return o.transpose(1, 2), S


def _loop(name, x):
    g = x["g"] if "kda" in name else x["g"][..., None].expand(B, T, H, K)
    if "gated" not in name and "kda" not in name:
        g = torch.zeros(B, T, H, K)                           # the plain delta rule: no decay
    return delta_loop(x["q"], [x["k"]], [x["v"]], [2 * torch.sigmoid(x["raw"].double())], g, SCALE, x["h0"])


def _close(got, want, what, tol):
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    assert err <= tol * (1 + want.detach().abs().max().item()), f"{what}: max error {err:.3g}"


NAMES = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda",
         "chunk_delta_rule", "fused_recurrent_delta_rule"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n.startswith("chunk") else [pytest.mark.slow])
                                  for n in NAMES], ids=lambda n: f"{n}-{SHAPE}")
def test_negative_eigenvalues_match_fla_and_the_loop(name):
    x = _draw(sum(map(ord, name)), per_key_gate="kda" in name)
    o, S = _call(name, x)
    o_l, S_l = _loop(name, x)
    _close(o, o_l, f"{name}: output vs the float64 loop", 1e-5)
    _close(S, S_l, f"{name}: final state vs the float64 loop", 1e-5)
    gen = torch.Generator().manual_seed(7)
    wo, ws = torch.randn(o_l.shape, generator=gen, dtype=torch.float64), torch.randn(S_l.shape, generator=gen,
                                                                                       dtype=torch.float64)
    leaves = [x[n] for n in ("q", "k", "v", "g", "raw", "h0")]
    got = torch.autograd.grad((o.double() * wo).sum() + (S.double() * ws).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((o_l * wo).sum() + (S_l * ws).sum(), leaves, allow_unused=True)
    for leaf, a, b in zip(("q", "k", "v", "g", "raw", "h0"), got, want):
        if b is None:                                         # the plain delta rule reads no g
            assert a is None or a.abs().max() == 0, f"{name}: d/d {leaf} should be zero"
            continue
        _close(a, b, f"{name}: d/d {leaf} vs the float64 loop", 1e-4)
    o_f, S_f = _fla(name, x)                  # skips here where fla is not installed
    _close(o, o_f, f"{name}: output vs fla's naive reference", 2e-4)
    _close(S, S_f, f"{name}: final state vs fla's naive reference", 2e-4)


def test_allow_neg_eigval_doubles_the_sigmoid():
    """The flag is read, not ignored: without it the same logits give beta = sigmoid(x), a
    different system (fla's kernels: beta = sigmoid(x) * (2 if allow_neg_eigval else 1))."""
    x = _draw(3, per_key_gate=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["raw"])
    o2, _ = ops.chunk_gated_delta_rule(*args, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, mode="torch")
    o1, _ = ops.chunk_gated_delta_rule(*args, use_beta_sigmoid_in_kernel=True, mode="torch")
    half = delta_loop(x["q"], [x["k"]], [x["v"]], [torch.sigmoid(x["raw"].double())],
                      x["g"][..., None].expand(B, T, H, K), SCALE)[0]
    _close(o1, half, "allow_neg_eigval=False: beta = sigmoid(x)", 1e-5)
    assert (o2.double() - o1.double()).abs().max() > 1e-2

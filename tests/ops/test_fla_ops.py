"""mixc.ops runs a call site written for fla 0.6: every function, called as fla's callers call
it (positional tensors, fla's keywords), against fla's own naive reference with the same
arguments and against a recurrence written out in float64 (tests/fla_refs.py), outputs and
final states. The fla half needs fla installed (.ci/run installs it and sets
MIXC_FLA_REQUIRED=1); the float64 half always runs. Under TRITON_INTERPRET=1 (conftest.py)
chunk_* run the chunked kernels and fused_recurrent_* the recurrent ones."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import mixc.ops as ops
from fla_refs import abc_gate, based_attention, delta_loop, fla_naive, kv_loop, l2, slot_loop, softmax_attention

from helpers import case_id

B, T, H, K, V = 2, 20, 2, 8, 6
SHAPE = case_id(B=B, T=T, H=H, K=K, V=V)
SCALE = K ** -0.5


class Draw:
    """Fresh random inputs of one test, by role (never zeros or ones)."""

    def __init__(self, seed: int, heads: int = H):
        self.g = torch.Generator().manual_seed(seed)
        self.H = heads

    def n(self, *shape, s=1.0):
        return torch.randn(*shape, generator=self.g) * s

    def tok(self, d=K, heads=None):
        return self.n(B, T, heads or self.H, d)

    def logd(self, *dims, heads=None):                 # a log decay in (-inf, 0), mostly near -0.1
        return F.logsigmoid(self.n(B, T, heads or self.H, *dims) + 2.0)

    def beta(self, heads=None):
        return torch.rand(B, T, heads or self.H, generator=self.g) * 0.8 + 0.1

    def unit(self, heads=None):
        return F.normalize(self.tok(heads=heads), dim=-1)

    def h0(self, heads=None, k=K, v=V):
        return self.n(B, heads or self.H, k, v, s=0.5)


def _transpose(*xs):
    return [x.transpose(1, 2) for x in xs]


# ---- one case per function: (fla's call, the float64 expectation, fla's naive reference) ----

def gla_case(fn, r):
    q, k, v, g, h0 = r.tok(), r.tok(), r.tok(V), r.logd(K), r.h0()
    ref = lambda: fla_naive("gla/naive", "naive_recurrent_gla")(q, k, v, g, initial_state=h0, output_final_state=True)
    return (q, k, v, g), dict(initial_state=h0, output_final_state=True), kv_loop(q, k, v, g, SCALE, h0), ref


def simple_gla_case(fn, r):
    q, k, v, g, h0 = r.tok(), r.tok(), r.tok(V), r.logd(), r.h0()
    if fn.__name__ == "parallel_simple_gla":
        ref = lambda: (fla_naive("simple_gla/naive", "naive_parallel_simple_gla")(q, k, v, g, scale=0.3)[0], None)
        return (q, k, v, g, 0.3), {}, (kv_loop(q, k, v, g[..., None].expand(q.shape), 0.3)[0], None), ref
    ref = lambda: fla_naive("simple_gla/naive", "naive_recurrent_simple_gla")(
        q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True)
    exp = kv_loop(q, k, v, g[..., None].expand(q.shape), 0.3, h0)
    return (q, k, v, g, None, 0.3, h0, True), {}, exp, ref


def linear_attn_case(fn, r):
    # positive q and k, as a feature map gives them: the normalizer q . (sum of k) stays away from 0
    q, k, v, h0 = r.tok().abs() + 0.1, r.tok().abs() + 0.1, r.tok(V), r.h0()
    normalize = fn.__name__ != "fused_recurrent_linear_attn"           # fla's defaults
    o, S = kv_loop(q, k, v, torch.zeros_like(q), SCALE, h0)
    ref = lambda: fla_naive("linear_attn/naive", "naive_recurrent_linear_attn")(
        q, k, v, initial_state=h0, output_final_state=True, normalize=normalize)
    if normalize:               # fla returns (S, z) with z the running key sum [N, 1, H, K]
        z = k.double().cumsum(1)
        o = o / ((q.double() * SCALE * z).sum(-1, keepdim=True) + 1e-10)
        S = (S, z[:, -1:])
    return (q, k, v), dict(initial_state=h0, output_final_state=True), (o, S), ref


def retention_case(fn, r):
    q, k, v, h0 = r.tok(), r.tok(), r.tok(V), r.h0()
    logd = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64)))[None, None, :, None].expand(q.shape)
    ref = lambda: (fla_naive("retention/naive", "naive_retention")(*_transpose(q, k, v)).transpose(1, 2), None)
    if fn.__name__ == "parallel_retention":
        return (q, k, v), {}, (kv_loop(q, k, v, logd, SCALE)[0], None), ref
    # fla's naive retention takes no state: it checks the output from a zero state
    return (q, k, v), dict(output_final_state=True), kv_loop(q, k, v, logd, SCALE), ref


def lightning_case(fn, r):
    q, k, v, h0 = r.tok(), r.tok(), r.tok(V), r.h0()
    rate = -(8 / H) * (1 - 1 / 4) * torch.arange(H, dtype=torch.float64)      # layer 1 of 4
    exp = kv_loop(q, k, v, rate[None, None, :, None].expand(q.shape), SCALE, h0)
    # fla computes it as chunk_simple_gla with g_gamma = that rate: its naive simple_gla with g
    ref = lambda: fla_naive("simple_gla/naive", "naive_recurrent_simple_gla")(
        q, k, v, rate.float()[None, None].expand(B, T, H), initial_state=h0, output_final_state=True)
    return (q, k, v, 1, 4), dict(initial_state=h0, output_final_state=True), exp, ref


def rwkv6_case(fn, r):
    q, k, v, w, u, h0 = r.tok(), r.tok(), r.tok(V), r.logd(K), r.n(H, K), r.h0()
    ref = lambda: [x.transpose(1, 2) if i == 0 else x for i, x in enumerate(
        fla_naive("rwkv6/recurrent_naive", "naive_recurrent_rwkv6")(
            *_transpose(q, k, v, w), u, scale=0.5, initial_state=h0, output_final_state=True))]
    return (q, k, v, w, u, 0.5, h0, True), {}, kv_loop(q, k, v, w, 0.5, h0, u=u), ref


def hgrn_case(fn, r):
    x, g, h0 = r.n(B, T, K), F.logsigmoid(r.n(B, T, K) + 2.0), r.n(B, K)
    h, o = h0.double(), []
    for t in range(T):
        h = g[:, t].double().exp() * h + x[:, t]
        o.append(h)
    ref = lambda: fla_naive("hgrn/naive", "naive_recurrent_hgrn")(x, g, initial_state=h0, output_final_state=True)
    return (x, g, h0, True), {}, (torch.stack(o, 1), h), ref


def dplr_case(fn, r):
    """rwkv7 and fla's dplr / iplr rules: a = -kk, b = kk * sigmoid (bounded, as RWKV-7's)."""
    q, k, v, h0 = r.tok(), r.tok(), r.tok(V), r.h0()
    w = r.logd(K) if "iplr" not in fn.__name__ else torch.zeros(B, T, H, K)
    kk, s = r.unit(), torch.sigmoid(r.tok())
    a, b = -kk, kk * s
    exp = kv_loop(q, k, v, w, SCALE, h0, a=a, b=b)
    naive = (fla_naive("generalized_delta_rule/iplr/naive", "iplr_recurrence") if "iplr" in fn.__name__ else
             lambda q, k, v, a, b, initial_state, output_final_state: fla_naive(
                 "generalized_delta_rule/dplr/naive", "dplr_recurrence")(q, k, v, a, b, w.transpose(1, 2),
                                                                         initial_state, output_final_state))
    ref = lambda: [x.transpose(1, 2) if i == 0 else x for i, x in enumerate(
        naive(*_transpose(q, k, v, a, b), initial_state=h0, output_final_state=True))]
    kw = dict(initial_state=h0, output_final_state=True)
    if fn.__name__ == "fused_mul_recurrent_rwkv7":        # takes kk and a: the update's a = -kk, b = kk * a
        return (q, w, k, v, kk, s, SCALE), kw, exp, ref
    if "rwkv7" in fn.__name__:                              # r, w, k, v, a, b; scale passed (chunk's default is 1)
        return (q, w, k, v, a, b, SCALE), kw, exp, ref
    if "iplr" in fn.__name__:
        return (q, k, v, a, b), kw, exp, ref
    return (q, k, v, a, b, w), kw, exp, ref


def delta_case(fn, r):
    q, k, v, beta, h0 = r.tok(), r.unit(), r.tok(V), r.beta(), r.h0()
    ref = lambda: [x.transpose(1, 2) if i == 0 else x for i, x in enumerate(fla_naive(
        "delta_rule/naive", "delta_rule_recurrence")(*_transpose(q, k, v, beta), initial_state=h0,
                                                       output_final_state=True))]
    exp = delta_loop(q, [k], [v], [beta], torch.zeros_like(q), SCALE, h0)
    return (q, k, v, beta), dict(initial_state=h0, output_final_state=True), exp, ref


def gdn_case(fn, r):
    q, k, v, g, beta, h0 = r.tok(), r.tok(), r.tok(V), r.logd(), r.beta(), r.h0()
    exp = delta_loop(l2(q), [l2(k)], [v], [beta], g[..., None].expand(q.shape), SCALE, h0)
    ref = lambda: fla_naive("gated_delta_rule/naive", "naive_recurrent_gated_delta_rule")(
        l2(q).float(), l2(k).float(), v, beta, g, initial_state=h0, output_final_state=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if fn.__name__.startswith("fused_recurrent"):           # g, gk, gv, beta by position there
        return (q, k, v, g, None, None, beta), kw, exp, ref
    return (q, k, v, g, beta), kw, exp, ref


def kda_case(fn, r):
    """Grouped value heads (fla's GVA): q, k with H heads, v, g, beta and the state with 2 H."""
    q, k, v, g, beta, h0 = r.unit(), r.unit(), r.tok(V, 2 * H), r.logd(K, heads=2 * H), r.beta(2 * H), r.h0(2 * H)
    rep = lambda x: x.repeat_interleave(2, dim=2)
    exp = delta_loop(rep(q), [rep(k)], [v], [beta], g, SCALE, h0)
    ref = lambda: fla_naive("kda/naive", "naive_recurrent_kda")(q, k, v, g, beta, initial_state=h0,
                                                                  output_final_state=True)
    return (q, k, v, g, beta), dict(initial_state=h0, output_final_state=True), exp, ref


def comba_case(fn, r):
    q, k, v, p, g, beta, h0 = r.tok(), r.unit(), r.tok(V), r.unit(), r.logd(), r.beta(), r.h0()
    exp = delta_loop(q, [k], [v], [beta], g[..., None].expand(q.shape), SCALE, h0, p=p)
    ref = lambda: fla_naive("comba/naive", "naive_recurrent_comba")(q, k, v, p, beta, g, initial_state=h0,
                                                                      output_final_state=True)
    kw = dict(initial_state=h0, output_final_state=True)
    if fn.__name__ == "fused_recurrent_comba":               # q, k, p, v there
        return (q, k, p, v, g, beta), kw, exp, ref
    return (q, k, v, p, g, beta), kw, exp, ref


def gdp_case(fn, r):
    q, g, h0 = r.tok(), r.logd(), r.h0()
    k = F.normalize(r.n(B, 2 * T, H, K), dim=-1)             # each token's two keys in turn
    v, beta = r.n(B, 2 * T, H, V), torch.rand(B, 2 * T, H, generator=r.g) * 0.8 + 0.1
    exp = delta_loop(q, [k[:, 0::2], k[:, 1::2]], [v[:, 0::2], v[:, 1::2]], [beta[:, 0::2], beta[:, 1::2]],
                     g[..., None].expand(q.shape), SCALE, h0)
    ref = lambda: fla_naive("gated_delta_product/naive", "naive_recurrent_gated_delta_product")(
        q, k, v, g, beta, SCALE, initial_state=h0, output_final_state=True, num_householder=2)
    return (q, k, v, g, beta, 2), dict(initial_state=h0, output_final_state=True), exp, ref


def based_case(fn, r):
    q, k, v = r.tok(), r.tok(), r.tok(V)
    ref = lambda: (fla_naive("based/naive", "naive_parallel_based")(*_transpose(q, k, v)).transpose(1, 2), None)
    return (q, k, v), {}, (based_attention(q, k, v, SCALE), None), ref


def attn_case(fn, r):
    q, k, v = r.n(B, T, 2 * H, K), r.tok(), r.tok(V)          # grouped query heads (GQA)
    rep = lambda x: x.repeat_interleave(2, dim=2)
    ref = lambda: (fla_naive("attn/naive", "naive_parallel_attn")(q, k, v, window_size=5)[0], None)
    return (q, k, v, None, None, 5), {}, (softmax_attention(q, rep(k), rep(v), SCALE, window=5), None), ref


def gsa_case(fn, r):
    """chunk_gsa with a forget gate g (the paper's GSA); fused_recurrent_gsa with g=None (fla's
    ABC gate from the raw slot scores) and grouped query heads (HQ = 2 H)."""
    M = 5
    abc = fn.__name__ == "fused_recurrent_gsa"
    HQ = 2 * H if abc else H
    q, k, v, s = r.n(B, T, HQ, K), r.tok(), r.tok(V), r.n(B, T, H, M)
    g = None if abc else F.logsigmoid(r.n(B, T, H, M)) / 8
    if not abc:
        s = 1 - g.exp()
    hk0, hv0 = r.n(B, H, K, M, s=0.5), r.n(B, H, M, V, s=0.5)
    s_w, g_w = abc_gate(s) if abc else (s, g)
    rep = lambda x: x.repeat_interleave(HQ // H, dim=2 if x.dim() == 4 and x.shape[1] == T else 1)  # noqa: E731
    o, (hk, hv) = slot_loop(q, rep(k), rep(v), rep(s_w), rep(g_w), SCALE, rep(hk0), rep(hv0))
    exp = (o, (hk[:, ::HQ // H], hv[:, ::HQ // H]))
    ref = lambda: fla_naive("gsa/naive", "naive_recurrent_gsa")(
        q, k, v, s, g, initial_state=(hk0, hv0), output_final_state=True)
    return (q, k, v, s, g), dict(initial_state=(hk0, hv0), output_final_state=True), exp, ref


CASES = {
    "chunk_gsa": gsa_case, "fused_recurrent_gsa": gsa_case,
    "chunk_gla": gla_case, "fused_recurrent_gla": gla_case,
    "chunk_simple_gla": simple_gla_case, "fused_chunk_simple_gla": simple_gla_case,
    "fused_recurrent_simple_gla": simple_gla_case, "parallel_simple_gla": simple_gla_case,
    "chunk_linear_attn": linear_attn_case, "fused_chunk_linear_attn": linear_attn_case,
    "fused_recurrent_linear_attn": linear_attn_case,
    "chunk_retention": retention_case, "fused_chunk_retention": retention_case,
    "fused_recurrent_retention": retention_case, "parallel_retention": retention_case,
    "chunk_lightning_attn": lightning_case, "fused_recurrent_lightning_attn": lightning_case,
    "chunk_rwkv6": rwkv6_case, "fused_recurrent_rwkv6": rwkv6_case,
    "chunk_hgrn": hgrn_case, "fused_recurrent_hgrn": hgrn_case,
    "chunk_rwkv7": dplr_case, "fused_recurrent_rwkv7": dplr_case, "fused_mul_recurrent_rwkv7": dplr_case,
    "chunk_dplr_delta_rule": dplr_case, "fused_recurrent_dplr_delta_rule": dplr_case,
    "chunk_iplr_delta_rule": dplr_case, "fused_recurrent_iplr_delta_rule": dplr_case,
    "chunk_delta_rule": delta_case, "fused_recurrent_delta_rule": delta_case,
    "chunk_gated_delta_rule": gdn_case, "fused_recurrent_gated_delta_rule": gdn_case,
    "chunk_kda": kda_case, "fused_recurrent_kda": kda_case,
    "chunk_comba": comba_case, "fused_recurrent_comba": comba_case,
    "chunk_gated_delta_product": gdp_case,
    "fused_chunk_based": based_case, "parallel_based": based_case, "parallel_attn": attn_case,
}


def test_every_function_has_a_case():
    aliases = {"chunk_gdn", "fused_recurrent_gdn"}           # fla's other names of the same functions
    assert set(CASES) == set(ops.__all__) - aliases
    assert ops.chunk_gdn is ops.chunk_gated_delta_rule and ops.fused_recurrent_gdn is ops.fused_recurrent_gated_delta_rule


def _pairs(got, want):
    """(name, mixc's, expected) of the output and of each state tensor (None where fla has none)."""
    if not isinstance(got, tuple):
        got = (got, None)
    o, st = got
    (wo, wst) = want
    out = [("o", o, wo)]
    if isinstance(wst, (tuple, list)):
        out += [(f"state[{i}]", s, w) for i, (s, w) in enumerate(zip(st, wst))]
    elif wst is not None:       # None: fla's reference takes no state (naive_retention), or it has none
        out.append(("state", st, wst))
    return out


def _close(got, want, what, tol=2e-4):
    for name, x, w in _pairs(got, want):
        assert x.shape == w.shape, f"{what} {name}: shape {list(x.shape)}, expected {list(w.shape)}"
        err = (x.double() - w.double()).abs().max().item()
        ok = err <= tol * (1 + w.double().abs().max().item())
        assert ok, f"{what} {name}: max error {err:.3g} (largest value {w.abs().max().item():.3g})"


@pytest.mark.parametrize("name", sorted(CASES), ids=lambda n: f"{n}-{SHAPE}")
def test_fla_call_site(name):
    fn = getattr(ops, name)
    args, kwargs, expected, fla_ref = CASES[name](fn, Draw(seed=sum(map(ord, name))))
    got = fn(*args, **kwargs)
    _close(got, expected, f"{name} vs the float64 recurrence")
    if expected[1] is None:     # fla returns o alone, or (o, None)
        assert not isinstance(got, tuple) or got[1] is None
    fla = fla_ref()                  # skips here (after the check above) where fla is not installed
    _close(got, fla, f"{name} vs fla's naive reference")


def _pack(x):
    """A batch [B, T', ...] as one packed row [1, B * T', ...] (T' = T, or 2 T for fla's
    interleaved Householder keys); anything else as it is."""
    if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[0] == B and x.shape[1] in (T, 2 * T):
        return x.reshape(1, B * x.shape[1], *x.shape[2:])
    return x


PACKABLE = sorted(n for n in CASES if "cu_seqlens" in inspect.signature(getattr(ops, n)).parameters)


@pytest.mark.slow
@pytest.mark.parametrize("name", PACKABLE, ids=lambda n: f"{n}-{SHAPE}-packed")
def test_packed_sequences_are_the_batch(name):
    """cu_seqlens: the batch's sequences packed in one row give the batch's outputs and states."""
    fn = getattr(ops, name)
    args, kwargs, expected, _ = CASES[name](fn, Draw(seed=sum(map(ord, name)) + 1))
    got = fn(*map(_pack, args), **kwargs, cu_seqlens=torch.tensor([0, T, 2 * T]))
    batch = fn(*args, **kwargs)
    if not isinstance(got, tuple):
        got, batch = (got, None), (batch, None)
    _close(got, (_pack(batch[0]), batch[1]), f"{name} packed vs the batch")

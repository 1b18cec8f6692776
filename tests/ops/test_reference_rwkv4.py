"""The library's rwkv4 spec against a float64 loop written from RWKV-4's WKV as its own code
computes it (transformers' rwkv_linear_attention_cpu, fla's fused_recurrent_rwkv4: the state
kept as (num, den, max) with the real numerator num * exp(max), the output over the scale
max(max, u + k)), never from the spec:

    wkv_t = (sum_{i<t} exp(-(t-1-i) exp(w) + k_i) v_i + exp(u + k_t) v_t)
            / (sum_{i<t} exp(-(t-1-i) exp(w) + k_i)     + exp(u + k_t))

A head is V value channels sharing one key and decay (RWKV-4 itself: V = 1, a head per
channel). The float64 reference and the torch backend in output, final state and every
gradient (the initial state's too); decode token by token with step(); packed sequences
(cu_seqlens) against separate runs; the kernels (Triton's interpreter) within a small factor of
the float32 torch backend's error; and transformers' own function on its layout.
"""
from __future__ import annotations

import pytest
import torch

import mixc
from helpers import case_id
from kernel_checks import check_against_reference

TOL = 1e-10
_OP = []


def _op():
    if not _OP:
        _OP.append(mixc.load("rwkv4"))
    return _OP[0]


def assert_close(got, want, what, tol=TOL):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, want.detach().abs().max().item())
    err = (got.detach().double() - want.detach()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def wkv_loop(args, s0):
    """RWKV-4's WKV in the (num, den, max) form of transformers' rwkv_linear_attention_cpu, in
    the inputs' dtype: k [b, t, h], v [b, t, h, V], w, u [h]; s0 the spec's (unscaled) a [b, h, V],
    b [b, h] or None. Returns (o [b, t, h, V], {"a", "b"} unscaled)."""
    k, v, w, u = args["k"], args["v"], args["w"], args["u"]
    B, T, H, V = v.shape
    if s0 is None:                      # transformers starts at max = -1e38 (no contribution)
        num, den = v.new_zeros(B, H, V), v.new_zeros(B, H)
        mx = v.new_full((B, H), -1e38)
    else:                               # the real state is num exp(max): max = 0 takes it as it is
        num, den, mx = s0["a"], s0["b"], torch.zeros_like(s0["b"])
    log_decay = -torch.exp(w)
    out = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        m_out = torch.maximum(mx, u + kt)
        e1, e2 = torch.exp(mx - m_out), torch.exp(u + kt - m_out)
        out.append((e1[..., None] * num + e2[..., None] * vt) / (e1 * den + e2)[..., None])
        m_new = torch.maximum(mx + log_decay, kt)
        e1, e2 = torch.exp(mx + log_decay - m_new), torch.exp(kt - m_new)
        num, den, mx = e1[..., None] * num + e2[..., None] * vt, e1 * den + e2, m_new
    return torch.stack(out, 1), {"a": num * torch.exp(mx)[..., None], "b": den * torch.exp(mx)}


def make_case(*, B, T, H, V, seed, key_offset=0.0, dtype=torch.float64, requires_grad=False):
    """Keys N(key_offset, 2), values N(0, 1), w such that the decays exp(-exp(w)) spread over
    (0.02, 0.99) as RWKV-4's init does, bonus u N(0.5, 1); an initial state with a positive
    denominator (b, as every reachable one)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    args = {"k": key_offset + 2 * randn(B, T, H), "v": randn(B, T, H, V),
            "w": torch.linspace(-4.5, 1.3, H, dtype=torch.float64) + 0.1 * randn(H), "u": 0.5 + randn(H)}
    s0 = {"a": randn(B, H, V), "b": 0.2 + torch.rand(B, H, generator=gen, dtype=torch.float64)}
    cast = lambda d: {n: t.to(dtype).requires_grad_(requires_grad) for n, t in d.items()}   # noqa: E731
    return cast(args), cast(s0)


def _loss(o, fin, seed=99):
    gen = torch.Generator().manual_seed(seed)
    total = (torch.randn(o.shape, generator=gen, dtype=torch.float64) * o.double()).sum()
    for name in ("a", "b"):
        x = fin[name].double()
        total = total + (torch.randn(x.shape, generator=gen, dtype=torch.float64) * x).sum()
    return total


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_forward_and_gradients_match_loop(mode):
    op = _op()
    args, s0 = make_case(B=2, T=9, H=3, V=2, seed=11, requires_grad=True)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = wkv_loop(args, s0)
    assert o.dtype == torch.float64
    assert_close(o, o_l, f"{mode}: output")
    st_tol = TOL if mode == "reference" else 1e-6
    for name in ("a", "b"):
        assert_close(fin[name], fin_l[name], f"{mode}: final {name}", tol=st_tol)
    leaves = list(args.values()) + list(s0.values())
    names = list(args) + ["initial a", "initial b"]
    g = torch.autograd.grad(_loss(o, fin), leaves)
    g_l = torch.autograd.grad(_loss(o_l, fin_l), leaves)
    for name, a, b in zip(names, g, g_l):
        assert_close(a, b, f"{mode}: d/d {name}", tol=1e-9 if mode == "reference" else 1e-6)


@pytest.mark.parametrize("mode", ["torch", "recurrent"])
def test_keys_past_the_float32_exponent_range(mode):
    """Keys around 100 (exp(k) overflows float32 at 88) from no initial state: the outputs in
    float32 are finite and equal the loop's, since every weight is taken relative to a max."""
    op = _op()
    args, _ = make_case(B=1, T=12, H=2, V=3, seed=13, key_offset=100.0)
    o, _ = op(**{n: t.float() for n, t in args.items()}, mode=mode)
    o_l, _ = wkv_loop(args, None)
    assert torch.isfinite(o).all()
    assert_close(o, o_l, f"{mode}: output with keys near 100", tol=1e-5)


def test_step_matches_loop():
    """Decoding token by token from a random state equals the loop over the sequence."""
    op = _op()
    args, s0 = make_case(B=2, T=5, H=3, V=2, seed=17)
    o_l, fin_l = wkv_loop(args, s0)
    st = s0
    for t in range(5):
        o, st = op.step(k=args["k"][:, t], v=args["v"][:, t], w=args["w"], u=args["u"], state=st)
        assert_close(o, o_l[:, t], f"step {t}", tol=1e-5)
    for name in ("a", "b"):
        assert_close(st[name], fin_l[name], f"{name} after the steps", tol=1e-5)


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_packed_sequences_match_separate_loops(mode):
    op = _op()
    lens = [4, 0, 7, 2]
    args, _ = make_case(B=1, T=sum(lens), H=2, V=2, seed=29)
    _, s0 = make_case(B=len(lens), T=1, H=2, V=2, seed=8)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = {n: t[i:i + 1] for n, t in s0.items()}
        if b == a:                               # an empty sequence keeps its initial state
            for name in ("a", "b"):
                assert_close(fin[name][i:i + 1], init[name], f"{mode}: empty sequence {i} {name}", tol=1e-6)
            continue
        part = dict(args, k=args["k"][:, a:b], v=args["v"][:, a:b])
        o_l, fin_l = wkv_loop(part, init)
        assert_close(o[:, a:b], o_l, f"{mode}: output of sequence {i}")
        for name in ("a", "b"):
            assert_close(fin[name][i:i + 1], fin_l[name], f"{mode}: final {name} of sequence {i}", tol=1e-6)


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "conv"],
                         ids=lambda m: f"{m}-" + case_id(B=1, T=20, H=2, V=8))
def test_kernels_match_loop(mode):
    """Forward, final state and every gradient of the kernels (float32, chunks of 16 over 20
    tokens: a partial last chunk) and of the convolution form against the float64 loop, within
    4x the float32 torch backend's error."""
    op = _op()
    args, s0 = make_case(B=1, T=20, H=2, V=8, seed=31, dtype=torch.float32, requires_grad=True)
    check_against_reference(op, {}, args, s0, torch.float32, mode=mode, chunk=16, formula=wkv_loop)


def test_matches_transformers_rwkv_linear_attention():
    """transformers' RWKV (RWKV-4) layout: time_decay, time_first [C]; key, value [B, T, C]; the
    cached state (num, den, max) [B, C] each. The op on k = key (C heads), v = value[..., None],
    w = time_decay, u = time_first, from the state num * exp(max), equals transformers' own
    function in output and in the real final state num * exp(max)."""
    modeling = pytest.importorskip("transformers.models.rwkv.modeling_rwkv")
    gen = torch.Generator().manual_seed(3)
    B, T, C = 2, 7, 6
    key, value = torch.randn(B, T, C, generator=gen), torch.randn(B, T, C, generator=gen)
    time_decay, time_first = torch.linspace(-4.0, 2.0, C), torch.randn(C, generator=gen)
    state = [torch.randn(B, C, generator=gen), torch.rand(B, C, generator=gen) + 0.1,
             torch.randn(B, C, generator=gen)]
    want, (num, den, mx) = modeling.rwkv_linear_attention_cpu(time_decay, time_first, key, value,
                                                              state=[s.clone() for s in state], return_state=True)
    init = {"a": (state[0] * state[2].exp())[..., None], "b": state[1] * state[2].exp()}
    o, fin = _op()(k=key, v=value[..., None], w=time_decay, u=time_first, initial_state=init,
                   output_final_state=True, mode="torch")
    torch.testing.assert_close(o[..., 0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin["a"][..., 0], num * mx.exp(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin["b"], den * mx.exp(), rtol=1e-5, atol=1e-5)

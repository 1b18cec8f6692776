"""Exponential input gates far beyond exp's fp32 range (|i| up to ~130): the stabilized
kernels (chunked, recurrent, step) and the torch backend stay finite and match the float64
reference in the output and every gradient. Unstabilized, exp(120) is inf in fp32 and the
output NaN. A spec with a gated prefix sum and a prev() readout covers the other paths."""
import pytest
import torch

import mixc
from mixc.pipeline import from_text

from helpers import random_args, random_state
from stabilizer_specs import EXPSUM, RWKV4


def _gates(args, T, seed):
    gen = torch.Generator().manual_seed(seed)
    spikes = torch.where(torch.rand(T, generator=gen) < 0.3, 120.0, -60.0)
    args["i"] = (args["i"].detach() * 3 + spikes[None, :, None].to(args["i"].dtype)).requires_grad_()
    return args


def _ops():
    return {"mlstm": mixc.load("mlstm"), "expsum": from_text(EXPSUM, "expsum.mix")}


CASES = [("mlstm", "chunk"), ("mlstm", "recurrent"), ("expsum", "chunk"), ("expsum", "recurrent")]


def _run(op, args, st, mode, dtype=None):
    """(o, gradients of every input and initial state) of one run, inputs cast to dtype."""
    a = {k: (v.detach().to(dtype) if dtype else v.detach()).requires_grad_() for k, v in args.items()}
    s = {k: (v.detach().to(dtype) if dtype else v.detach()).requires_grad_() for k, v in st.items()} if st else None
    kw = {"CK": 8} if mode == "recurrent" else {"chunk": 16} if mode != "reference" else {}
    o, _ = op(**a, initial_state=s, mode=mode, **kw)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((o.double() * w).sum(), list(a.values()) + (list(s.values()) if s else []))
    return o.double(), [g.double() for g in grads]


def _case(name, with_state):
    op = _ops()[name]
    T = 37
    args, sizes = random_args(op.ir, B=2, T=T, H=2, sizes={"K": 5, "V": 6}, dtype=torch.float32, seed=4)
    args = _gates(args, T, seed=4)
    st = random_state(op.ir, 2, 2, sizes) if with_state else None
    names = ["o"] + [f"d{k}" for k in args] + [f"d initial {k}" for k in (st or {})]
    return op, args, st, names


def _flat(run):
    o, grads = run
    return [o] + grads


@pytest.mark.parametrize("name", ["mlstm", "expsum"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_stabilized_torch_backend_is_exact_in_float64(name, with_state):
    """The stabilized chunked algorithm itself (the torch backend, in float64) equals the
    unstabilized float64 loop, output and every gradient; in fp32 it stays finite."""
    op, args, st, names = _case(name, with_state)
    ref = _flat(_run(op, args, st, "reference", torch.float64))
    got = _flat(_run(op, args, st, "torch", torch.float64))
    for n, g, r in zip(names, got, ref):
        assert (g - r).abs().max() <= 1e-8 * max(r.abs().max().item(), 1.0), n
    assert all(torch.isfinite(x).all() for x in _flat(_run(op, args, st, "torch")))


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_strong_exponential_gates(name, mode, with_state):
    """The kernels in fp32 vs float64, within a small factor of the stabilized torch backend's
    fp32 error (FlexAttention's manner: the output divides by |q . n|, whose fp32 rounding
    every fp32 implementation shares)."""
    op, args, st, names = _case(name, with_state)
    ref = _flat(_run(op, args, st, "reference", torch.float64))
    eager = _flat(_run(op, args, st, "torch"))
    got = _flat(_run(op, args, st, mode))
    for n, g, e, r in zip(names, got, eager, ref):
        assert torch.isfinite(g).all(), f"{n} is not finite"
        # floor: exponents near 120 carry an fp32 rounding of ~120 * 6e-8 = 7e-6 into exp()
        err, allowed = (g - r).abs().max().item(), 4 * (e - r).abs().max().item() + 1e-5 * r.abs().max().item()
        assert err <= allowed, f"{n}: kernel error {err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("mode", ["recurrent", "torch"])
def test_decode_steps_with_strong_gates(mode):
    """Prefill then decode token by token through states given back by the op: equal to one
    pass (the states stay within fp32 here; the gates' spikes come in the decoded tokens)."""
    op = mixc.load("mlstm")
    T, T0 = 12, 5
    args, sizes = random_args(op.ir, B=2, T=T, H=2, sizes={"K": 4, "V": 3}, dtype=torch.float32, seed=9)
    args["i"] = args["i"] * 2
    args["i"][:, T0 + 1] += 70.0
    args["i"][:, T0 + 3] += 75.0
    full, _ = op(**args, mode="reference")
    o, state = op(**{k: v[:, :T0] for k, v in args.items()}, output_final_state=True, mode=mode)
    outs = [o]
    for t in range(T0, T):
        o_t, state = op.step(**{k: v[:, t] for k, v in args.items()}, state=state, mode=mode)
        assert torch.isfinite(o_t).all()
        outs.append(o_t[:, None])
    torch.testing.assert_close(torch.cat(outs, 1).double(), full, rtol=1e-4, atol=1e-4)


def _rwkv4_args(T, seed):
    """RWKV-4's inputs with u + k up to ~200 (exp overflows fp32 at 88). Head 0: k falls from
    200 by about the decay per token (log decay -exp(w) ~ -17), so the state before a token and
    its own exp(u + k) weigh alike, and the final state is back within fp32; head 1: the bonus u
    ~ 180 alone overflows (u + k ~ 190) beside small states (k ~ 10)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    t = torch.arange(T, dtype=torch.float64)
    k = torch.stack([(200 - 17 * t).clamp(min=0), torch.full((T,), 10.0)], -1) + 3 * randn(T, 2)
    args = {"k": k[None], "v": randn(1, T, 2, 4),
            "w": torch.tensor([17.0, 1.0], dtype=torch.float64).log() + 0.3 * randn(2),
            "u": torch.tensor([0.0, 180.0], dtype=torch.float64) + randn(2)}
    init = {"a": randn(1, 2, 4), "b": torch.rand(1, 2, generator=gen, dtype=torch.float64) + 0.5}
    return args, init


def _rwkv4_by_hand(k, v, w, u, a0, b0):
    """RWKV-4's WKV in float64 as its own kernel computes it (log-sum-exp form): the states
    kept as a exp(-p), b exp(-p) with p their running max exponent, the output over the
    scale max(p, u + k). Returns (o [B, T, H, V], final a, final b)."""
    aa, bb, pp = a0, b0, torch.zeros_like(b0)
    outs = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        ww = u + kt
        p = torch.maximum(pp, ww)
        e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
        outs.append((e1[..., None] * aa + e2[..., None] * vt) / (e1 * bb + e2)[..., None])
        ww = pp - torch.exp(w)
        p = torch.maximum(ww, kt)
        e1, e2 = torch.exp(ww - p), torch.exp(kt - p)
        aa, bb, pp = e1[..., None] * aa + e2[..., None] * vt, e1 * bb + e2, p
    return torch.stack(outs, 1), aa * torch.exp(pp)[..., None], bb * torch.exp(pp)


RWKV4_MODES = [("reference", {}), ("torch", {"chunk": 8}), ("recurrent", {"CK": 8}), ("chunk", {"chunk": 16}),
               ("conv", {})]


@pytest.mark.parametrize("mode,kw", RWKV4_MODES, ids=[f"B1-T20-H2-V4-{m}" for m, _ in RWKV4_MODES])
def test_rwkv4_exponential_in_the_output_is_stabilized(mode, kw):
    """RWKV-4 as a spec, (prev(a) + exp(u + k) * v) / (prev(b) + exp(u + k)), with u + k up to
    ~200 in float32 (issue 19 item 4: inf / inf = NaN in every fp32 mode): the output takes the
    scale M = max(m, u + k), so the forward, the final state and every gradient (inputs, params,
    initial state) are finite and equal RWKV-4's own WKV written by hand in float64."""
    args, init = _rwkv4_args(T=20, seed=5)
    _check_rwkv4(args, init, mode, kw)


@pytest.mark.parametrize("u", [-200.0, -100.0, -90.0])
@pytest.mark.parametrize("mode,kw", RWKV4_MODES[1:], ids=[f"B1-T20-H2-V4-{m}" for m, _ in RWKV4_MODES[1:]])
def test_rwkv4_with_a_bonus_far_below_zero(mode, kw, u):
    """u below -87 (exp(u) is 0 in fp32) with the keys of the test above, whose k jumps past
    the history by far: the readouts of prev(a~), prev(b~) were taken relative to m_t (whose
    k_t dominates), where they underflow with exp(u + k - m_t), so 0 / 0 in the chunked forms
    (torch, chunk, conv); they are at their own scale m_{t-1} now, as in the recurrence."""
    args, init = _rwkv4_args(T=20, seed=5)
    args["u"] = u + torch.tensor([0.3, -0.2], dtype=torch.float64)
    _check_rwkv4(args, init, mode, kw)


@pytest.mark.parametrize("keys", ["normal", "far below 0"])
@pytest.mark.parametrize("u", [-200.0, -100.0, 0.0, 50.0])
def test_rwkv4_without_an_initial_state(u, keys):
    """No initial state: at t = 0 the output is v_0 (prev(a) = prev(b) = 0), in float64
    exp(u + k) v / exp(u + k). m started at 0, so M = max(0, u + k) and that only term was
    exp(u + k - M) = 0 for u + k < -103: 0 / 0 in every fp32 mode (recurrent too); keys far
    below 0 (k ~ -100) were lost from the state (exp(k - m) = 0 with m near 0): the output
    wrong or 0 / 0. m now starts below any log weight (derive/stabilize.py M_EMPTY); the
    chunk kernels' padded rows weigh nothing in the update (their exp(0 - m) overflowed once m
    fell below -88: NaN final states). B1-T20-H2-V4 against mode='reference' in float64:
    output, final states, every gradient."""
    op = from_text(RWKV4, "rwkv4.mix")
    T = 20
    args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"V": 4}, dtype=torch.float64, seed=12)
    if keys == "far below 0":
        args["k"] = args["k"] - 100.0
    args["u"] = u + args["u"]
    gen = torch.Generator().manual_seed(13)
    wo = torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64)
    wa, wb = torch.randn(1, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 2, generator=gen,
                                                                                     dtype=torch.float64)

    def run(mode, dtype, **kw):
        x = {n: t.to(dtype).requires_grad_() for n, t in args.items()}
        o, st = op(**x, output_final_state=True, mode=mode, **kw)
        # the final states weigh as o does; they are ~exp(k), 1e-44 for the keys far below 0:
        # below fp32's normal range, where they have few bits, so they weigh nothing there
        loss = (o.double() * wo).sum() + finals * ((st["a"].double() * wa).sum() / ref_a +
                                                   (st["b"].double() * wb).sum() / ref_b)
        return [o, st["a"], st["b"]] + list(torch.autograd.grad(loss, list(x.values())))

    ref_st = op(**args, output_final_state=True, mode="reference")[1]
    ref_a, ref_b = ref_st["a"].abs().max().item(), ref_st["b"].abs().max().item()
    finals = float(ref_b > 1e-37)    # 1: the final states are within fp32's normal range: weighed, checked
    ref = run("reference", torch.float64)
    names = ["o", "final a", "final b"] + [f"d{n}" for n in args]
    for mode, kw in RWKV4_MODES[1:]:
        for n, g, r in zip(names, run(mode, torch.float32, **kw), ref):
            g = g.double()
            assert torch.isfinite(g).all(), f"{mode}: {n} is not finite"
            if n.startswith("final") and not finals:
                continue
            scale = r.abs().max().item() if n.startswith("final") else max(r.abs().max().item(), 1.0)
            assert (g - r).abs().max().item() <= 1e-4 * scale, f"{mode}: {n}"


def _check_rwkv4(args, init, mode, kw):
    """The op in fp32 against _rwkv4_by_hand in float64: output, final states and every
    gradient finite and within 2e-4 of each one's scale (at least 1)."""
    op = from_text(RWKV4, "rwkv4.mix")
    T = args["k"].shape[1]
    gen = torch.Generator().manual_seed(6)
    wo = torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64)
    wa, wb = torch.randn(1, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 2, generator=gen,
                                                                                     dtype=torch.float64)

    x = {n: t.clone().requires_grad_() for n, t in list(args.items()) + list(init.items())}
    o, a, b = _rwkv4_by_hand(x["k"], x["v"], x["w"], x["u"], x["a"], x["b"])
    wa, wb = wa / a.abs().amax().item(), wb / b.abs().amax().item()    # the final states weigh as o does

    def loss(o, a, b):
        return (o.double() * wo).sum() + (a.double() * wa).sum() + (b.double() * wb).sum()

    ref = [o, a, b] + list(torch.autograd.grad(loss(o, a, b), list(x.values())))

    y = {n: t.float().requires_grad_() for n, t in list(args.items()) + list(init.items())}
    o, st = op(**{n: y[n] for n in args}, initial_state={"a": y["a"], "b": y["b"]}, output_final_state=True,
               mode=mode, **kw)
    got = [o, st["a"], st["b"]] + list(torch.autograd.grad(loss(o, st["a"], st["b"]), list(y.values())))
    names = ["o", "final a", "final b"] + [f"d{n}" for n in y]
    for n, g, r in zip(names, got, ref):
        g = g.double()
        assert torch.isfinite(g).all(), f"{n} is not finite"
        err, scale = (g - r).abs().max().item(), r.abs().max().item()
        # exponents near 200 carry an fp32 rounding of ~200 * 6e-8 = 1.2e-5 into each exp (the
        # inputs' own rounding: mode='reference' on the float32 inputs is 1.3e-5 off in dw)
        assert err <= 2e-4 * max(scale, 1.0), f"{n}: error {err:.3g} against {scale:.3g}"

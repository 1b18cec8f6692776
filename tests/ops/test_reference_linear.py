"""The float64 reference of the linear-attention family against independent closed forms.

Each system below is checked against a formula written here from its paper / fla, in the
parallel (masked, quadratic in T) form or with cumulative sums and products: never the
spec's own loop. Covered: linear_attn (normalize off and on), linear_transformer, performer,
based (use_norm on and off), retention, simple_gla, gla, hgrn, aft_simple.

Per system: the forward output and final state, an initial state (its contribution in
closed form), gradients of every input, param and the initial state, gradcheck on tiny
inputs, reference_step token by token, and packed sequences (cu_seqlens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import mixc
from helpers import case_id, random_args, random_state

TOL = 1e-10


# --------------------------------------------------------------------------------------
# helpers

def _positive(shape, gen, dtype=torch.float64):
    """Positive features (for the normalized variants, so that no denominator is near 0)."""
    return torch.rand(shape, generator=gen, dtype=dtype) * 0.9 + 0.1


def _causal(T, device=None):
    """[T, T] lower-triangular (t >= s) mask as float64."""
    return torch.tril(torch.ones(T, T, dtype=torch.float64, device=device))


def assert_close(got, want, what, tol=TOL):
    """|got - want| <= tol * max(1, max |want|): absolute for O(1) values, relative when large."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    err = (got.detach() - want.detach()).abs().max().item() if want.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def _s0(s0, name, like):
    """The initial state `name`, or zeros shaped like `like`."""
    return torch.zeros_like(like) if s0 is None else s0[name]


# --------------------------------------------------------------------------------------
# closed forms: f(args, opts, s0) -> (o [B, T, H, *], final state dict)
# `opts` holds every option value (defaults filled in by the case).

def cf_linear_attn(a, opts, s0):
    q, k, v = a["q"], a["k"], a["v"]
    T = q.shape[1]
    qs = opts["scale"] * q
    A = torch.einsum("bthk,bshk->bhts", qs, k) * _causal(T)            # scale Q K^T, causal
    S0 = _s0(s0, "S", torch.einsum("bthk,bthv->bhkv", k, v))
    z0 = _s0(s0, "z", k.sum(1))
    num = torch.einsum("bhts,bshv->bthv", A, v) + torch.einsum("bthk,bhkv->bthv", qs, S0)
    if opts["normalize"]:
        den = A.sum(-1).transpose(1, 2) + torch.einsum("bthk,bhk->bth", qs, z0) + 1e-10
        o = num / den[..., None]
    else:
        o = num
    final = {"S": S0 + torch.einsum("bthk,bthv->bhkv", k, v), "z": z0 + k.sum(1)}
    return o, final


def _elu1(x):
    return torch.where(x > 0, x + 1.0, torch.exp(x))


def _normalized_linear(fq, fk, v, S0, z0, eps):
    """o_t = (phi_q,t^T (S0 + sum_{s<=t} phi_k,s v_s^T)) / (phi_q,t . (z0 + sum_{s<=t} phi_k,s) + eps)."""
    T = fq.shape[1]
    A = torch.einsum("bthm,bshm->bhts", fq, fk) * _causal(T)
    num = torch.einsum("bhts,bshv->bthv", A, v) + torch.einsum("bthm,bhmv->bthv", fq, S0)
    den = A.sum(-1).transpose(1, 2) + torch.einsum("bthm,bhm->bth", fq, z0) + eps
    final = {"S": S0 + torch.einsum("bthm,bthv->bhmv", fk, v), "z": z0 + fk.sum(1)}
    return num / den[..., None], final


def cf_linear_transformer(a, opts, s0):
    fq, fk, v = _elu1(a["q"]), _elu1(a["k"]), a["v"]
    S0 = _s0(s0, "S", torch.einsum("bthk,bthv->bhkv", fk, v))
    z0 = _s0(s0, "z", fk.sum(1))
    return _normalized_linear(fq, fk, v, S0, z0, opts["eps"])


def _favor(x, W):
    """FAVOR+ positive random features: exp(w_m . x' - |x'|^2 / 2) / sqrt(M), x' = x / K^(1/4)."""
    K, M = x.shape[-1], W.shape[-2]
    xs = x / K ** 0.25
    proj = torch.einsum("hmk,bthk->bthm", W, xs)
    return torch.exp(proj - 0.5 * (xs ** 2).sum(-1, keepdim=True)) / math.sqrt(M)


def cf_performer(a, opts, s0):
    fq, fk, v = _favor(a["q"], a["W"]), _favor(a["k"], a["W"]), a["v"]
    S0 = _s0(s0, "S", torch.einsum("bthm,bthv->bhmv", fk, v))
    z0 = _s0(s0, "z", fk.sum(1))
    return _normalized_linear(fq, fk, v, S0, z0, opts["eps"])


def cf_based(a, opts, s0):
    q, k, v = a["q"], a["k"], a["v"]
    B, T, H, K = q.shape
    V = v.shape[-1]
    qs = opts["scale"] * q
    s = torch.einsum("bthk,bshk->bhts", qs, k)
    A = (1.0 + s + 0.5 * s * s) * _causal(T)                            # Taylor of exp, causal
    z = dict(s0=torch.zeros(B, H, V), s1=torch.zeros(B, H, K, V), s2=torch.zeros(B, H, K, K, V),
             z0=torch.zeros(B, H), z1=torch.zeros(B, H, K), z2=torch.zeros(B, H, K, K))
    st = {n: (x.double() if s0 is None else s0[n]) for n, x in z.items()}
    # the initial state's part of phi(q) . [state]
    num0 = (st["s0"][:, None] + torch.einsum("bthk,bhkv->bthv", qs, st["s1"])
            + 0.5 * torch.einsum("bthk,bthj,bhkjv->bthv", qs, qs, st["s2"]))
    den0 = (st["z0"][:, None] + torch.einsum("bthk,bhk->bth", qs, st["z1"])
            + 0.5 * torch.einsum("bthk,bthj,bhkj->bth", qs, qs, st["z2"]))
    num = torch.einsum("bhts,bshv->bthv", A, v) + num0
    if opts["use_norm"]:
        o = num / (A.sum(-1).transpose(1, 2) + den0 + 1e-6)[..., None]
    else:
        o = num
    final = {
        "s0": st["s0"] + v.sum(1),
        "s1": st["s1"] + torch.einsum("bthk,bthv->bhkv", k, v),
        "s2": st["s2"] + torch.einsum("bthk,bthj,bthv->bhkjv", k, k, v),
        "z0": st["z0"] + T,
        "z1": st["z1"] + k.sum(1),
        "z2": st["z2"] + torch.einsum("bthk,bthj->bhkj", k, k),
    }
    return o, final


def _decay_attention(q, k, v, b, S0, scale):
    """Scalar decay per (t, head): o_t = scale q_t . sum_{s<=t} exp(b_t - b_s) k_s v_s^T
    + exp(b_t) scale q_t^T S0, with b [B, T, H] the cumulative log decay (b_t includes g_t)."""
    T = q.shape[1]
    bt = b.transpose(1, 2)                                            # [B, H, T]
    diff = bt[..., :, None] - bt[..., None, :]                        # b_t - b_s
    mask = _causal(T).bool()
    D = torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    A = torch.einsum("bthk,bshk->bhts", scale * q, k) * D
    o = torch.einsum("bhts,bshv->bthv", A, v)
    o = o + torch.exp(b)[..., None] * torch.einsum("bthk,bhkv->bthv", scale * q, S0)
    bT = b[:, -1]                                                     # [B, H]
    w = torch.exp(bT[:, None] - b)                                    # exp(b_T - b_s)
    S = torch.exp(bT)[..., None, None] * S0 + torch.einsum("bth,bthk,bthv->bhkv", w, k, v)
    return o, {"S": S}


def cf_retention(a, opts, s0):
    q, k, v = a["q"], a["k"], a["v"]
    B, T, H, _ = q.shape
    gamma = torch.tensor([1.0 - 2.0 ** (-5.0 - h) for h in range(H)], dtype=torch.float64)
    # b_t = (t + 1) log gamma_h (t 0-based: t + 1 decays applied after t + 1 tokens)
    b = (torch.arange(1, T + 1, dtype=torch.float64)[:, None] * torch.log(gamma)[None]).expand(B, T, H)
    S0 = _s0(s0, "S", torch.einsum("bthk,bthv->bhkv", k, v))
    return _decay_attention(q, k, v, b, S0, opts["scale"])


def cf_simple_gla(a, opts, s0):
    q, k, v, g = a["q"], a["k"], a["v"], a["g"]
    S0 = _s0(s0, "S", torch.einsum("bthk,bthv->bhkv", k, v))
    return _decay_attention(q, k, v, torch.cumsum(g, dim=1), S0, opts["scale"])


def cf_gla(a, opts, s0):
    q, k, v, g = a["q"], a["k"], a["v"], a["g"]
    T = q.shape[1]
    scale = opts["scale"]
    b = torch.cumsum(g, dim=1)                                         # [B, T, H, K]
    diff = b[:, :, None] - b[:, None, :]                               # [B, t, s, H, K]: b_t - b_s
    mask = _causal(T).bool()[None, :, :, None, None]
    D = torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    A = torch.einsum("bthk,bshk,btshk->bhts", scale * q, k, D)         # sum_d q_td k_sd exp(b_td - b_sd)
    S0 = _s0(s0, "S", torch.einsum("bthk,bthv->bhkv", k, v))
    o = torch.einsum("bhts,bshv->bthv", A, v) + torch.einsum("bthk,bhkv->bthv", scale * q * torch.exp(b), S0)
    bT = b[:, -1]                                                      # [B, H, K]
    S = torch.exp(bT)[..., None] * S0 + torch.einsum("bthk,bthv->bhkv", torch.exp(bT[:, None] - b) * k, v)
    return o, {"S": S}


def cf_hgrn(a, opts, s0):
    x, g = a["x"], a["g"]
    T = x.shape[1]
    # h_t = P_t h0 + sum_{s<=t} (P_t / P_s) x_s with P the running product of the gates.
    P = torch.cumprod(torch.exp(g), dim=1)                             # [B, T, H, D]
    h0 = _s0(s0, "h", x[:, 0])
    ratio = P[:, :, None] / P[:, None, :]                              # [B, t, s, H, D]
    h = P * h0[:, None] + torch.einsum("btshd,bshd->bthd", ratio * _causal(T)[None, :, :, None, None], x)
    return h, {"h": h[:, -1]}


def cf_aft_simple(a, opts, s0):
    q, k, v = a["q"], a["k"], a["v"]
    w = torch.exp(k)
    num0, den0 = _s0(s0, "num", v[:, 0]), _s0(s0, "den", v[:, 0])
    num = num0[:, None] + torch.cumsum(w * v, dim=1)
    den = den0[:, None] + torch.cumsum(w, dim=1)
    y = num / den / (1.0 + torch.exp(-q))
    return y, {"num": num[:, -1], "den": den[:, -1]}


# --------------------------------------------------------------------------------------
# cases

@dataclass
class Case:
    id: str
    spec: str
    closed: Callable
    flags: dict = field(default_factory=dict)        # bool options passed to both sides
    draw: dict = field(default_factory=dict)         # overrides of random_args' draws
    state_from_prefix: bool = False                  # a normalizer state must look like a real one
    custom: dict = field(default_factory=dict)       # a non-default value per float option
    scale_invariant: bool = False                    # normalized by scale q . z: scale cancels


CASES = [
    Case("linear_attn", "linear_attn", cf_linear_attn, {"normalize": False}, custom={"scale": 0.37}),
    Case("linear_attn-norm", "linear_attn", cf_linear_attn, {"normalize": True},
         draw={"q": _positive, "k": _positive}, state_from_prefix=True, custom={"scale": 0.61},
         scale_invariant=True),
    Case("linear_transformer", "linear_transformer", cf_linear_transformer, state_from_prefix=True,
         custom={"eps": 0.03}),
    Case("performer", "performer", cf_performer, state_from_prefix=True, custom={"eps": 0.03}),
    Case("based", "based", cf_based, {"use_norm": True}, state_from_prefix=True, custom={"scale": 0.29}),
    Case("based-nonorm", "based", cf_based, {"use_norm": False}, custom={"scale": 0.29}),
    Case("retention", "retention", cf_retention, custom={"scale": 0.83}),
    Case("simple_gla", "simple_gla", cf_simple_gla, custom={"scale": 0.83}),
    Case("gla", "gla", cf_gla, custom={"scale": 0.83}),
    Case("hgrn", "hgrn", cf_hgrn),
    Case("aft_simple", "aft_simple", cf_aft_simple, state_from_prefix=True),
]


def _dims(spec):
    if spec in ("hgrn", "aft_simple"):
        return ("D",)
    if spec == "performer":
        return ("M", "K", "V")
    return ("K", "V")


SIZES = {"K": 5, "V": 7, "M": 11, "D": 6}
SIZES_2 = {"K": 3, "V": 6, "M": 9, "D": 5}


def _op(case):
    return mixc.load(case.spec)


def _opts(case, op, sizes, custom=False):
    """Every option value the closed form needs (defaults, per CONVENTIONS.md / the spec)."""
    out = {}
    names = {o.name for o in op.ir.options}
    if "scale" in names:
        out["scale"] = sizes["K"] ** -0.5
    if "eps" in names:
        out["eps"] = 1e-6
    out.update(case.flags)
    if custom:
        out.update(case.custom)
    return out


def _args(case, op, *, B, T, H, sizes, seed, requires_grad=False):
    args, sz = random_args(op.ir, B=B, T=T, H=H, sizes={d: sizes[d] for d in _dims(case.spec)},
                           seed=seed, requires_grad=requires_grad, draw=case.draw)
    return args, sz


def _initial_state(case, op, *, n, H, sizes, seed, requires_grad=False):
    """A random initial state; for normalized systems, the final state of a random prefix."""
    if case.state_from_prefix:
        pre, _ = _args(case, op, B=n, T=4, H=H, sizes=sizes, seed=seed + 1000)
        _, st = case.closed(pre, _opts(case, op, sizes), None)
        st = {k: v.detach().clone() for k, v in st.items()}
    else:
        st = random_state(op.ir, n, H, {d.name: sizes[op.ir.root_dim(d.name)] for d in op.ir.dims}, seed=seed)
    if requires_grad:
        for v in st.values():
            v.requires_grad_(True)
    return st


def _check_state(got, want, what):
    assert set(got) == set(want), f"{what}: state names {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_close(got[name], want[name], f"{what} state {name}")


# --------------------------------------------------------------------------------------
# forward, final state, initial state

def _params(B, T, H, sizes, cases=CASES):
    """pytest params over the cases, with ids like gla-B2-T9-H3-K5-V7 (the case's own dims)."""
    out = []
    for c in cases:
        cid = f"{c.id}-" + case_id(B=B, T=T, H=H, **{d: sizes[d] for d in _dims(c.spec)})
        out.append(pytest.param(c, id=cid))
    return out


SHAPES = [dict(B=2, T=9, H=3, sizes=SIZES), dict(B=1, T=13, H=2, sizes=SIZES_2)]


@pytest.mark.parametrize("case, shape", [
    pytest.param(p.values[0], sh, id=p.id) for sh in SHAPES
    for p in _params(sh["B"], sh["T"], sh["H"], sh["sizes"])])
def test_forward_and_final_state(case, shape):
    op = _op(case)
    args, _ = _args(case, op, B=shape["B"], T=shape["T"], H=shape["H"], sizes=shape["sizes"], seed=11)
    o, st = op.reference(**args, **case.flags, output_final_state=True)
    o_cf, st_cf = case.closed(args, _opts(case, op, shape["sizes"]), None)
    assert o.dtype == torch.float64
    assert_close(o, o_cf, "o")
    _check_state(st, st_cf, "final")
    o2, st2 = op.reference(**args, **case.flags)
    assert st2 is None
    assert_close(o2, o_cf, "o (no final state)")


@pytest.mark.parametrize("case", _params(2, 7, 3, SIZES, cases=[c for c in CASES if c.custom]))
def test_explicit_options(case):
    """A non-default scale / eps reaches the computation."""
    op = _op(case)
    args, _ = _args(case, op, B=2, T=7, H=3, sizes=SIZES, seed=12)
    o, st = op.reference(**args, **case.flags, **case.custom, output_final_state=True)
    o_cf, st_cf = case.closed(args, _opts(case, op, SIZES, custom=True), None)
    assert_close(o, o_cf, "o")
    _check_state(st, st_cf, "final")
    if case.scale_invariant:     # o only moves by the 1e-10 in the denominator
        return
    o_default, _ = case.closed(args, _opts(case, op, SIZES), None)
    assert (o_default - o_cf).abs().max() > 1e-6, "the custom option value made no difference"


@pytest.mark.parametrize("case", _params(2, 9, 3, SIZES))
def test_initial_state(case):
    op = _op(case)
    B, T, H = 2, 9, 3
    args, _ = _args(case, op, B=B, T=T, H=H, sizes=SIZES, seed=21)
    s0 = _initial_state(case, op, n=B, H=H, sizes=SIZES, seed=22)
    o, st = op.reference(**args, **case.flags, initial_state=s0, output_final_state=True)
    o_cf, st_cf = case.closed(args, _opts(case, op, SIZES), s0)
    assert_close(o, o_cf, "o")
    _check_state(st, st_cf, "final")
    # the initial state matters
    o_zero, _ = case.closed(args, _opts(case, op, SIZES), None)
    assert (o_zero - o_cf).abs().max() > 1e-6


@pytest.mark.parametrize("case", _params(2, 7, 3, SIZES))
def test_gradients(case):
    """d(random-weighted sum of o and the final state) / d(every input, param, initial state)."""
    op = _op(case)
    B, T, H = 2, 7, 3
    args, _ = _args(case, op, B=B, T=T, H=H, sizes=SIZES, seed=31, requires_grad=True)
    s0 = _initial_state(case, op, n=B, H=H, sizes=SIZES, seed=32, requires_grad=True)
    o, st = op.reference(**args, **case.flags, initial_state=s0, output_final_state=True)
    o_cf, st_cf = case.closed(args, _opts(case, op, SIZES), s0)
    gen = torch.Generator().manual_seed(33)
    w_o = torch.randn(o_cf.shape, generator=gen, dtype=torch.float64)
    w_s = {n: torch.randn(x.shape, generator=gen, dtype=torch.float64) for n, x in st_cf.items()}

    def loss(o, st):
        return (w_o * o).sum() + sum((w_s[n] * st[n]).sum() for n in w_s)

    leaves = list(args.values()) + list(s0.values())
    names = list(args) + [f"initial_state[{n}]" for n in s0]
    g = torch.autograd.grad(loss(o, st), leaves)
    g_cf = torch.autograd.grad(loss(o_cf, st_cf), leaves)
    for name, a, b in zip(names, g, g_cf):
        assert b.abs().max() > 0, f"d/d{name} is zero in the closed form"
        assert_close(a, b, f"d/d{name}")


def _tiny_sizes(spec):
    return {d: 3 for d in _dims(spec)}


@pytest.mark.parametrize("case", _params(1, 4, 2, {"K": 3, "V": 3, "M": 3, "D": 3}))
def test_gradcheck(case):
    op = _op(case)
    sizes = _tiny_sizes(case.spec)
    args, _ = _args(case, op, B=1, T=4, H=2, sizes=sizes, seed=41, requires_grad=True)
    s0 = _initial_state(case, op, n=1, H=2, sizes=sizes, seed=42, requires_grad=True)
    arg_names, state_names = list(args), list(s0)

    def fn(*xs):
        a = dict(zip(arg_names, xs[:len(arg_names)]))
        s = dict(zip(state_names, xs[len(arg_names):]))
        o, st = op.reference(**a, **case.flags, initial_state=s, output_final_state=True)
        return (o,) + tuple(st[n] for n in state_names)

    assert torch.autograd.gradcheck(fn, tuple(args.values()) + tuple(s0.values()))


@pytest.mark.parametrize("case", _params(2, 6, 3, SIZES))
def test_reference_step(case):
    """reference_step, token by token from an initial state, equals op.reference."""
    op = _op(case)
    B, T, H = 2, 6, 3
    args, _ = _args(case, op, B=B, T=T, H=H, sizes=SIZES, seed=51)
    s0 = _initial_state(case, op, n=B, H=H, sizes=SIZES, seed=52)
    o, st = op.reference(**args, **case.flags, initial_state=s0, output_final_state=True)
    inputs = {d.name for d in op.ir.inputs}
    state = dict(s0)
    for t in range(T):
        tok = {n: (x[:, t] if n in inputs else x) for n, x in args.items()}
        o_t, state = op.reference_step(state=state, **tok, **case.flags)
        assert_close(o_t, o[:, t], f"o at t={t}")
    _check_state(state, st, "after the last step")


@pytest.mark.parametrize("lengths", [(3, 5, 1), (4, 0, 2, 3)], ids=["L3-5-1", "L4-0-2-3"])
@pytest.mark.parametrize("case", _params(1, 9, 2, SIZES))
def test_cu_seqlens(case, lengths):
    """B = 1 packed sequences equal each sequence run on its own (and its closed form)."""
    op = _op(case)
    T, H, N = sum(lengths), 2, len(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    args, _ = _args(case, op, B=1, T=T, H=H, sizes=SIZES, seed=61)
    s0 = _initial_state(case, op, n=N, H=H, sizes=SIZES, seed=62)
    inputs = {d.name for d in op.ir.inputs}
    opts = _opts(case, op, SIZES)
    for init in (None, s0):
        o, st = op.reference(**args, **case.flags, initial_state=init, output_final_state=True, cu_seqlens=cu)
        assert o.shape[1] == T
        for i in range(N):
            a, b = int(cu[i]), int(cu[i + 1])
            s_i = None if init is None else {n: x[i:i + 1] for n, x in init.items()}
            if b == a:          # an empty sequence passes its state through
                for n, x in st.items():
                    want = torch.zeros_like(x[i:i + 1]) if s_i is None else s_i[n]
                    assert_close(x[i:i + 1], want, f"seq {i} (empty) state {n}")
                continue
            seg = {n: (x[:, a:b] if n in inputs else x) for n, x in args.items()}
            o_i, st_i = op.reference(**seg, **case.flags, initial_state=s_i, output_final_state=True)
            assert_close(o[:, a:b], o_i, f"seq {i} o")
            _check_state({n: x[i:i + 1] for n, x in st.items()}, st_i, f"seq {i}")
            o_cf, st_cf = case.closed(seg, opts, s_i)
            assert_close(o[:, a:b], o_cf, f"seq {i} o vs closed form")
            _check_state({n: x[i:i + 1] for n, x in st.items()}, st_cf, f"seq {i} vs closed form")


# --------------------------------------------------------------------------------------
# system-specific facts

def test_retention_decay_per_head():
    """fla's retention decays: gamma_h = 1 - 2^(-5-h), e.g. 0.96875 for head 0. With one
    key and one value channel, S_t after a single token k=a, v=c then t more tokens with k=0
    is gamma^t a c."""
    op = mixc.load("retention")
    H, T = 4, 6
    gen = torch.Generator().manual_seed(71)
    q = torch.rand(1, T, H, 1, generator=gen, dtype=torch.float64) + 0.5
    k = torch.zeros(1, T, H, 1, dtype=torch.float64)
    k[:, 0] = 0.7
    v = torch.full((1, T, H, 1), 1.3, dtype=torch.float64)
    _, st = op.reference(q=q, k=k, v=v, output_final_state=True)
    gamma = torch.tensor([0.96875, 0.984375, 0.9921875, 0.99609375], dtype=torch.float64)
    assert_close(st["S"][0, :, 0, 0], 0.7 * 1.3 * gamma ** (T - 1), "S_T")


def test_performer_estimates_softmax_kernel():
    """phi(q) . phi(k) is an unbiased estimate of exp(q . k / sqrt(K)) (FAVOR+): with many
    random features the estimate is close; the spec's K^(-1/4) scaling is what makes it so.
    A huge eps turns the normalized output into eps^-1 sum_s phi(q_t) . phi(k_s) v_s."""
    op = mixc.load("performer")
    K, M, T = 5, 20000, 5
    gen = torch.Generator().manual_seed(72)
    q = 0.6 * torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64)
    k = 0.6 * torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, 1, 3, generator=gen, dtype=torch.float64)
    W = torch.randn(1, M, K, generator=gen, dtype=torch.float64)
    A = torch.exp(torch.einsum("tk,sk->ts", q[0, :, 0], k[0, :, 0]) / math.sqrt(K)) * _causal(T)
    o, _ = op.reference(q=q, k=k, v=v, W=W)
    o_soft = (A @ v[0, :, 0]) / A.sum(-1, keepdim=True)
    assert (o[0, :, 0] - o_soft).abs().max() < 0.05
    eps = 1e8
    o_raw, _ = op.reference(q=q, k=k, v=v, W=W, eps=eps)
    want = A @ v[0, :, 0]
    assert (o_raw[0, :, 0] * eps - want).abs().max() < 0.06 * want.abs().max()

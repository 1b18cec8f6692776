"""The library specs of issue 18 item 3 (the affine ops fla 0.6.0 has: hgrn2, kda,
lightning_attn, gated_delta_product, comba) and mamba / mamba2's step-size options, against
float64 loops written here from the papers and fla's / mamba_ssm's / transformers' own
conventions, never from the spec:

  hgrn2                fla's HGRN2 layer: gla with k = 1 - exp(g), v = i
  lightning_attn       fla's chunk_lightning_attn: simple_gla with
                       g_gamma_h = -(8 / H) (1 - layer_idx / num_layers) h
  kda                  fla's naive_recurrent_kda: S *= exp(g) (per key), then the delta rule
  comba                fla's naive_recurrent_comba: S *= exp(g), S += beta k (v - S^T p)^T
  gated_delta_product  fla's naive_recurrent_gated_delta_product, num_householder = 2, on fla's
                       interleaved layout (k[:, 2t + j] is step j of token t)
  mamba2, mamba        transformers' torch_forward / mamba_ssm: delta = softplus(dt + dt_bias)
                       (or dt + dt_bias without softplus), clamped to [dt_min, dt_max]

Per spec: the float64 reference and the torch backend in output, final state and every
gradient (the initial state's too); the kernel modes the spec has (Triton's interpreter,
B1-T20-H2-K8, within a small factor of the float32 torch backend's error); decode
token by token with step(); packed sequences (cu_seqlens) against separate runs.
"""
from __future__ import annotations

import math

import pytest
import sympy as sp
import torch
import torch.nn.functional as F

import mixc
from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference

TOL = 1e-10


def assert_close(got, want, what, tol=TOL):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, want.detach().abs().max().item())
    err = (got.detach().double() - want.detach()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _zeros_state(a, K, V):
    q = next(iter(a.values()))
    return torch.zeros(q.shape[0], q.shape[2], K, V, dtype=torch.float64)


# --------------------------------------------------------------------------------------
# independent loops: f(args, opts, s0) -> (o [B, T, H, *], {"S": final state})

def hgrn2_loop(a, opts, s0):
    q, i, g = a["q"], a["i"], a["g"]                      # [b,t,h,k], [b,t,h,v], [b,t,h,k]
    k = 1 - g.exp()                                       # HGRN2: the input gate is 1 - forget
    S = s0["S"] if s0 is not None else _zeros_state(a, q.shape[-1], i.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * i[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * opts["scale"], S))
    return torch.stack(out, 1), {"S": S}


def lightning_loop(a, opts, s0):
    q, k, v = a["q"], a["k"], a["v"]
    H = q.shape[2]
    g_gamma = -(8 / H * (1 - opts["layer_idx"] / opts["num_layers"])) * torch.arange(H, dtype=torch.float64)
    S = s0["S"] if s0 is not None else _zeros_state(a, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = g_gamma.exp()[None, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * opts["scale"], S))
    return torch.stack(out, 1), {"S": S}


def kda_loop(a, opts, s0):
    q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
    if opts.get("use_qk_l2norm_in_kernel"):
        q, k = _l2(q), _l2(k)
    S = s0["S"] if s0 is not None else _zeros_state(a, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        v_new = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * v_new[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * opts["scale"], S))
    return torch.stack(out, 1), {"S": S}


def comba_loop(a, opts, s0):
    q, k, v, p, g, beta = a["q"], a["k"], a["v"], a["p"], a["g"], a["beta"]
    if opts.get("use_qk_l2norm_in_kernel"):
        q, k, p = _l2(q), _l2(k), _l2(p)
    S = s0["S"] if s0 is not None else _zeros_state(a, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        v_new = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", p[:, t], S))
        S = S + k[:, t, :, :, None] * v_new[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * opts["scale"], S))
    return torch.stack(out, 1), {"S": S}


def gdp_loop(a, opts, s0, nh=2):
    """fla's layout: k, v, beta hold nh rows per token, step j of token t at row nh * t + j."""
    q, g = a["q"], a["g"]
    k = torch.stack([a["k1"], a["k2"]], 2).flatten(1, 2)       # [b, t*nh, h, k], interleaved
    v = torch.stack([a["v1"], a["v2"]], 2).flatten(1, 2)
    beta = torch.stack([a["beta1"], a["beta2"]], 2).flatten(1, 2)
    if opts.get("use_qk_l2norm_in_kernel"):
        q, k = _l2(q), _l2(k)
    S = s0["S"] if s0 is not None else _zeros_state(a, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        for j in range(nh):
            r = nh * t + j
            err = v[:, r] - torch.einsum("bhk,bhkv->bhv", k[:, r], S)
            S = S + beta[:, r, :, None, None] * k[:, r, :, :, None] * err[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * opts["scale"], S))
    return torch.stack(out, 1), {"S": S}


def _step_size(dt, dt_bias, opts):
    """transformers' Mamba2 torch_forward: softplus(dt + dt_bias), clamped to time_step_limit."""
    delta = dt + dt_bias
    if opts.get("dt_softplus", True):
        delta = F.softplus(delta)
    if opts.get("dt_limit", False):
        delta = torch.clamp(delta, opts["dt_min"], opts["dt_max"])
    return delta


def mamba2_loop(a, opts, s0):
    x, dt, Bm, Cm, A, D = a["x"], a["dt"], a["B"], a["C"], a["A"], a["D"]
    delta = _step_size(dt, a["dt_bias"], opts)                 # [b, t, h]
    S = s0["S"] if s0 is not None else _zeros_state(a, Bm.shape[-1], x.shape[-1])
    out = []
    for t in range(x.shape[1]):
        dA = torch.exp(delta[:, t] * A)                          # [b, h]
        S = dA[..., None, None] * S + Bm[:, t, :, :, None] * (delta[:, t, :, None] * x[:, t])[:, :, None, :]
        out.append(torch.einsum("bhn,bhnp->bhp", Cm[:, t], S) + D[:, None] * x[:, t])
    return torch.stack(out, 1), {"S": S}


def mamba_loop(a, opts, s0):
    x, dt, Bm, Cm, A, D = a["x"], a["dt"], a["B"], a["C"], a["A"], a["D"]   # A [h, n, p], D [h, p]
    delta = _step_size(dt, a["dt_bias"], opts)                 # [b, t, h, p]
    S = s0["S"] if s0 is not None else _zeros_state(a, Bm.shape[-1], x.shape[-1])
    out = []
    for t in range(x.shape[1]):
        dA = torch.exp(delta[:, t, :, None, :] * A)              # [b, h, n, p]
        S = dA * S + Bm[:, t, :, :, None] * (delta[:, t] * x[:, t])[:, :, None, :]
        out.append(torch.einsum("bhn,bhnp->bhp", Cm[:, t], S) + D * x[:, t])
    return torch.stack(out, 1), {"S": S}


LOOPS = {"hgrn2": hgrn2_loop, "lightning_attn": lightning_loop, "kda": kda_loop, "comba": comba_loop,
         "gated_delta_product": gdp_loop, "mamba2": mamba2_loop, "mamba": mamba_loop}

# (spec, the call's options): each case is one system the loops above must match
SYSTEMS = {
    "hgrn2": ("hgrn2", {}),
    "lightning_attn": ("lightning_attn", {"layer_idx": 1, "num_layers": 4}),   # num_heads: the call's H
    "kda": ("kda", {}),
    "kda-l2norm": ("kda", {"use_qk_l2norm_in_kernel": True}),
    "comba": ("comba", {}),
    "comba-l2norm": ("comba", {"use_qk_l2norm_in_kernel": True}),
    "gated_delta_product": ("gated_delta_product", {}),
    "gated_delta_product-l2norm": ("gated_delta_product", {"use_qk_l2norm_in_kernel": True}),
    "mamba2-dt_limit": ("mamba2", {"dt_limit": True, "dt_min": 0.3, "dt_max": 1.2}),
    "mamba2-preactivated": ("mamba2", {"dt_softplus": False}),
    "mamba-dt_limit": ("mamba", {"dt_limit": True, "dt_min": 0.3, "dt_max": 1.2}),
    "mamba-preactivated": ("mamba", {"dt_softplus": False}),
}
DEFAULTS = {"use_qk_l2norm_in_kernel": False, "dt_softplus": True, "dt_limit": False}
_OPS = {}


def _op(spec):
    if spec not in _OPS:
        _OPS[spec] = mixc.load(spec)
    return _OPS[spec]


def make_case(sysname, *, B, T, H, n, seed, dtype=torch.float64, requires_grad=False):
    """Fresh inputs drawn as each paper parametrizes them (unit keys and beta in (0, 1) for the
    delta-rule family, log gates <= 0, positive step sizes), the call's options and the loop's."""
    spec, call = SYSTEMS[sysname]
    op = _op(spec)
    sizes = {d.name: n + i for i, d in enumerate(op.ir.dims)}
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=sizes, seed=seed)
    gen = torch.Generator().manual_seed(seed + 101)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    l2 = call.get("use_qk_l2norm_in_kernel", False)
    for name in ("k", "p", "k1", "k2"):
        if name in args and spec != "hgrn2":
            x = randn(args[name].shape)
            args[name] = x * (0.5 + torch.rand(x.shape[:-1] + (1,), generator=gen, dtype=torch.float64)) if l2 \
                else F.normalize(x, dim=-1)                      # fla expects unit keys without the norm
    for name in ("beta", "beta1", "beta2"):
        if name in args:
            args[name] = torch.sigmoid(randn(args[name].shape))
    for name in ("g",):
        if name in args:
            args[name] = F.logsigmoid(randn(args[name].shape) + 2)  # decays in (0.5, 1) mostly
    if spec in ("mamba", "mamba2"):
        args["dt"] = randn(args["dt"].shape)
        args["dt_bias"] = 0.5 * randn(args["dt_bias"].shape)
        if not call.get("dt_softplus", True):               # pre-activated: a positive step size
            args["dt"] = F.softplus(args["dt"])
            args["dt_bias"] = 0.05 * torch.rand(args["dt_bias"].shape, generator=gen, dtype=torch.float64)
    if spec == "lightning_attn":
        call = dict(call, num_heads=H)
    args = {k: v.to(dtype).detach().requires_grad_(requires_grad) for k, v in args.items()}
    full = dict(DEFAULTS)
    for o in op.ir.options:
        if o.name not in call and o.name not in full and o.kind != "bool":
            full[o.name] = _default(op, o.name, sizes)
    full.update(call)
    return op, args, sizes, call, full


def _default(op, name, sizes):
    if name == "scale":
        return sizes["K"] ** -0.5
    return {"layer_idx": 0, "num_layers": 1, "num_heads": 1, "dt_min": 0.0, "dt_max": 1e30}[name]


def _loss_weights(o, fin, seed=99):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in fin.items()})


def _loss(o, fin, w):
    return (w[0] * o.double()).sum() + sum((w[1][k] * fin[k].double()).sum() for k in w[1])


def assert_gradients_match(what, o, fin, o_l, fin_l, args, s0, tol):
    """Every gradient (the inputs', the params', the initial state's) of one weighted loss of
    the output and final state, the op's (o, fin) against the loop's (o_l, fin_l). A gradient
    the loop does not have must be absent or zero; one it has must exist and match."""
    w = _loss_weights(o_l, fin_l)
    leaves = list(args.values()) + list(s0.values())
    names = list(args) + [f"initial_state[{k}]" for k in s0]
    got = torch.autograd.grad(_loss(o, fin, w), leaves, allow_unused=True)
    want = torch.autograd.grad(_loss(o_l, fin_l, w), leaves, allow_unused=True)
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None or a.abs().max() == 0, f"{what}: d/d {name} should be zero"
            continue
        assert a is not None, f"{what}: no gradient for {name}"
        assert_close(a, b, f"{what}: d/d {name}", tol=tol)


NAMES = list(SYSTEMS)


# --------------------------------------------------------------------------------------
# the float64 reference and the torch backend against the loops

@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("sysname", NAMES)
def test_forward_and_gradients_match_loop(sysname, mode):
    B, T, H = 2, 9, 2
    op, args, sizes, call, full = make_case(sysname, B=B, T=T, H=H, n=3, seed=11, requires_grad=True)
    s0 = random_state(op.ir, B, H, sizes, seed=5, requires_grad=True)
    o, fin = op(**args, **call, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = LOOPS[SYSTEMS[sysname][0]](args, full, s0)
    assert o.dtype == torch.float64
    assert_close(o, o_l, f"{sysname} {mode}: output")
    assert set(fin) == set(fin_l)
    st_tol = TOL if mode == "reference" else 1e-6    # the op's states are float32 (CONVENTIONS)
    assert_close(fin["S"], fin_l["S"], f"{sysname} {mode}: final state", tol=st_tol)
    assert_gradients_match(f"{sysname} {mode}", o, fin, o_l, fin_l, args, s0,
                           tol=1e-9 if mode == "reference" else 1e-6)


@pytest.mark.parametrize("sysname", NAMES)
def test_step_matches_loop(sysname):
    """Decoding token by token from a random state equals the loop over the sequence."""
    B, T, H = 2, 5, 2
    op, args, sizes, call, full = make_case(sysname, B=B, T=T, H=H, n=3, seed=17)
    s0 = random_state(op.ir, B, H, sizes, seed=3)
    o_l, fin_l = LOOPS[SYSTEMS[sysname][0]](args, full, s0)
    per_token = {d.name for d in op.ir.inputs}
    st = s0
    for t in range(T):
        o, st = op.step(**{k: (v[:, t] if k in per_token else v) for k, v in args.items()}, **call, state=st)
        assert_close(o, o_l[:, t], f"{sysname}: step {t}", tol=1e-5)
    assert_close(st["S"], fin_l["S"], f"{sysname}: state after the steps", tol=1e-5)


@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("sysname", ["hgrn2", "kda", "comba", "gated_delta_product", "mamba2-dt_limit",
                                     "lightning_attn"])
def test_packed_sequences_match_separate_loops(sysname, mode):
    lens = [4, 0, 7, 2]
    op, args, sizes, call, full = make_case(sysname, B=1, T=sum(lens), H=2, n=3, seed=29)
    s0 = random_state(op.ir, len(lens), 2, sizes, seed=8)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    o, fin = op(**args, **call, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode)
    per_token = {d.name for d in op.ir.inputs}
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if b == a:                               # an empty sequence keeps its initial state
            assert_close(fin["S"][i:i + 1], s0["S"][i:i + 1], f"{sysname} {mode}: empty sequence {i}", tol=1e-6)
            continue
        part = {k: (v[:, a:b] if k in per_token else v) for k, v in args.items()}
        o_l, fin_l = LOOPS[SYSTEMS[sysname][0]](part, full, {"S": s0["S"][i:i + 1]})
        assert_close(o[:, a:b], o_l, f"{sysname} {mode}: output of sequence {i}")
        assert_close(fin["S"][i:i + 1], fin_l["S"], f"{sysname} {mode}: final state of sequence {i}", tol=1e-6)


# --------------------------------------------------------------------------------------
# the kernels (Triton's interpreter) against the loops

def _kernel_cases():
    out = []
    for sysname in NAMES:
        spec = SYSTEMS[sysname][0]
        forms = _op(spec).plan(**{k: v for k, v in SYSTEMS[sysname][1].items() if isinstance(v, bool)}).forms
        for mode in ("chunk", "recurrent"):
            if mode == "chunk" and "chunk" not in forms:
                continue
            # one kernel mode per new spec runs by default; the rest (and the flag variants) are slow
            # (tests/ops/test_kernels.py runs every library spec's kernels against the reference too)
            default = (sysname, mode) in {("hgrn2", "chunk"), ("kda", "chunk"), ("comba", "chunk"),
                                          ("mamba2-dt_limit", "chunk"), ("lightning_attn", "chunk")}
            out.append(pytest.param(sysname, mode, id=f"{sysname}-{mode}-" + case_id(B=1, T=20, H=2, K=8),
                                    marks=[] if default else [pytest.mark.slow]))
    return out


@pytest.mark.parametrize("sysname,mode", _kernel_cases())
def test_kernels_match_loop(sysname, mode):
    """Forward, final state and every gradient of the kernels (float32, chunks of 16 over 20
    tokens: a partial last chunk) against the float64 loop, within 4x the float32 torch
    backend's error."""
    spec = SYSTEMS[sysname][0]
    op, args, sizes, call, full = make_case(sysname, B=1, T=20, H=2, n=8, seed=31, dtype=torch.float32,
                                            requires_grad=True)
    s0 = random_state(op.ir, 1, 2, sizes, seed=4, dtype=torch.float32, requires_grad=True)

    def formula(a, s):
        return LOOPS[spec](a, full, s)

    check_against_reference(op, call, args, s0, torch.float32, mode=mode, chunk=16, formula=formula)


# --------------------------------------------------------------------------------------
# what the step-size options change

def test_mamba2_dt_limit_clamps_the_step_size():
    """With dt_limit the op follows the clamp (NemotronH / Zamba2 clamp from below); without it
    the unclamped step size differs from the clamped model by far more than rounding."""
    op, args, sizes, call, full = make_case("mamba2-dt_limit", B=1, T=12, H=2, n=4, seed=41)
    o_clamped, _ = op(**args, **call, mode="torch")
    o_free, _ = op(**args, mode="torch")
    o_l, _ = mamba2_loop(args, full, None)
    assert_close(o_clamped, o_l, "mamba2 clamped")
    assert (o_free - o_l).abs().max() > 1e-2


def test_preactivated_dt_equals_softplus_outside():
    """dt_softplus=false with dt_bias = 0 takes dt as the step size: softplus(dt) passed in equals
    the default convention on dt (mamba's old convention, the layer's before this change)."""
    for spec, shape in (("mamba", (1, 7, 2, 4)), ("mamba2", (1, 7, 2))):
        op = mixc.load(spec)
        args, _ = random_args(op.ir, B=1, T=7, H=2, sizes={"N": 3, "P": 4}, seed=7)
        assert args["dt"].shape == shape
        o_def, _ = op(**args, mode="reference")
        pre = dict(args, dt=F.softplus(args["dt"] + args["dt_bias"]), dt_bias=torch.zeros_like(args["dt_bias"]))
        o_pre, _ = op(**pre, dt_softplus=False, mode="reference")
        assert_close(o_pre, o_def, f"{spec}: pre-activated dt")


def test_lightning_decay_per_head_and_layer():
    """fla's g_gamma: head 0 never decays; deeper layers decay less."""
    op = mixc.load("lightning_attn")
    st = op.plan().states[0]
    syms = {s.name: s for s in st.log_decay.free_symbols}
    f = sp.lambdify([syms["head"], syms["layer_idx"], syms["num_layers"], syms["num_heads"]], st.log_decay)
    H, L = 4, 6
    for h in range(H):
        for layer in range(L):
            assert math.isclose(f(h, layer, L, H), -(8 / H * (1 - layer / L)) * h, abs_tol=1e-12)

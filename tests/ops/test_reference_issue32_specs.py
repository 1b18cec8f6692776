"""The library specs of issue 32's list that this file covers, against float64 loops written
here from the papers, never from the spec:

  rwkv5                RWKV-5 "Eagle" (Peng et al. 2024): wkv_t = diag(u) k_t^T v_t
                       + sum_{i<t} diag(w)^(t-1-i) k_i^T v_i, o_t = r_t wkv_t (times scale), the
                       decay w = exp(w_log) a param per head and key channel
  hgrn1                HGRN-1's real HGRU (Qin et al. 2023): lam = lb + (1 - lb) sigmoid(f),
                       h = lam h + (1 - lam) silu(c), o = silu(gz) h
  delta_rule-negeig    DeltaNet and Gated DeltaNet with negative eigenvalues (Grazzi et al.
  gated_delta_rule-    2025; fla's allow_neg_eigval): beta in (0, 2), so I - beta k k^T has the
    negeig             eigenvalue 1 - beta in (-1, 1); the library specs, unchanged

Per system: the float64 reference and the torch backend in output, final state and every
gradient (the initial state's and the params' too); the kernel modes the spec has (Triton's
interpreter, B1-T20-H2-K8, within 4x the float32 torch backend's error); decode token by token
with step(); packed sequences (cu_seqlens) against separate loops, in the torch modes and in
the chunked kernels. fla's allow_neg_eigval flag itself: tests/ops/test_fla_ops_neg_eigval.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference
from ops.test_reference_new_specs import assert_close, assert_gradients_match

# --------------------------------------------------------------------------------------
# independent loops: f(args, opts, s0) -> (o [B, T, H, *], {state name: final state})


def _zeros(a, *dims):
    x = next(iter(a.values()))
    return torch.zeros(x.shape[0], x.shape[2], *dims, dtype=torch.float64)


def rwkv5_loop(a, opts, s0):
    """Eagle's WKV read before the token's write: o_t = scale r_t^T (S + diag(u) k_t v_t^T),
    then S = diag(exp(w)) S + k_t v_t^T (w [H, K] the log of the static decay)."""
    r, k, v, w, u = a["r"], a["k"], a["v"], a["w"], a["u"]
    S = s0["S"] if s0 is not None else _zeros(a, k.shape[-1], v.shape[-1])
    out = []
    for t in range(r.shape[1]):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]                       # [b, h, k, v]
        out.append(torch.einsum("bhk,bhkv->bhv", opts["scale"] * r[:, t], S + u[None, :, :, None] * kv))
        S = w.exp()[None, :, :, None] * S + kv
    return torch.stack(out, 1), {"S": S}


def hgrn1_loop(a, opts, s0):
    """The HGRU: a forget gate lower-bounded by lb, the input weighted by 1 - lam, the output
    gated by silu(gz) (the paper's tau), before the layer's LayerNorm."""
    c, f, gz, lb = a["c"], a["f"], a["gz"], a["lb"]
    h = s0["h"] if s0 is not None else _zeros(a, c.shape[-1])
    out = []
    for t in range(c.shape[1]):
        lam = lb[None] + (1 - lb[None]) * torch.sigmoid(f[:, t])
        h = lam * h + (1 - lam) * F.silu(c[:, t])
        out.append(F.silu(gz[:, t]) * h)
    return torch.stack(out, 1), {"h": h}


def delta_loop(a, opts, s0):
    """S = exp(g) S (no g: no decay), then S = (I - beta k k^T) S + beta k v^T; o = scale q^T S."""
    q, k, v, beta = a["q"], a["k"], a["v"], a["beta"]
    S = s0["S"] if s0 is not None else _zeros(a, k.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        if "g" in a:
            S = a["g"][:, t].exp()[..., None, None] * S
        kt, b = k[:, t], beta[:, t, :, None, None]
        S = S - b * kt[..., None] * torch.einsum("bhk,bhkv->bhv", kt, S)[:, :, None, :] \
            + b * kt[..., None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", opts["scale"] * q[:, t], S))
    return torch.stack(out, 1), {"S": S}


LOOPS = {"rwkv5": rwkv5_loop, "hgrn1": hgrn1_loop, "delta_rule": delta_loop, "gated_delta_rule": delta_loop}
SYSTEMS = {"rwkv5": "rwkv5", "hgrn1": "hgrn1", "delta_rule-negeig": "delta_rule",
           "gated_delta_rule-negeig": "gated_delta_rule"}
NAMES = list(SYSTEMS)
_OPS = {}


def _op(spec):
    if spec not in _OPS:
        _OPS[spec] = mixc.load(spec)
    return _OPS[spec]


def make_case(sysname, *, B, T, H, n, seed, dtype=torch.float64, requires_grad=False):
    """Fresh inputs drawn as each paper parametrizes them: RWKV-5's w = -exp(time_decay), HGRN's
    lower bound in (0, 1), unit keys and beta in (0, 2) (most of it past 1) for the delta rules,
    log gates <= 0. Returns the op, its args, the sizes and the loop's options."""
    spec = SYSTEMS[sysname]
    op = _op(spec)
    sizes = {d.name: n + i for i, d in enumerate(op.ir.dims)}
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=sizes, seed=seed)
    gen = torch.Generator().manual_seed(seed + 101)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    for name in list(args):
        args[name] = randn(args[name].shape)
    if spec == "rwkv5":
        args["w"] = -torch.exp(randn(args["w"].shape) * 0.7 - 1.5)         # decays exp(w) in (0.4, 1)
    if spec == "hgrn1":
        args["lb"] = torch.rand(args["lb"].shape, generator=gen, dtype=torch.float64)
    if "beta" in args:
        args["k"] = F.normalize(args["k"], dim=-1)                           # DeltaNet's unit keys
        args["beta"] = 2 * torch.sigmoid(1.5 * randn(args["beta"].shape))
        assert (args["beta"] > 1.2).any()                                     # negative eigenvalues drawn
    if "g" in args:
        args["g"] = F.logsigmoid(args["g"] + 2)
    args = {k: v.to(dtype).detach().requires_grad_(requires_grad) for k, v in args.items()}
    opts = {"scale": sizes["K"] ** -0.5} if "K" in sizes else {}
    return op, args, sizes, opts


def _loop(sysname):
    return LOOPS[SYSTEMS[sysname]]


def _per_token(op):
    return {d.name for d in op.ir.inputs}


# --------------------------------------------------------------------------------------
# the float64 reference and the torch backend against the loops

@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("sysname", NAMES)
def test_forward_and_gradients_match_loop(sysname, mode):
    B, T, H = 2, 9, 2
    op, args, sizes, opts = make_case(sysname, B=B, T=T, H=H, n=3, seed=11, requires_grad=True)
    s0 = random_state(op.ir, B, H, sizes, seed=5, requires_grad=True)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = _loop(sysname)(args, opts, s0)
    assert o.dtype == torch.float64 and set(fin) == set(fin_l)
    assert_close(o, o_l, f"{sysname} {mode}: output")
    for name in fin_l:
        assert_close(fin[name], fin_l[name], f"{sysname} {mode}: final {name}", tol=1e-10 if mode == "reference"
                     else 1e-6)           # the op's states are float32 outside the reference (CONVENTIONS)
    assert_gradients_match(f"{sysname} {mode}", o, fin, o_l, fin_l, args, s0,
                           tol=1e-9 if mode == "reference" else 1e-6)


@pytest.mark.parametrize("sysname", NAMES)
def test_step_matches_loop(sysname):
    """Decoding token by token from a random state equals the loop over the sequence."""
    B, T, H = 2, 5, 2
    op, args, sizes, opts = make_case(sysname, B=B, T=T, H=H, n=3, seed=17)
    s0 = random_state(op.ir, B, H, sizes, seed=3)
    o_l, fin_l = _loop(sysname)(args, opts, s0)
    per_token, st = _per_token(op), s0
    for t in range(T):
        o, st = op.step(**{k: (v[:, t] if k in per_token else v) for k, v in args.items()}, state=st)
        assert_close(o, o_l[:, t], f"{sysname}: step {t}", tol=1e-5)
    for name in fin_l:
        assert_close(st[name], fin_l[name], f"{sysname}: {name} after the steps", tol=1e-5)


LENS = [4, 0, 7, 2]


def _packed_loop(sysname, opts, per_token, cu):
    """The loop run on each packed sequence alone, outputs concatenated, states stacked."""
    def run(a, s0):
        outs, fins = [], []
        for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            start = {k: v[i:i + 1] for k, v in s0.items()}
            if hi == lo:                       # an empty sequence: no output, its state kept
                fins.append(start)
                continue
            part = {k: (v[:, lo:hi] if k in per_token else v) for k, v in a.items()}
            o, fin = _loop(sysname)(part, opts, start)
            outs.append(o)
            fins.append(fin)
        return torch.cat(outs, 1), {k: torch.cat([f[k] for f in fins]) for k in fins[0]}
    return run



@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("sysname", NAMES)
def test_packed_sequences_match_separate_loops(sysname, mode):
    """cu_seqlens with an empty sequence: each sequence's output and final state are the loop's
    on that sequence alone from its own initial state (an empty one keeps it)."""
    op, args, sizes, opts = make_case(sysname, B=1, T=sum(LENS), H=2, n=3, seed=29)
    s0 = random_state(op.ir, len(LENS), 2, sizes, seed=8)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)), dtype=torch.int32)
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode)
    o_l, fin_l = _packed_loop(sysname, opts, _per_token(op), cu)(args, s0)
    assert_close(o, o_l, f"{sysname} {mode}: packed output")
    for name in fin_l:
        assert_close(fin[name], fin_l[name], f"{sysname} {mode}: packed final {name}", tol=1e-6)


# --------------------------------------------------------------------------------------
# the kernels (Triton's interpreter) against the loops

def _check_kernels(op, args, s0, mode, formula, **kw):
    """check_against_reference bounds the kernels' error by the float32 torch backend's (both
    against the loop); this also bounds the kernels' forward against the loop outright, so that
    the check stands on its own (a wrong loop would raise both errors together)."""
    check_against_reference(op, {}, args, s0, torch.float32, mode=mode, chunk=16, formula=formula, **kw)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode, chunk=16, **kw)
    o_l, fin_l = formula({k: v.detach().double() for k, v in args.items()},
                         {k: v.detach().double() for k, v in s0.items()})
    assert_close(o, o_l, f"{mode}: output", tol=1e-5)
    for name in fin_l:
        assert_close(fin[name], fin_l[name], f"{mode}: final {name}", tol=1e-5)

def _kernel_cases():
    out = []
    for sysname in NAMES:
        forms = _op(SYSTEMS[sysname]).plan().forms
        for mode in ("chunk", "recurrent", "conv"):
            if mode not in forms:
                continue
            # the chunked kernels of each system run by default; the recurrent ones under -m slow
            # (tests/ops/test_kernels.py runs every library spec's kernels against its reference too)
            out.append(pytest.param(sysname, mode, id=f"{sysname}-{mode}-" + case_id(B=1, T=20, H=2, K=8),
                                    marks=[] if mode != "recurrent" else [pytest.mark.slow]))
    return out


@pytest.mark.parametrize("sysname,mode", _kernel_cases())
def test_kernels_match_loop(sysname, mode):
    """Forward, final state and every gradient of the kernels (float32, chunks of 16 over 20
    tokens: a partial last chunk) against the float64 loop, within 4x the float32 torch
    backend's error."""
    op, args, sizes, opts = make_case(sysname, B=1, T=20, H=2, n=8, seed=31, dtype=torch.float32,
                                      requires_grad=True)
    s0 = random_state(op.ir, 1, 2, sizes, seed=4, dtype=torch.float32, requires_grad=True)
    _check_kernels(op, args, s0, mode, lambda a, s: _loop(sysname)(a, opts, s))


@pytest.mark.parametrize("sysname", [pytest.param(n, marks=[] if n == "rwkv5" else [pytest.mark.slow])
                                     for n in NAMES])
def test_packed_chunked_kernels_match_separate_loops(sysname):
    """cu_seqlens in the chunked kernels (an empty sequence, sequences across chunk borders):
    outputs, final states and every gradient against the loop on each sequence alone."""
    lens = LENS + [21]                         # the last one crosses the chunk border at 16
    op, args, sizes, opts = make_case(sysname, B=1, T=sum(lens), H=2, n=8, seed=37, dtype=torch.float32,
                                      requires_grad=True)
    s0 = random_state(op.ir, len(lens), 2, sizes, seed=6, dtype=torch.float32, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    _check_kernels(op, args, s0, "chunk", _packed_loop(sysname, opts, _per_token(op), cu), cu_seqlens=cu)


# --------------------------------------------------------------------------------------
# what the papers' parametrizations mean

@pytest.mark.parametrize("mode", ["reference", "torch", "chunk"])
def test_a_beta_past_one_flips_the_keyed_memory(mode):
    """The negative eigenvalue itself: writing v = 0 with beta = 1.5 along a unit key k turns
    k^T S into (1 - 1.5) k^T S, its sign flipped (beta in (0, 1) only shrinks it)."""
    op, args, sizes, opts = make_case("delta_rule-negeig", B=1, T=1, H=2, n=8, seed=43)
    s0 = random_state(op.ir, 1, 2, sizes, seed=9)
    args["v"] = torch.zeros_like(args["v"])
    args["beta"] = torch.full_like(args["beta"], 1.5)
    _, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    k = args["k"][:, 0]
    before = torch.einsum("bhk,bhkv->bhv", k, s0["S"])
    after = torch.einsum("bhk,bhkv->bhv", k, fin["S"].double())
    assert_close(after, -0.5 * before, f"delta_rule {mode}: k^T S after the write", tol=1e-6)


def test_hgrn1_lower_bound_holds_the_forget_gate():
    """lb = 1 keeps the state whatever the gate (the top of the hierarchy); lb = 0 with a gate
    shut (f -> -inf) replaces it by silu(c) (the bottom)."""
    op, args, sizes, _ = make_case("hgrn1", B=1, T=3, H=2, n=4, seed=47)
    s0 = random_state(op.ir, 1, 2, sizes, seed=2)
    _, keep = op(**dict(args, lb=torch.ones_like(args["lb"])), initial_state=s0, output_final_state=True,
                 mode="reference")
    assert_close(keep["h"], s0["h"], "hgrn1 lb = 1: the state kept")
    shut = dict(args, lb=torch.zeros_like(args["lb"]), f=torch.full_like(args["f"], -60.0))
    _, fin = op(**shut, initial_state=s0, output_final_state=True, mode="reference")
    assert_close(fin["h"], F.silu(args["c"][:, -1]), "hgrn1 lb = 0, gate shut: the last input")


def test_rwkv5_is_fla_rwkv6_with_a_static_decay():
    """fla 0.6 has no RWKV-5 op; its naive RWKV-6 with w expanded over the tokens is RWKV-5,
    in fla's [B, H, T, *] layout: the same output and final state as the spec's kernels."""
    from fla_refs import fla_naive
    op, args, sizes, _ = make_case("rwkv5", B=2, T=20, H=2, n=8, seed=53, dtype=torch.float32)
    s0 = random_state(op.ir, 2, 2, sizes, seed=5, dtype=torch.float32)
    o, fin = op(**args, scale=0.5, initial_state=s0, output_final_state=True, mode="chunk")
    r, k, v = (args[n].transpose(1, 2) for n in ("r", "k", "v"))
    w = args["w"][None, :, None, :].expand(r.shape)
    o_f, S_f = fla_naive("rwkv6/recurrent_naive", "naive_recurrent_rwkv6")(
        r, k, v, w, args["u"], scale=0.5, initial_state=s0["S"], output_final_state=True)
    assert_close(o, o_f.transpose(1, 2).double(), "rwkv5 vs fla's naive rwkv6: output", tol=1e-5)
    assert_close(fin["S"], S_f.double(), "rwkv5 vs fla's naive rwkv6: final state", tol=1e-5)

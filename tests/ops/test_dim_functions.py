"""Functions over a dim in every mode: a spec whose feature maps, values and gate use all six
(softmax, l2norm, layer_norm, rms_norm with eps=, logsumexp, mean) against the same recurrence
with torch's own functions (torch.softmax, F.layer_norm, F.rms_norm, torch.logsumexp) in
float64: outputs, final states and every gradient in modes reference, torch, recurrent and
chunk (the functions computed inside the chunked kernels), and the decode step. And readouts
through them, nonlinear in the state: at N = 128, where the recurrent kernels split a state
dim of a linear readout into blocks, they split none (a float64 check and the layout's
choice); mean, a sum, still splits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixc.derive.layout import split_dim, tile_dim
from mixc.pipeline import from_text

from helpers import random_args, random_state

FEATURES = """
mixer features
  dims   K, V
  input  q[K], k[K], v[V], g[] in [-inf, 0], w[K]
  param  u[V]
  option eps = 1e-3
  let    qn = softmax(q, K), kn = l2norm(k, K)
  let    vn = layer_norm(v, V) + u * rms_norm(v, V, eps=eps)
  let    a = g - 0.5 * sigmoid(logsumexp(w, K) - mean(w, K))
  state  S[K, V]
  update S = exp(a) * S + kn * vn
  output o = qn @ S
"""
SIZES = {"K": 8, "V": 6}


def features_loop(a, st, eps=1e-3):
    """The recurrence with torch's functions, float64: S = exp(a) S + kn vn^T, o = qn^T S."""
    q, k, v, g, w, u = (a[n] for n in ("q", "k", "v", "g", "w", "u"))
    qn = torch.softmax(q, -1)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)              # fla's l2norm
    vn = F.layer_norm(v, v.shape[-1:], eps=1e-5) + u[None, None] * F.rms_norm(v, v.shape[-1:], eps=eps)
    gate = g - 0.5 * torch.sigmoid(torch.logsumexp(w, -1) - w.mean(-1))
    S = st["S"]
    out = []
    for t in range(q.shape[1]):
        S = gate[:, t, :, None, None].exp() * S + kn[:, t, :, :, None] * vn[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", qn[:, t], S))
    return torch.stack(out, 1), {"S": S}


def _case(T, seed, requires_grad=True, dtype=torch.float32):
    op = from_text(FEATURES, "features.mix")
    args, sizes = random_args(op.ir, B=2, T=T, H=2, sizes=SIZES, dtype=dtype, seed=seed,
                              requires_grad=requires_grad)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=requires_grad)
    return op, args, st


def _close(got, want, what, tol):
    scale = max(1.0, want.abs().max().item())
    err = (got.detach().double() - want.detach()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


@pytest.mark.parametrize("mode,dtype,tol", [("reference", torch.float64, 1e-10), ("torch", torch.float64, 1e-10),
                                            ("recurrent", torch.float32, 2e-5), ("chunk", torch.float32, 2e-5)],
                         ids=["reference", "torch", "recurrent", "chunk"])
def test_every_function_in_every_mode_matches_torch(mode, dtype, tol):
    """B2-T21-H2-K8-V6 (chunk: C = 16, a partial last chunk); output, final state, every gradient
    (the params' and the initial state's too), against the loop with torch's functions."""
    op, args, st = _case(21, seed=5, dtype=dtype)
    o, fin = op(**args, initial_state=st, output_final_state=True, mode=mode)
    o_l, fin_l = features_loop({k: v.double() for k, v in args.items()}, {"S": st["S"].double()})
    _close(o, o_l, f"{mode}: output", tol)
    _close(fin["S"], fin_l["S"], f"{mode}: final state", max(tol, 1e-6))
    gen = torch.Generator().manual_seed(11)
    wo, ws = torch.randn(o_l.shape, generator=gen, dtype=torch.float64), torch.randn(fin_l["S"].shape, generator=gen,
                                                                                   dtype=torch.float64)
    leaves = list(args.values()) + [st["S"]]
    got = torch.autograd.grad((o.double() * wo).sum() + (fin["S"].double() * ws).sum(), leaves)
    want = torch.autograd.grad((o_l * wo).sum() + (fin_l["S"] * ws).sum(), leaves)
    for name, a, b in zip(list(args) + ["initial_state[S]"], got, want):
        _close(a, b, f"{mode}: d/d {name}", max(tol, 1e-6))


def test_the_decode_step_matches_torch():
    op, args, st = _case(4, seed=7, requires_grad=False)
    o_l, fin_l = features_loop({k: v.double() for k, v in args.items()}, {"S": st["S"].double()})
    state = st
    for t in range(4):
        o, state = op.step(**{k: (v[:, t] if v.dim() > 2 and k != "u" else v) for k, v in args.items()}, state=state)
        torch.testing.assert_close(o.double(), o_l[:, t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state["S"].double(), fin_l["S"], rtol=1e-5, atol=1e-5)


def readout_spec(out: str) -> str:
    return f"""
mixer readout
  dims   N, P
  input  x[P], B[N], C[N], dt[]
  state  S[N, P]
  update S = exp(-softplus(dt)) * S + B * x
  output y = {out}
"""


NONLINEAR = {"softmax": "softmax(C @ S, P)", "logsumexp": "logsumexp(C @ S, P) * x",
             "layer_norm": "layer_norm(C @ S, P)", "rms_norm": "rms_norm(C @ S, P, eps=1e-3)",
             "l2norm": "l2norm(C @ S, P)", "over_the_state_dim": "sum(softmax(S, N) * B, N)"}


@pytest.mark.parametrize("name", list(NONLINEAR))
def test_a_readout_through_a_function_is_never_split(name):
    """The output is nonlinear in its readouts: no state dim is split (split_dim None), and the
    dim the function works over is not the recurrent kernels' tile."""
    plan = from_text(readout_spec(NONLINEAR[name]), "r.mix").plan()
    assert plan.output.kind == "nonlinear"
    assert split_dim(plan) is None
    assert tile_dim(plan.kernel_ir) is None if name != "over_the_state_dim" else tile_dim(plan.kernel_ir) == "P"


def test_a_mean_of_a_readout_is_linear_and_split():
    plan = from_text(readout_spec("mean(C @ S, P) + C @ S"), "r.mix").plan()
    assert plan.output.kind == "linear"
    assert split_dim(plan) == "N"


@pytest.mark.parametrize("name", ["softmax", "rms_norm", "over_the_state_dim"])
def test_readouts_at_N128_match_float64(name):
    """B2-T6-H2, N = 128 (where a linear readout's N is split into blocks), P = 4: recurrent
    mode and op.step from a random state within 1e-5 of float64."""
    op = from_text(readout_spec(NONLINEAR[name]), "r.mix")
    args, sizes = random_args(op.ir, B=2, T=6, H=2, sizes={"N": 128, "P": 4}, dtype=torch.float32, seed=31)
    st = random_state(op.ir, 2, 2, sizes)
    ref, _ = op(**{k: v.double() for k, v in args.items()}, initial_state={k: v.double() for k, v in st.items()},
                mode="reference")
    got, _ = op(**args, initial_state=st, mode="recurrent")
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    o, _ = op.step(**{k: v[:, 0] for k, v in args.items()}, state=st)
    torch.testing.assert_close(o.double(), ref[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out", ["layer_norm(C @ S, P)", "mean(C @ S, P) * x + C @ S"], ids=["layer_norm", "mean"])
def test_a_sum_over_a_readout_runs_chunked(out):
    """A sum over a readout's value dim (layer_norm's and mean's) stays in the combine, so the
    chunked kernels take the spec (B2-T21-H2-N8-P5, C = 16): output, final state and every
    gradient against float64 within 4x the torch backend's error."""
    from kernel_checks import check_against_reference
    op = from_text(readout_spec(out), "r.mix")
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes={"N": 8, "P": 5}, dtype=torch.float32, seed=3,
                              requires_grad=True)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk")


def test_mode_chunk_refuses_a_read_it_cannot_take_and_says_why():
    from mixc.standalone.errors import ArgumentError
    op = from_text(readout_spec("(C @ S) / max(max(abs(S), N), P * 1)"), "r.mix")
    args, _ = random_args(op.ir, B=1, T=5, H=1, sizes={"N": 4, "P": 3}, dtype=torch.float32, seed=3)
    with pytest.raises(ArgumentError, match="no chunked kernel .the output reads state S whole in one place"):
        op(**args, mode="chunk")


def test_in_a_sequence_mixer_they_match_torch():
    """Around sequence ops (a short convolution, a cumulative sum), where exponentials are
    carried with a scale: softmax, l2norm and layer_norm of exp(q) * conv equal torch's, B2-T7-H2-D5-L3."""
    spec = """
mixer seqf
  dims   D, L
  input  x[D], q[D]
  param  w[L, D]
  output y = softmax(conv(w, x), D) + l2norm(q * conv(1, x), D) + layer_norm(exp(q) * conv(w, x), D)
"""
    op = from_text(spec, "s.mix")
    g = torch.Generator().manual_seed(0)
    x, q = (torch.randn(2, 7, 2, 5, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    c = sum(F.pad(w[:, j] * x[:, :7 - j], (0, 0, 0, 0, j, 0)) for j in range(3))   # y_t = sum_j w_j x_{t-j}
    cs = x.cumsum(1)
    want = (torch.softmax(c, -1) + (q * cs) / torch.sqrt(((q * cs) ** 2).sum(-1, keepdim=True) + 1e-6)
            + F.layer_norm(q.exp() * c, (5,), eps=1e-5))
    for mode in ("reference", "torch"):
        torch.testing.assert_close(op(x=x, q=q, w=w, mode=mode)[0], want, rtol=1e-12, atol=1e-12)


def test_a_sum_over_a_stabilized_readout_runs_chunked():
    """mLSTM (exponential input gates: the max-stabilizer's states) with layer_norm and a mean
    over V of its readouts, B2-T21-H2-K8-V6 in the chunked kernels against float64, every gradient."""
    from kernel_checks import check_against_reference
    spec = """
mixer mlstm_norm
  dims   K, V
  input  q[K], k[K], v[V], i[], f[]
  option scale = K ** -0.5
  let    ks = k * scale
  state  C[K, V], n[K]
  update C = sigmoid(f) * C + exp(i) * ks * v
  update n = sigmoid(f) * n + exp(i) * ks
  output h = layer_norm((q @ C) / max(abs(q @ n), 1), V) + mean(q @ C, V) * v
"""
    op = from_text(spec, "m.mix")
    assert op.plan().stabilizer is not None and "chunk" in op.plan().forms
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes=SIZES, dtype=torch.float32, seed=9, requires_grad=True)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk")

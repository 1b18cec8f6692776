"""The library spec gsa (Gated Slot Attention, mixc/specs/gsa.mix: a softmax over the slots in
the readout) against a float64 loop written from the paper, in every mode the spec has
(reference, torch, recurrent, chunk, the decode step, packed sequences): outputs, final states
and every gradient (the inputs' and the initial states'); and against fla 0.6's naive
reference (fla/ops/gsa/naive.py) with the same arguments. Fresh random inputs as the paper
draws them: alpha_t = sigmoid(.)^(1/tau) with tau = 8 (g = log alpha_t), s = 1 - alpha_t;
M = 5 slots (not a power of two: the softmax's padded lanes are masked), T not a multiple
of the chunk."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import mixc
from fla_refs import fla_naive, slot_loop
from helpers import random_state

from .test_reference_new_specs import _loss, _loss_weights, assert_close

Kd, Vd, Md = 8, 6, 5
KERNEL_TOL = 2e-5           # the kernels compute in float32
ST_TOL = 1e-6               # the torch backend's states are float32


def paper_loop(a, s0, scale=None):
    """Zhang et al. 2024, eq. (GSA), per head, slots first as the paper writes them
    (tests/fla_refs.py slot_loop): K~_t = diag(alpha_t) K~_{t-1} + s_t k_t^T [M, K],
    V~_t = diag(alpha_t) V~_{t-1} + s_t v_t^T [M, V], o_t = V~_t^T softmax(K~_t (scale q_t)),
    alpha_t = exp(g_t); the states in the spec's layout (Kt[K, M], Vt[M, V])."""
    scale = a["q"].shape[-1] ** -0.5 if scale is None else scale
    o, (hk, hv) = slot_loop(a["q"], a["k"], a["v"], a["s"], a["g"], scale, s0["Kt"], s0["Vt"])
    return o, {"Kt": hk, "Vt": hv}


def case(*, B, T, H, seed, n_states=None, requires_grad=True, dtype=torch.float64):
    op = mixc.load("gsa")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(randn(B, T, H, Md)) / 8                                # log alpha, tau = 8
    args = {"q": randn(B, T, H, Kd), "k": randn(B, T, H, Kd), "v": randn(B, T, H, Vd),
            "s": 1 - g.exp(), "g": g}
    args = {k: v.to(dtype).requires_grad_(requires_grad) for k, v in args.items()}
    s0 = random_state(op.ir, n_states or B, H, {"K": Kd, "V": Vd, "M": Md}, seed=seed + 7,
                      requires_grad=requires_grad)
    return op, args, s0


def check_all(what, o, fin, o_l, fin_l, args, s0, tol):
    assert_close(o, o_l, f"{what}: output", tol=tol)
    for name in ("Kt", "Vt"):
        assert_close(fin[name], fin_l[name], f"{what}: final {name}", tol=max(tol, ST_TOL))
    w = _loss_weights(o_l, fin_l)
    leaves = list(args.values()) + list(s0.values())
    names = list(args) + [f"initial_state[{k}]" for k in s0]
    got = torch.autograd.grad(_loss(o, fin, w), leaves, allow_unused=True)
    want = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for name, a, b in zip(names, got, want):
        assert a is not None, f"{what}: no gradient for {name}"
        assert_close(a, b, f"{what}: d/d {name}", tol=max(tol, ST_TOL))


MODES = [("reference", torch.float64, 1e-10), ("torch", torch.float64, ST_TOL),
         ("recurrent", torch.float32, KERNEL_TOL), ("chunk", torch.float32, KERNEL_TOL)]


@pytest.mark.parametrize("mode,dtype,tol", MODES, ids=[f"{m[0]}-B2-T21-H2-K8-V6-M5" for m in MODES])
def test_every_mode_matches_the_paper(mode, dtype, tol):
    """B2-T21-H2-K8-V6-M5 (chunk: C = 16, a partial last chunk): outputs, final states, every gradient."""
    op, args, s0 = case(B=2, T=21, H=2, seed=3, dtype=dtype)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = paper_loop(args, s0)
    check_all(f"gsa {mode}", o, fin, o_l, fin_l, args, s0, tol)


def test_the_forms_are_the_chunked_kernels_and_the_readout_is_nonlinear():
    """mixc check's forms include chunk (each readout, q @ Kt and Vt, is linear in its own state:
    the softmax combines them after), and the output is nonlinear in the readouts, so no pass
    splits M (the softmax's dim) into blocks; V, pointwise in every expression, may be tiled."""
    from mixc.derive.layout import split_dim, tile_dim
    op = mixc.load("gsa")
    plan = op.plan()
    assert plan.forms == ("chunk", "recurrent", "step")
    assert plan.output.kind == "nonlinear"
    assert split_dim(plan) is None
    assert tile_dim(plan.kernel_ir) == "V"


def test_step_matches_the_paper():
    """Decoding token by token from a random state (B2-T4-H2) equals the loop."""
    op, args, s0 = case(B=2, T=4, H=2, seed=17, requires_grad=False, dtype=torch.float32)
    o_l, fin_l = paper_loop(args, s0)
    st = s0
    for t in range(4):
        o, st = op.step(**{k: v[:, t] for k, v in args.items()}, state=st)
        assert_close(o, o_l[:, t], f"gsa step {t}", tol=KERNEL_TOL)
    for name in ("Kt", "Vt"):
        assert_close(st[name], fin_l[name], f"gsa: {name} after the steps", tol=KERNEL_TOL)


@pytest.mark.parametrize("mode", ["torch", "recurrent", "chunk"])
def test_packed_sequences_match_separate_loops(mode):
    """cu_seqlens with an empty sequence and one longer than a chunk; gradients too."""
    lens = [5, 0, 19, 2]
    dtype = torch.float64 if mode == "torch" else torch.float32
    op, args, s0 = case(B=1, T=sum(lens), H=2, seed=23, n_states=len(lens), dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode)
    outs, finals = [], {"Kt": [], "Vt": []}
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s0_i = {k: v[i:i + 1] for k, v in s0.items()}
        if b == a:                               # an empty sequence keeps its initial state
            fin_i = {k: v.double() for k, v in s0_i.items()}
        else:
            o_i, fin_i = paper_loop({k: v[:, a:b] for k, v in args.items()}, s0_i)
            outs.append(o_i)
        for k in finals:
            finals[k].append(fin_i[k])
    tol = ST_TOL if mode == "torch" else KERNEL_TOL
    check_all(f"gsa {mode} packed", o, fin, torch.cat(outs, 1), {k: torch.cat(v, 0) for k, v in finals.items()},
              args, s0, tol)


@pytest.mark.parametrize("mode", ["reference", "recurrent", "chunk"])
def test_fla_naive_reference(mode):
    """fla 0.6's naive_recurrent_gsa with the same arguments (its states the tuple (hk, hv) in
    the spec's layouts); fla computes in float32."""
    op, args, s0 = case(B=2, T=21, H=2, seed=29, requires_grad=False, dtype=torch.float32)
    naive = fla_naive("gsa/naive", "naive_recurrent_gsa")
    ref_o, (hk, hv) = naive(args["q"], args["k"], args["v"], args["s"], args["g"], scale=0.3,
                            initial_state=(s0["Kt"], s0["Vt"]), output_final_state=True)
    o, fin = op(**args, scale=0.3, initial_state=s0, output_final_state=True, mode=mode)
    assert_close(o, ref_o.double(), f"gsa {mode} vs fla: output", tol=1e-5)
    assert_close(fin["Kt"], hk.double(), f"gsa {mode} vs fla: hk", tol=1e-5)
    assert_close(fin["Vt"], hv.double(), f"gsa {mode} vs fla: hv", tol=1e-5)


@pytest.mark.slow
def test_chunk_over_three_tile_blocks_matches_the_paper(monkeypatch):
    """B1-T37-H2-K8-V40-M5, C = 16, V in tiles of 16 (three blocks, the last partial), two
    launches: the backward's PHASE 2 split over V blocks (codegen/tile_split.py) keeps the
    softmax over M whole in each block; output, final states, every gradient."""
    from mixc.runtime import launch
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    monkeypatch.setattr(sys.modules[__name__], "Vd", 40)
    op, args, s0 = case(B=1, T=37, H=2, seed=41, dtype=torch.float32)
    assert args["v"].shape[-1] == 40
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="chunk", chunk=16)
    o_l, fin_l = paper_loop(args, s0)
    check_all("gsa chunk V40", o, fin, o_l, fin_l, args, s0, KERNEL_TOL)

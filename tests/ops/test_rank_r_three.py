"""The rank-r class at r = 3 (issue 18: "r >= 3 is supported by the rank-r template but
untested"): gated DeltaProduct with three Householder steps per token, written nested as the
paper does (each step on the state the step before left), in the chunked Triton kernels
(rank_r.py) under the interpreter and in the torch backend's chunked form (rank_r.py),
against a float64 loop with the semantics of fla's naive_recurrent_gated_delta_product
(decay, then the steps in order): output, final state, every gradient and the initial
state's; T = 40 over chunks of 16 (the last one partial), K = V = 16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import random_state
from mixc.runtime import torch_chunk

from .test_reference_new_specs import _loss, _loss_weights, assert_close

STEPS = 3
# S_j = S_{j-1} + beta_j k_j (v_j - k_j @ S_{j-1}), S_0 = exp(g) S: each step nested in the next
_step = "a * S"
for _j in range(1, STEPS + 1):
    _step = f"({_step}) + beta{_j} * k{_j} * (v{_j} - k{_j} @ ({_step}))"
_J = range(1, STEPS + 1)
_INPUTS = ", ".join(["q[K]"] + [f"k{j}[K]" for j in _J] + [f"v{j}[V]" for j in _J] + ["g[]"]
                   + [f"beta{j}[]" for j in _J])
SPEC = f"""mixer gated_delta_product_3
  dims   K, V
  input  {_INPUTS}
  option scale = K ** -0.5
  let    a = exp(g)
  state  S[K, V]
  update S = {_step}
  output o = (q * scale) @ S
"""


@pytest.fixture(scope="module")
def op(tmp_path_factory):
    f = tmp_path_factory.mktemp("rank3") / "gdp3.mix"
    f.write_text(SPEC)
    return mixc.load(str(f))


def delta_product_loop(a, s0, nh=STEPS):
    """fla's naive_recurrent_gated_delta_product, per token: S = exp(g) S, then for each step j
    S = S + beta_j k_j (v_j - S^T k_j)^T; o = scale q^T S (fla's k, v, beta interleave the steps)."""
    q, g = a["q"], a["g"]
    S, out = s0["S"], []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        for j in range(1, nh + 1):
            k, v, b = a[f"k{j}"][:, t], a[f"v{j}"][:, t], a[f"beta{j}"][:, t]
            err = v - torch.einsum("bhk,bhkv->bhv", k, S)
            S = S + b[..., None, None] * k[..., :, None] * err[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * q.shape[-1] ** -0.5, S))
    return torch.stack(out, 1), {"S": S}


def _inputs(B, T, H, D, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    args = {"q": randn(B, T, H, D)}
    for j in range(1, STEPS + 1):
        args[f"k{j}"] = F.normalize(randn(B, T, H, D), dim=-1)      # unit keys, as fla expects
        args[f"v{j}"] = randn(B, T, H, D)
    args["g"] = F.logsigmoid(randn(B, T, H) + 2)
    for j in range(1, STEPS + 1):
        args[f"beta{j}"] = torch.sigmoid(randn(B, T, H))
    return {k: v.requires_grad_() for k, v in args.items()}


def test_three_steps_are_rank_three(op):
    plan = op.plan()
    st = plan.states[0]
    assert st.transition == "rank-r correction" and len(st.rank1) == 3
    assert len(st.ir_pieces.terms) == 3 and len(st.ir_pieces.inputs) == 3
    assert plan.layout.chunked and plan.layout.torch_chunked and plan.layout.chunk_size == 16


@pytest.mark.parametrize("mode", ["chunk", "torch"])
def test_three_steps_match_the_loop(op, mode, monkeypatch):
    calls = []
    if mode == "torch":
        run = torch_chunk.torch_forward_loop
        monkeypatch.setattr(torch_chunk, "torch_forward_loop", lambda *a, **kw: calls.append(kw["C"]) or run(*a, **kw))
    B, T, H, D = 1, 40, 2, 16
    args = _inputs(B, T, H, D, seed=71 if mode == "chunk" else 73)
    s0 = random_state(op.ir, B, H, {"K": D, "V": D}, seed=8, requires_grad=True)
    kw = {"chunk": 16}
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode, **kw)
    if mode == "torch":
        assert calls == [16]                                # the chunked torch form, not the token loop
    o_l, fin_l = delta_product_loop(args, s0)
    tol = 2e-5 if mode == "chunk" else 1e-6                 # the kernels compute in float32; torch's states too
    assert_close(o, o_l, f"r=3 {mode}: output", tol=tol)
    assert_close(fin["S"], fin_l["S"], f"r=3 {mode}: final state", tol=tol)
    w = _loss_weights(o_l, fin_l)
    leaves = list(args.values()) + [s0["S"]]
    got = torch.autograd.grad(_loss(o, fin, w), leaves, allow_unused=True)
    want = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for name, a, b in zip(list(args) + ["initial_state[S]"], got, want):
        assert a is not None, f"r=3 {mode}: no gradient for {name}"
        assert_close(a, b, f"r=3 {mode}: d/d {name}", tol=tol)

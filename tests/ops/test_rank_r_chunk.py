"""The rank-r class's chunked Triton kernels (mixc/classes/rank_r.py: the generalized UT
transform, as r x r blocks of [C, C]) under Triton's interpreter against fla's DeltaProduct
loop (tests/ops/test_reference_new_specs.py's gdp_loop, written from fla's naive reference, not
from the spec), float64 inputs: the output, the final state and every gradient (the initial
state's too), for both ways of writing DeltaProduct (the library spec expanded by hand and the
nested example), T not a multiple of C (a partial last chunk), several chunks, and packed
sequences (cu_seqlens, an empty one among them) against separate loops."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import random_state
from ops.test_reference_new_specs import assert_close, assert_gradients_match, gdp_loop, make_case

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"library": None, "nested": ROOT / "examples" / "gated_delta_product_nested.mix"}
TOL = 2e-5          # the kernels compute in float32; the loop in float64


def _case(which, *, B, T, H, seed):
    op, args, sizes, call, full = make_case("gated_delta_product", B=B, T=T, H=H, n=5, seed=seed,
                                            requires_grad=True)
    if SPECS[which] is not None:
        op = mixc.load(str(SPECS[which]))
    return op, args, sizes, call, full


@pytest.mark.parametrize("which", list(SPECS))
def test_chunk_is_the_plans_form(which):
    op = _case(which, B=1, T=2, H=1, seed=0)[0]
    plan = op.plan()
    assert plan.states[0].transition == "rank-r correction"
    assert "chunk" in plan.states[0].forms and plan.layout.chunk_unsupported is None
    assert plan.layout.chunk_size == 16


@pytest.mark.parametrize("which", list(SPECS))
def test_chunk_matches_fla_loop(which):
    """T = 25 over chunks of 16 (the second chunk partial), an initial state."""
    B, T, H = 2, 25, 2
    op, args, sizes, call, full = _case(which, B=B, T=T, H=H, seed=41)
    s0 = random_state(op.ir, B, H, sizes, seed=6, requires_grad=True)
    o, fin = op(**args, **call, initial_state=s0, output_final_state=True, mode="chunk")
    o_l, fin_l = gdp_loop(args, full, s0)
    assert_close(o, o_l, f"{which} chunk: output", tol=TOL)
    assert_close(fin["S"], fin_l["S"], f"{which} chunk: final state", tol=TOL)
    assert_gradients_match(f"{which} chunk", o, fin, o_l, fin_l, args, s0, tol=TOL)


def test_chunk_packed_sequences_match_separate_loops():
    lens = [19, 0, 5, 16]
    op, args, sizes, call, full = _case("library", B=1, T=sum(lens), H=2, seed=29)
    s0 = random_state(op.ir, len(lens), 2, sizes, seed=8, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    o, fin = op(**args, **call, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode="chunk")
    per_token = {d.name for d in op.ir.inputs}
    outs, fins = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: (v[:, a:b] if k in per_token else v) for k, v in args.items()}
        if b == a:                               # an empty sequence keeps its initial state
            o_l, fin_l = o[:, a:b].detach().double(), {"S": s0["S"][i:i + 1]}
        else:
            o_l, fin_l = gdp_loop(part, full, {"S": s0["S"][i:i + 1]})
        if b > a:
            assert_close(o[:, a:b], o_l, f"packed chunk: output of sequence {i}", tol=TOL)
        assert_close(fin["S"][i:i + 1], fin_l["S"], f"packed chunk: final state of sequence {i}", tol=TOL)
        outs.append(o_l)
        fins.append(fin_l["S"])
    o_l, fin_l = torch.cat(outs, 1), {"S": torch.cat(fins, 0)}
    assert_gradients_match("packed chunk", o, fin, o_l, fin_l, args, s0, tol=TOL)


# DeltaProduct with a per-key decay (KDA's gate, two Householder steps): rank_r.py's [C, C, K]
# variant; the loop below is written from the recurrence, not from the spec
PER_KEY = """mixer gdp_key
  dims   K, V
  input  q[K], k1[K], k2[K], v1[V], v2[V], g[K], beta1[], beta2[]
  let    a = exp(g)
  state  S[K, V]
  update S = a * S + beta1 * k1 * (v1 - k1 @ (a * S))
             + beta2 * k2 * (v2 - k2 @ (a * S + beta1 * k1 * (v1 - k1 @ (a * S))))
  output o = q @ S
"""


def per_key_loop(a, s0):
    S = s0["S"]
    out = []
    for t in range(a["q"].shape[1]):
        S = S * a["g"][:, t].exp()[..., None]
        for j in (1, 2):
            k, v, beta = a[f"k{j}"][:, t], a[f"v{j}"][:, t], a[f"beta{j}"][:, t]
            err = v - torch.einsum("bhk,bhkv->bhv", k, S)
            S = S + beta[..., None, None] * k[..., :, None] * err[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", a["q"][:, t], S))
    return torch.stack(out, 1), {"S": S}


def test_per_key_decay_chunk_matches_loop(tmp_path):
    f = tmp_path / "gdp_key.mix"
    f.write_text(PER_KEY)
    op = mixc.load(str(f))
    st = op.plan().states[0]
    assert st.transition == "rank-r correction" and st.decay_dims == ("K",) and "chunk" in st.forms
    B, T, H, K, V = 1, 21, 2, 4, 5
    gen = torch.Generator().manual_seed(23)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    args = {"q": randn(B, T, H, K), "k1": F.normalize(randn(B, T, H, K), dim=-1),
            "k2": F.normalize(randn(B, T, H, K), dim=-1), "v1": randn(B, T, H, V), "v2": randn(B, T, H, V),
            "g": F.logsigmoid(randn(B, T, H, K) + 2), "beta1": torch.sigmoid(randn(B, T, H)),
            "beta2": torch.sigmoid(randn(B, T, H))}
    args = {k: v.requires_grad_(True) for k, v in args.items()}
    s0 = {"S": randn(B, H, K, V).requires_grad_(True)}
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="chunk")
    o_l, fin_l = per_key_loop(args, s0)
    assert_close(o, o_l, "per-key chunk: output", tol=TOL)
    assert_close(fin["S"], fin_l["S"], "per-key chunk: final state", tol=TOL)
    assert_gradients_match("per-key chunk", o, fin, o_l, fin_l, args, s0, tol=TOL)

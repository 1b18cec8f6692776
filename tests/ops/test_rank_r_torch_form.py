"""The rank-r class's torch chunked form (mixc/classes/rank_r.py: the generalized UT transform,
a [C*r, C*r] block triangular solve per chunk) against the float64 loop of fla's
naive_recurrent_gated_delta_product (test_reference_new_specs.gdp_loop): output, final state
and every gradient (autograd through the form), on chunks that do not divide the sequence.

The terms l_(t,i), r_(t,i) are the plan's own (the distributed and merged affine form of
examples/gated_delta_product_nested.mix, evaluated per token), so this checks the derivation's
rank-2 form and the chunk algorithm together; the input term B_t = sum_m k_m v_m^T is written
out here (the plan keeps B_t as one expression: it is not one outer product)."""
from __future__ import annotations

import pytest
import torch

import mixc

from mixc.classes import rank_r, torch_ops
from mixc.runtime.reference import _align
from helpers import random_state

from ..derive.torch_eval import NamedEval
from .test_compound_updates import nested
from .test_reference_new_specs import _l2, _loss, _loss_weights, assert_close, gdp_loop, make_case

UNIT = rank_r.UNIT


def _terms(plan, args, opts, sizes):
    """L, R [B, T, H, r, K] from the plan's rank-r terms, evaluated on the whole sequence."""
    ir = plan.ir
    values = {n: (x, ir.input(n).shape) for n, x in args.items()}
    values.update({n: (torch.tensor(float(v), dtype=torch.float64).reshape(1, 1, 1), ()) for n, v in opts.items()})
    ev = NamedEval(plan.table, values, 3, sizes, ir.dim_names)
    st = plan.states[0]

    def over_k(e):
        t, dims = ev(e)
        assert set(dims) <= {"K"}
        return _align((t, dims), ("K",), 3).expand(t.shape[:3] + (sizes["K"],))

    L = torch.stack([over_k(r.left) for r in st.rank1], 3)
    R = torch.stack([over_k(r.right) for r in st.rank1], 3)
    return L, R


def rank_r_chunks(args, full, s0, plan, sizes, C):
    q, g = args["q"], args["g"]
    k1, k2 = args["k1"], args["k2"]
    if full.get("use_qk_l2norm_in_kernel"):
        q, k1, k2 = _l2(q), _l2(k1), _l2(k2)
    opts = {"scale": full["scale"]}
    L, R = _terms(plan, args, opts, sizes)
    # B_t = b1 k1 v1^T + b2 k2 (v2 - b1 (k1 . k2) v1)^T: the two steps' keys and values
    b1, b2 = args["beta1"][..., None], args["beta2"][..., None]
    c12 = (k1 * k2).sum(-1, keepdim=True)
    K = torch.stack([k1, k2], 3)
    V = torch.stack([b1 * args["v1"], b2 * (args["v2"] - b1 * c12 * args["v1"])], 3)
    st = {"class": UNIT.name, "decay": "scalar"}
    S, out = s0["S"], []
    for c0 in range(0, q.shape[1], C):
        sl = slice(c0, c0 + C)
        bb = torch_ops.loop_chunk_logs(g[:, sl])
        ctx = UNIT.torch_setup(st, K[:, sl], V[:, sl], L[:, sl], R[:, sl], S, bb)
        out.append(UNIT.torch_readout(st, q[:, sl] * full["scale"], K[:, sl], V[:, sl], L[:, sl], S, bb, False,
                                      None, ctx))
        S = UNIT.torch_advance(st, K[:, sl], V[:, sl], L[:, sl], S, bb, None, ctx)
    return torch.cat(out, 1), {"S": S}


@pytest.mark.parametrize("C", [4, 16])
@pytest.mark.parametrize("flags", ["plain", "l2norm"])
def test_rank_r_torch_form_matches_loop(flags, C):
    B, T, H = 2, 10, 2
    name = "gated_delta_product" + ("-l2norm" if flags == "l2norm" else "")
    lib, args, sizes, call, full = make_case(name, B=B, T=T, H=H, n=3, seed=23, requires_grad=True)
    s0 = random_state(lib.ir, B, H, sizes, seed=9, requires_grad=True)
    plan = nested().plan(use_qk_l2norm_in_kernel=flags == "l2norm")
    assert plan.states[0].transition == UNIT.name and len(plan.states[0].rank1) == 2
    o, fin = rank_r_chunks(args, full, s0, plan, sizes, C)
    o_l, fin_l = gdp_loop(args, full, s0)
    assert_close(o, o_l, f"{flags} C={C}: output")
    assert_close(fin["S"], fin_l["S"], f"{flags} C={C}: final state")
    w = _loss_weights(o_l, fin_l)
    leaves = list(args.values()) + list(s0.values())
    g = torch.autograd.grad(_loss(o, fin, w), leaves)
    g_l = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for n, a, b in zip(list(args) + ["initial_state[S]"], g, g_l):
        assert_close(a, b, f"{flags} C={C}: d/d {n}", tol=1e-9)


def test_a_token_s_terms_read_the_same_state():
    """The diagonal blocks of A_rl are zero: u_(t,1) and u_(t,2) both read S_{t-1}. With one
    token per chunk the form is one recurrence step: S_1 = a S0 + sum_i l_i (r_i . S0) + k v^T."""
    gen = torch.Generator().manual_seed(3)
    B, H, r, K, V = 1, 1, 3, 4, 5
    L, R = (torch.randn(B, 1, H, r, K, generator=gen, dtype=torch.float64) for _ in range(2))
    Kin = torch.randn(B, 1, H, 1, K, generator=gen, dtype=torch.float64)
    Vin = torch.randn(B, 1, H, 1, V, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, 1, H, generator=gen, dtype=torch.float64)
    st = {"decay": "scalar"}
    bb = torch_ops.loop_chunk_logs(g)
    ctx = UNIT.torch_setup(st, Kin, Vin, L, R, S0, bb)
    S1 = UNIT.torch_advance(st, Kin, Vin, L, S0, bb, None, ctx)
    l, rr, s = L[0, 0, 0], R[0, 0, 0], S0[0, 0]
    want = g.exp()[0, 0, 0] * s + torch.einsum("ik,iv->kv", l, rr @ s) + torch.outer(Kin[0, 0, 0, 0], Vin[0, 0, 0, 0])
    assert_close(S1[0, 0], want, "one token")


# DeltaProduct with a decay per key (KDA's gate before two delta steps), nested as the paper writes it
PER_KEY = """mixer dp_key
  dims   K, V
  input  q[K], k1[K], k2[K], v1[V], v2[V], g[K], beta1[], beta2[]
  state  S[K, V]
  update S = exp(g) * S + beta1 * k1 * (v1 - k1 @ (exp(g) * S))
             + beta2 * k2 * (v2 - k2 @ (exp(g) * S + beta1 * k1 * (v1 - k1 @ (exp(g) * S))))
  output o = q @ S
"""


def per_key_loop(a, s0):
    S, out = s0["S"], []
    for t in range(a["q"].shape[1]):
        S = S * a["g"][:, t].exp()[..., None]
        for j in (1, 2):
            k, v, b = a[f"k{j}"][:, t], a[f"v{j}"][:, t], a[f"beta{j}"][:, t]
            S = S + b[..., None, None] * k[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))[:, :, None]
        out.append(torch.einsum("bhk,bhkv->bhv", a["q"][:, t], S))
    return torch.stack(out, 1), {"S": S}


@pytest.mark.parametrize("C", [3, 8])
def test_rank_r_torch_form_with_a_per_key_decay(C, tmp_path):
    f = tmp_path / "dp_key.mix"
    f.write_text(PER_KEY)
    op = mixc.load(str(f))
    plan = op.plan()
    assert plan.states[0].transition == UNIT.name and plan.states[0].decay_dims == ("K",)
    B, T, H, Kd, Vd = 2, 8, 2, 4, 5
    args, s0 = per_key_inputs(B, T, H, Kd, Vd, seed=41)
    sizes = {"K": Kd, "V": Vd}
    L, R = _terms(plan, args, {}, sizes)
    b1, b2 = args["beta1"][..., None], args["beta2"][..., None]
    c12 = (args["k1"] * args["k2"]).sum(-1, keepdim=True)
    K = torch.stack([args["k1"], args["k2"]], 3)
    V = torch.stack([b1 * args["v1"], b2 * (args["v2"] - b1 * c12 * args["v1"])], 3)
    st = {"decay": UNIT.decay_axis(plan.states[0])}
    assert st["decay"] == "key"
    S, out = s0["S"], []
    for c0 in range(0, T, C):
        sl = slice(c0, c0 + C)
        bb = torch_ops.loop_chunk_logs(args["g"][:, sl])
        ctx = UNIT.torch_setup(st, K[:, sl], V[:, sl], L[:, sl], R[:, sl], S, bb)
        out.append(UNIT.torch_readout(st, args["q"][:, sl], K[:, sl], V[:, sl], L[:, sl], S, bb, False, None, ctx))
        S = UNIT.torch_advance(st, K[:, sl], V[:, sl], L[:, sl], S, bb, None, ctx)
    o, fin = torch.cat(out, 1), {"S": S}
    o_l, fin_l = per_key_loop(args, s0)
    assert_close(o, o_l, f"C={C}: output")
    assert_close(fin["S"], fin_l["S"], f"C={C}: final state")
    w = _loss_weights(o_l, fin_l)
    leaves = list(args.values()) + list(s0.values())
    g = torch.autograd.grad(_loss(o, fin, w), leaves)
    g_l = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for n, a, b in zip(list(args) + ["initial_state[S]"], g, g_l):
        assert_close(a, b, f"C={C}: d/d {n}", tol=1e-9)
    o_ref, fin_ref = op(**args, initial_state=s0, output_final_state=True, mode="reference")
    assert_close(o_ref, o_l, "the reference vs the loop")


def per_key_inputs(B, T, H, Kd, Vd, seed):
    """Fresh float64 inputs of PER_KEY (unit keys, log decays below 0, gates in (0, 1)) and an
    initial state, all requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (Kd,), "k1": (Kd,), "k2": (Kd,), "v1": (Vd,), "v2": (Vd,), "g": (Kd,), "beta1": (), "beta2": ()}
    args = {n: torch.randn((B, T, H) + sh, generator=gen, dtype=torch.float64) for n, sh in shapes.items()}
    for n in ("k1", "k2"):
        args[n] = torch.nn.functional.normalize(args[n], dim=-1)
    args["g"] = torch.nn.functional.logsigmoid(args["g"] + 2)
    args["beta1"], args["beta2"] = args["beta1"].sigmoid(), args["beta2"].sigmoid()
    args = {n: x.requires_grad_() for n, x in args.items()}
    s0 = {"S": torch.randn(B, H, Kd, Vd, generator=gen, dtype=torch.float64).requires_grad_()}
    return args, s0

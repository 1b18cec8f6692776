"""mode='torch' (and 'auto' on CPU) of the rank-r class: DeltaProduct, written nested
(examples/gated_delta_product_nested.mix) and expanded (the library's gated_delta_product), runs
the torch backend's chunked form (mixc/classes/rank_r.py: the generalized UT transform, L and R
with a term axis, K and V with an input-term axis, one chunk at a time in
runtime/torch_chunk.py), checked against the float64 loop of fla's
naive_recurrent_gated_delta_product (test_reference_new_specs.gdp_loop): outputs, final states
and every gradient, with an initial state, on chunks that do not divide the sequence, fixed
length and packed (cu_seqlens)."""
from __future__ import annotations

import pytest
import torch

import mixc
from mixc.derive.explain import explain
from mixc.runtime import torch_chunk
from mixc.runtime.cache import load_module
from helpers import random_state

from .test_compound_updates import nested
from .test_reference_new_specs import _loss, _loss_weights, assert_close, gdp_loop, make_case

SPECS = {"nested": nested, "library": lambda: mixc.load("gated_delta_product")}
ST_TOL = 1e-6            # the torch backend's states are float32 (CONVENTIONS); outputs float64


def _case(flags: str, **kw):
    return make_case("gated_delta_product" + ("-l2norm" if flags == "l2norm" else ""), **kw)


def _grads(o, fin, o_l, fin_l, leaves):
    w = _loss_weights(o_l, fin_l)
    return torch.autograd.grad(_loss(o, fin, w), leaves), torch.autograd.grad(_loss(o_l, fin_l, w), leaves)


@pytest.mark.parametrize("spec", list(SPECS))
def test_the_torch_chunked_form_serves_it(spec):
    op = SPECS[spec]()
    for l2 in (False, True):
        plan = op.plan(use_qk_l2norm_in_kernel=l2)
        st = plan.states[0]
        assert st.transition == "rank-r correction" and len(st.ir_pieces.terms) == 2
        assert len(st.ir_pieces.inputs) == 2                  # B_t: one outer product per Householder step
        assert plan.layout.torch_chunked and plan.layout.chunked       # the kernels too (rank_r.py)
        mod = load_module(plan)
        assert mod.TORCH_STATES["S"]["class"] == "rank-r correction" and mod.METADATA["torch_forward"]
        text = explain(plan)
        assert "the torch backend runs this chunked form (mode='torch'" in text
        assert "m = 2 outer products" in text
        assert not any("rank-r" in n for n in plan.notes)              # no note: nothing is missing


@pytest.mark.parametrize("spec,flags,mode,chunk", [
    ("nested", "plain", "torch", 3), ("nested", "l2norm", "auto", 16),
    ("library", "plain", "auto", None), ("library", "l2norm", "torch", 4)])
def test_torch_mode_matches_loop(spec, flags, mode, chunk, chunk_calls, monkeypatch):
    if mode == "auto":            # auto on CPU without Triton's interpreter is the torch backend
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    B, T, H = 2, 20, 2              # C = 16 (auto's smallest), 3 and 4 leave a partial last chunk
    lib, args, sizes, call, full = _case(flags, B=B, T=T, H=H, n=3, seed=37, requires_grad=True)
    s0 = random_state(lib.ir, B, H, sizes, seed=12, requires_grad=True)
    op = SPECS[spec]()
    kw = {} if chunk is None else {"chunk": chunk}
    o, fin = op(**args, **call, initial_state=s0, output_final_state=True, mode=mode, **kw)
    assert chunk_calls == [chunk or torch_chunk.TORCH_CHUNK]
    o_l, fin_l = gdp_loop(args, full, s0)
    what = f"{spec} {flags} {mode} C={chunk}"
    assert_close(o, o_l, f"{what}: output")
    assert_close(fin["S"], fin_l["S"], f"{what}: final state", tol=ST_TOL)
    leaves = list(args.values()) + list(s0.values())
    for name, a, b in zip(list(args) + ["initial_state[S]"], *_grads(o, fin, o_l, fin_l, leaves)):
        assert_close(a, b, f"{what}: d/d {name}", tol=ST_TOL)


@pytest.mark.parametrize("spec", list(SPECS))
def test_packed_sequences_match_separate_loops(spec, chunk_calls):
    """cu_seqlens with an empty sequence and one longer than two chunks; gradients too."""
    lens = [5, 0, 7, 2]
    lib, args, sizes, call, full = _case("plain", B=1, T=sum(lens), H=2, n=3, seed=43, requires_grad=True)
    s0 = random_state(lib.ir, len(lens), 2, sizes, seed=15, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    o, fin = SPECS[spec]()(**args, **call, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode="torch",
                           chunk=3)
    assert chunk_calls == [3]
    per_token = {d.name for d in lib.ir.inputs}
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if b == a:                               # an empty sequence keeps its initial state
            finals.append(s0["S"][i:i + 1])
            continue
        part = {k: (v[:, a:b] if k in per_token else v) for k, v in args.items()}
        o_i, fin_i = gdp_loop(part, full, {"S": s0["S"][i:i + 1]})
        outs.append(o_i)
        finals.append(fin_i["S"])
    o_l, fin_l = torch.cat(outs, 1), {"S": torch.cat(finals, 0)}
    assert_close(o, o_l, f"{spec} packed: output")
    assert_close(fin["S"], fin_l["S"], f"{spec} packed: final states", tol=ST_TOL)
    leaves = list(args.values()) + list(s0.values())
    for name, a, b in zip(list(args) + ["initial_state[S]"], *_grads(o, fin, o_l, fin_l, leaves)):
        assert_close(a, b, f"{spec} packed: d/d {name}", tol=ST_TOL)


def test_a_non_finite_token_poisons_only_its_rows_on():
    """A NaN in one token's key (mid-chunk) makes that sequence's output NaN from that token on
    and its final state NaN; its earlier rows and the other sequence stay the loop's (the rank-r
    pieces, with their term axis, are masked like the others' before the chunk's matmuls)."""
    B, T, H, t_bad = 2, 10, 2, 5
    lib, args, sizes, call, full = _case("plain", B=B, T=T, H=H, n=3, seed=47)
    bad = dict(args, k2=args["k2"].clone())
    bad["k2"][0, t_bad, 1, 0] = float("nan")
    o, fin = lib(**bad, **call, output_final_state=True, mode="torch", chunk=4)
    o_l, fin_l = gdp_loop(args, full, None)
    assert_close(o[0, :t_bad], o_l[0, :t_bad], "rows before the NaN token")
    assert torch.isnan(o[0, t_bad:, 1]).all() and torch.isnan(fin["S"][0, 1]).all()
    assert_close(o[1], o_l[1], "the other sequence")
    assert_close(fin["S"][1], fin_l["S"][1], "the other sequence's state", tol=ST_TOL)


def test_a_per_key_decay_in_torch_mode(tmp_path):
    """DeltaProduct behind a decay per key (KDA's gate): the plan's g over K reaches the per-key
    path of the form; outputs, final state and gradients against the loop."""
    from .test_rank_r_torch_form import PER_KEY, per_key_inputs, per_key_loop
    f = tmp_path / "dp_key.mix"
    f.write_text(PER_KEY)
    op = mixc.load(str(f))
    assert op.plan().layout.torch_chunked
    B, T, H, Kd, Vd = 2, 11, 2, 4, 5
    args, s0 = per_key_inputs(B, T, H, Kd, Vd, seed=53)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=4)
    o_l, fin_l = per_key_loop(args, s0)
    assert_close(o, o_l, "per-key decay: output")
    assert_close(fin["S"], fin_l["S"], "per-key decay: final state", tol=ST_TOL)
    leaves = list(args.values()) + list(s0.values())
    for name, a, b in zip(list(args) + ["initial_state[S]"], *_grads(o, fin, o_l, fin_l, leaves)):
        assert_close(a, b, f"per-key decay: d/d {name}", tol=ST_TOL)


# a rank-2 update whose input term is no sum of outer products (exp(k v^T) is full rank)
FULL_RANK_INPUT = """mixer dp_full
  dims   K, V
  input  q[K], k1[K], k2[K], v[V], b1[], b2[]
  state  S[K, V]
  update S = S - b1 * k1 * (k1 @ S) - b2 * k2 * (k2 @ S) + 0.1 * exp(k1 * v)
  output o = q @ S
"""


def test_an_input_term_that_is_no_sum_of_outer_products(tmp_path):
    """The rank-r class without m outer products: no torch chunked form, said so (layout and
    explain); mode='torch' is then the loop over tokens, still the reference's numbers; and
    context parallelism refuses it, naming why, before it needs a shard's transition."""
    import torch.distributed as dist
    from mixc.runtime.inputs import random_args
    from mixc.runtime.signature import ArgumentError
    f = tmp_path / "dp_full.mix"
    f.write_text(FULL_RANK_INPUT)
    op = mixc.load(str(f))
    plan = op.plan()
    assert plan.states[0].transition == "rank-r correction" and plan.states[0].ir_pieces.inputs == ()
    why = "the input term of state S is not a sum of outer products key (x) value"
    assert plan.layout.torch_chunk_unsupported == why
    assert f"no chunked form: {why}" in explain(plan)
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes={"K": 3, "V": 4}, seed=5)
    o, _ = op(**args, mode="torch")
    o_ref, _ = op(**args, mode="reference")
    assert_close(o, o_ref, "the token loop", tol=1e-6)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ArgumentError, match=r"cp_group: mixer 'dp_full' has no chunked form \(its transition "
                           r"is rank-r correction: the input term of state S is not a sum of outer products"):
            op(**args, cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()

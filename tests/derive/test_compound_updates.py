"""Compound linear updates (issue 18 item 1): a contraction of an expression that is itself
affine in the state is distributed, terms with the same projection merge, and an update
diag(a) S + sum_i u_i (w_i @ S) + B with r >= 2 projections over the key dims is the rank-r
class (mixc/classes/rank_r.py), which `mixc explain` describes."""
from __future__ import annotations

from pathlib import Path

import pytest
import sympy as sp

import mixc
from mixc.classes import rank_r
from mixc.cli import main
from mixc.derive import plan as P
from mixc.derive.explain import explain
from mixc.derive.plan import derive

from . import test_plan_numeric

ROOT = Path(__file__).resolve().parents[2]
NESTED = ROOT / "examples" / "gated_delta_product_nested.mix"
RANK_R = rank_r.UNIT.name


def _plan(update: str, inputs="q[K], k[K], v[V], k1[K], k2[K], k3[K], b1[], b2[], b3[], a[], g[K]",
          lets="") -> P.Plan:
    text = (f"mixer m\n dims K, V\n input {inputs}\n{lets} state S[K, V]\n update S = {update}\n"
            " output o = q @ S")
    return derive(mixc.parse(text, "m.mix"))


def _projections(st: P.StatePlan) -> list[str]:
    return [str(r.right) for r in st.rank1]


def _steps(n: int, decayed: str) -> str:
    """DeltaProduct's update with n steps, each written on the state the step before left."""
    x = f"({decayed})"
    for i in range(1, n + 1):
        x = f"({x} + b{i} * k{i} * (v - k{i} @ {x}))"
    return x


@pytest.mark.parametrize("spec", ["gated_delta_product", str(NESTED)], ids=["library", "nested"])
@pytest.mark.parametrize("l2norm", [False, True])
def test_delta_product_is_rank_2(spec, l2norm):
    plan = mixc.load(spec).plan(use_qk_l2norm_in_kernel=l2norm)
    st = plan.states[0]
    assert plan.transition == st.transition == RANK_R
    assert plan.forms == ("chunk", "recurrent", "step")   # the chunked kernels: rank_r.py
    assert len(st.rank1) == 2 and all(r.over == ("K",) for r in st.rank1)
    k1, k2 = sp.symbols("k1 k2", real=True)
    want = [k1, k2] if not l2norm else None
    if want is not None:
        assert [r.right for r in st.rank1] == want
    assert sp.simplify(st.log_decay - sp.Symbol("g", real=True)) == 0
    assert plan.layout.chunk_unsupported is None


def test_nested_projection_distributes_into_rank_1():
    """k @ (k * (k @ S)) = (k @ k) (k @ S): one projection (it used to be refused as
    'projects the state twice')."""
    st = _plan("S + k * (k @ (b1 * k * (k @ S))) + k * v").states[0]
    assert st.transition == P.RANK1 and _projections(st) == ["k"]
    assert str(st.rank1[0].left) == "(k)@(b1*k)*k"        # (k . b1 k) k: the outer sum met c = b1 k


# the affine forms, run as a recurrence, against the reference (test_plan_numeric's check):
# each term's scale, projection and sum, the merged scales and the constant, numerically
NUMERIC = {
    "nested-rank-1": "S + k * (k @ (b1 * k * (k @ S))) + k * v",
    "three-steps": _steps(3, "sigmoid(a) * S"),
    "per-key-decay": "exp(g) * S - b1 * k1 * (k1 @ (exp(g) * S)) - b2 * k2 * (k2 @ (exp(g) * S + k1 * (k1 @ S)))",
    "merged-let": "S - k * (k @ S) - q * (kk @ S) + k * v",
    # a sum over V of a term projected over K: the projection widens to K and V
    "widened": "S + k * sum(v * (k @ (a * S - k * (k @ S))), V) + k * v",
    "value-projection": "S - k * (k @ (S - k * (S @ v))) + k * v",
    # a sum over K of a term projected over K: the outer K is the scale's own, summed into it
    "reduced": "S + k * sum(b1 * k * (k @ S), K) + k * v",
}


@pytest.mark.parametrize("name", list(NUMERIC))
def test_distributed_form_reproduces_reference(name, tmp_path):
    f = tmp_path / "m.mix"
    f.write_text("mixer m\n dims K, V\n input q[K], k[K], v[V], k1[K], k2[K], k3[K], b1[], b2[], b3[], a[], g[K]\n"
                 f" let kk = k\n state S[K, V]\n update S = {NUMERIC[name]}\n output o = q @ S\n")
    test_plan_numeric.test_plan_reproduces_reference(str(f), {})


@pytest.mark.parametrize("l2norm", [False, True])
def test_nested_library_form_reproduces_reference(l2norm):
    test_plan_numeric.test_plan_reproduces_reference(str(NESTED), {"use_qk_l2norm_in_kernel": l2norm})


@pytest.mark.parametrize("n", [2, 3])
def test_delta_product_with_n_steps_is_rank_n(n):
    """n Householder steps, each written on the state the step before left: rank n."""
    st = _plan(_steps(n, "a * S")).states[0]
    assert st.transition == RANK_R and sorted(_projections(st)) == [f"k{i}" for i in range(1, n + 1)]
    assert st.decay == sp.Symbol("a", real=True)


def test_terms_with_sympy_equal_projections_merge():
    """kk is k (a let, inlined): k (k @ S) and q (kk @ S) are one projection, rank 1."""
    st = _plan("S - k * (k @ S) - q * (kk @ S) + k * v", lets=" let kk = k\n").states[0]
    assert st.transition == P.RANK1 and len(st.rank1) == 1
    k, q = sp.symbols("k q", real=True)
    assert sp.expand(st.rank1[0].left - (-k - q)) == 0


def test_a_projection_over_the_value_dim_stays_general():
    """The same nesting with a projection over V (S @ v): not a correction over the key dims."""
    st = _plan("S - k * (k @ (S - k * (S @ v))) + k * v").states[0]
    assert st.transition == P.GENERAL


def test_per_key_decay_inside_the_nest():
    """exp(g) over K inside the inner projection: k2 @ (exp(g) * S) projects with k2 * exp(g)."""
    st = _plan("exp(g) * S - b1 * k1 * (k1 @ (exp(g) * S)) - b2 * k2 * (k2 @ (exp(g) * S + k1 * (k1 @ S)))"
               ).states[0]
    assert st.transition == RANK_R and st.decay_dims == ("K",)


def test_explain_prints_the_units_lines(capsys):
    """`mixc explain` prints the rank-r unit's lines: the generalized UT transform and how its
    chunked kernels solve it."""
    text = explain(mixc.load(str(NESTED)).plan())
    assert "class: rank-r correction" in text
    assert "rank r = 2" in text and "generalized UT transform" in text
    assert "[C*2, C*2] unit lower triangular" in text
    assert "the chunked kernels solve it as 2 x 2 blocks [C, C]" in text
    assert "K = rows of None" not in text and "full-rank term" not in text
    assert main(["explain", "gated_delta_product"]) == 0
    out = capsys.readouterr().out
    assert "class: rank-r correction" in out and "[C*2, C*2] unit lower triangular" in out


def test_chunk_mode_is_refused_clearly_without_outer_products(tmp_path):
    """The rank-r chunked kernels take B_t as m outer products; one that is no such sum
    (exp(k1 * v)) keeps the recurrent kernels, and mode='chunk' says why."""
    import torch
    st = _plan("S - b1 * k1 * (k1 @ S) - b2 * k2 * (k2 @ S) + 0.1 * exp(k1 * v)").states[0]
    assert st.transition == RANK_R and st.ir_pieces.inputs == () and "chunk" not in st.forms
    op = mixc.load(str(NESTED))
    args = {n: torch.randn(1, 4, 1, 4) for n in ("q", "k1", "k2", "v1", "v2")}
    args.update({n: torch.rand(1, 4, 1) for n in ("g", "beta1", "beta2")})
    op(**args, mode="chunk")                           # DeltaProduct's B_t: two outer products
    text = "S - b1 * k1 * (k1 @ S) - b2 * k2 * (k2 @ S) + 0.1 * exp(k1 * v)"
    f = tmp_path / "dp_full.mix"
    f.write_text(f"mixer dp_full\n  dims K, V\n  input q[K], k1[K], k2[K], v[V], b1[], b2[]\n"
                 f"  state S[K, V]\n  update S = {text}\n  output o = q @ S\n")
    full = mixc.load(str(f))
    args = {n: torch.randn(1, 4, 1, 4) for n in ("q", "k1", "k2", "v")}
    args.update({n: torch.rand(1, 4, 1) for n in ("b1", "b2")})
    with pytest.raises(Exception, match="not a sum of outer products"):
        full(**args, mode="chunk")

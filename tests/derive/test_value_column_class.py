"""What the per-value-column rank-1 class (mixc/classes/value_column.py) claims: one projection
over the key dims whose left or decay varies per value column (exact Longhorn, the delta rule
with a value-diagonal decay), and what it leaves to the others (rank-1 keeps the key-only
updates; a decay per key or per element beside a per-column left stays general linear). Its
plan: the recurrent and step forms, no chunked Triton kernels (the note and `mixc explain` say
why), the torch backend's chunked form."""
from __future__ import annotations

from pathlib import Path

import pytest

import mixc
from mixc import classes
from mixc.classes import Projection, UpdateShape
from mixc.derive.explain import explain
from mixc.runtime.signature import ArgumentError

ROOT = Path(__file__).resolve().parents[2]
VC = classes.VALUE_COLUMN


def _spec(tmp_path, update: str, extra_inputs: str = ""):
    f = tmp_path / "u.mix"
    f.write_text(f"""mixer u
  dims   K, V
  input  q[K], k[K], v[V], beta[], bv[V], g[], gv[V], gk[K]{extra_inputs}
  state  S[K, V]
  update S = {update}
  output o = q @ S
""")
    return mixc.load(str(f))


@pytest.mark.parametrize("name", ["longhorn_exact", "delta_rule_value_decay"])
def test_the_examples_are_the_class(name):
    plan = mixc.load(str(ROOT / "examples" / f"{name}.mix")).plan()
    st = plan.states[0]
    assert plan.transition == VC and st.transition == VC
    assert plan.forms == ("recurrent", "step")
    assert not plan.layout.chunked and plan.layout.torch_chunked
    assert plan.layout.chunk_unsupported == "state S is a per-value-column rank-1"
    assert st.ir_pieces.left is not None and st.ir_pieces.right is not None     # L, R of the torch form
    assert any("no chunked Triton kernels (a [C, C] triangular system per value column)" in n for n in plan.notes)
    text = explain(plan)
    assert "the UT transform's [C, C] system differs per value column ([C, C, V] blocks and V separate solves" in text
    assert "the V systems are batched: [B, H, V, C, C] per chunk" in text


@pytest.mark.parametrize("update,cls", [
    ("S + beta * k * (v - k @ S)", classes.RANK1),                             # the delta rule
    ("exp(g) * S + beta * k * (v - exp(g) * (k @ S))", classes.RANK1),         # gated: a scalar decay
    ("exp(gk) * S + beta * k * (v - k @ S)", classes.RANK1),                   # per key (KDA-like)
    ("S + bv * k * (v - k @ S)", VC),                                          # a step per column (Longhorn)
    ("exp(gv) * S + beta * k * (v - k @ (exp(gv) * S))", VC),                  # a decay per column
    ("exp(gv) * S + beta * k * (v - k @ S)", VC),                              # decay per column, key-only left
    ("exp(g) * S + bv * k * (v - exp(g) * (k @ S))", VC),                      # scalar decay, per-column step
    ("exp(gk) * S + bv * k * (v - k @ S)", classes.GENERAL),                   # per key beside a per-column left
    ("exp(gk) * exp(gv) * S + beta * k * (v - k @ S)", classes.GENERAL),       # an elementwise decay
    ("S - bv * k * (k @ S) - beta * q * (q @ S) + k * v", classes.GENERAL),     # two terms, one per column
])
def test_what_it_claims(tmp_path, update, cls):
    assert _spec(tmp_path, update).plan().states[0].transition == cls


def test_claims_from_the_shape():
    """The claim reads the update's shape: one projection over the key dims, a left over key and
    value dims, a decay that is a scalar or over the value dims."""
    unit = classes.unit(VC)
    term = Projection(("V", "K"), ("K",), ("K",))
    base = dict(state_dims=("K", "V"), key_dims=("K",), value_dims=("V",), decay_is_one=False)
    assert unit.claims(UpdateShape(**base, decay_dims=(), projections=(term,)))
    assert unit.claims(UpdateShape(**base, decay_dims=("V",), projections=(term,)))
    assert not unit.claims(UpdateShape(**base, decay_dims=("K",), projections=(term,)))
    assert not unit.claims(UpdateShape(**base, decay_dims=(), projections=(term, term)))
    assert not unit.claims(UpdateShape(**base, decay_dims=(), projections=(Projection(("V",), ("K",), ("V",)),)))
    assert classes.classify(UpdateShape(**base, decay_dims=(), projections=(term,))) is unit


def test_mode_chunk_is_refused_naming_why():
    op = mixc.load(str(ROOT / "examples" / "longhorn_exact.mix"))
    from mixc.runtime.inputs import random_args
    args, _ = random_args(op.ir, B=1, T=3, H=1, sizes={"K": 2, "V": 3})
    with pytest.raises(ArgumentError, match=r"mode='chunk': mixer 'longhorn_exact' has no chunked kernel "
                                            r"\(state S is a per-value-column rank-1\)"):
        op(**args, mode="chunk")

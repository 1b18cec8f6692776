"""The max-stabilizer of exponential input gates (derive/stabilize.py): which states it groups,
how it rewrites the output, and that the stabilized recurrence it builds for the kernels is
the spec's recurrence (run both in float64 and compare)."""
import pytest
import torch

import mixc
from mixc.derive.stabilize import rewrite, m_ref
from mixc.dsl import ir
from mixc.dsl.unparse import expr_text, spec_text
from mixc.pipeline import from_text
from mixc.runtime.reference import reference

from helpers import random_args, random_state
from stabilizer_specs import EXPSUM, RWKV4

TWO_GATES = """
mixer twogates
  dims   K, V
  input  q[K], k[K], v[V], i[], j[]
  state  S[K, V], z[K]
  update S = S + exp(i) * k * v
  update z = z + exp(j) * k
  output o = q @ S + q @ z
"""


def test_mlstm_output_becomes_the_xlstm_form():
    """The xLSTM form (q . C~) / max(|q . n~|, exp(-M)) over the scale M = max(m, 0): the 1 of
    max(|q . n|, 1) has the scale 0, so exp(-M) <= 1 however far m falls (an empty state's m
    starts below any log weight: derive/stabilize.py M_EMPTY)."""
    st = mixc.load("mlstm").plan().stabilizer
    assert st.states == ("C", "n")
    assert expr_text(st.log_gate) == "i" and expr_text(st.log_decay) == "logsigmoid(f)"
    M = "detach(max(_m, 0))"
    assert expr_text(st.combine_ir) == f"exp(_m - {M}) * _r0 / max(abs(exp(_m - {M}) * _r1), exp(-{M}))"
    text = spec_text(st.kernel_ir)
    assert "state  C[K, V], n[K], _m[]" in text
    assert "update _m = detach(max(logsigmoid(f) + detach(_m), i))" in text
    M = "detach(max(detach(_m), 0))"
    assert f"output h = q @ (exp(detach(_m) - {M}) * C) / max(abs(q @ (exp(detach(_m) - {M}) * n)), exp(-{M}))" \
        in text


@pytest.mark.parametrize("name", ["gla", "retention", "linear_attn", "aft_simple", "mamba2"])
def test_specs_without_a_scalar_exponential_gate_are_left_alone(name):
    plan = mixc.load(name).plan()
    assert plan.stabilizer is None and plan.kernel_ir is plan.ir


def test_two_different_gates_are_not_stabilized_and_say_so():
    plan = from_text(TWO_GATES).plan()
    assert plan.stabilizer is None
    assert any("different exponential input gates" in n for n in plan.notes)


def _leaf(name):
    return ir.Ref(("V",), None, name, "readout")


def test_rewrite_pulls_the_scale_out_of_sums_roots_and_other_functions():
    r = _leaf("r")
    one = ir.Num((), None, 1.0)
    m = m_ref("stabilizer")

    def text(e):
        return expr_text(rewrite(e, lambda x: x == r, m))

    assert text(ir.BinOp(("V",), None, "/", r, ir.BinOp(("V",), None, "+", r, one))) == "r / (r + exp(-_m))"
    assert text(ir.Call(("V",), None, "sqrt", (ir.BinOp(("V",), None, "*", r, r),))) == "sqrt(r * r) * exp(_m)"
    assert text(ir.Call(("V",), None, "tanh", (r,))) == "tanh(r * exp(_m))"
    assert text(ir.BinOp(("V",), None, "-", one, one)) == "1 - 1"

@pytest.mark.parametrize("text", [EXPSUM, None], ids=["expsum", "mlstm"])
def test_the_stabilized_recurrence_is_the_spec(text):
    """The kernels' IR (S~, m) run by the float64 reference gives the spec's output, and its
    states times exp(m) are the spec's states, for gates far beyond exp's fp32 range."""
    op = from_text(text) if text else mixc.load("mlstm")
    plan = op.plan()
    assert plan.stabilizer is not None
    args, sizes = random_args(op.ir, B=2, T=11, H=2, sizes={"K": 4, "V": 3}, dtype=torch.float64, seed=3)
    args["i"] = args["i"] * 3 + torch.where(torch.arange(11) % 4 == 0, 60.0, -40.0)[None, :, None]
    init = random_state(op.ir, 2, 2, sizes)
    o, st = reference(op.ir, **args, initial_state=init, output_final_state=True)
    init_k = dict(init, _m=torch.zeros(2, 2, dtype=torch.float64))
    ko, kst = reference(plan.kernel_ir, **args, initial_state=init_k, output_final_state=True)
    torch.testing.assert_close(ko, o, rtol=1e-10, atol=1e-10)
    for name in plan.stabilizer.states:
        back = kst[name] * torch.exp(kst["_m"]).reshape(2, 2, *([1] * (kst[name].dim() - 2)))
        torch.testing.assert_close(back, st[name], rtol=1e-10, atol=0)
    assert kst["_m"].abs().max() > 30          # the draws did move m far from 0


def test_rwkv4_output_takes_the_scale_max_of_m_and_u_plus_k():
    """An exp(x) the output adds to stabilized readouts joins their scale: M = max(m, x) held
    constant, every term relative to it (RWKV-4's WKV: max(pp, u + k)); written through a let
    too. prev(a) is at m_{t-1}: in the chunked forms' combine _mp, in the recurrent kernels'
    output prev(_m)."""
    let = RWKV4.replace("  state  a[V], b[]", "  let    e = exp(u + k)\n  state  a[V], b[]").replace(
        "(prev(a) + exp(u + k) * v) / (prev(b) + exp(u + k))", "(prev(a) + e * v) / (prev(b) + e)")
    M = "detach(max(_mp, u + k))"
    for text in (RWKV4, let):
        st = from_text(text).plan().stabilizer
        assert expr_text(st.combine_ir) == (f"(exp(_mp - {M}) * _r0 + exp(u + k - {M}) * v) / "
                                            f"(exp(_mp - {M}) * _r1 + exp(u + k - {M}))")
        assert "max(detach(prev(_m)), u + k)" in spec_text(st.kernel_ir)
    assert mixc.load("mlstm").plan().stabilizer.output_exps == ()     # its scale: m and its 1's 0


def test_the_stabilized_rwkv4_recurrence_is_the_spec():
    """RWKV-4's kernel IR (S~, m, the output over max(m_{t-1}, u + k)) run by the float64
    reference gives the spec's output and states, with u + k up to ~600 (float64's exp
    overflows at 709, fp32's at 88)."""
    op = from_text(RWKV4)
    plan = op.plan()
    args, sizes = random_args(op.ir, B=1, T=12, H=2, sizes={"V": 4}, dtype=torch.float64, seed=8)
    args["k"] = args["k"] * 3 + torch.where(torch.arange(12) % 3 == 0, 300.0, -100.0)[None, :, None]
    args["u"] = args["u"] + torch.tensor([0.0, 300.0], dtype=torch.float64)
    init = random_state(op.ir, 1, 2, sizes)
    o, st = reference(op.ir, **args, initial_state=init, output_final_state=True)
    init_k = dict(init, _m=torch.zeros(1, 2, dtype=torch.float64))
    ko, kst = reference(plan.kernel_ir, **args, initial_state=init_k, output_final_state=True)
    torch.testing.assert_close(ko, o, rtol=1e-10, atol=1e-10)
    for name in ("a", "b"):
        back = kst[name] * torch.exp(kst["_m"]).reshape(1, 2, *([1] * (kst[name].dim() - 2)))
        torch.testing.assert_close(back, st[name], rtol=1e-10, atol=0)

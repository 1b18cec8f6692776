"""The convolution form of time-invariant recurrences (mode="conv"): S4D as an FFT
convolution with the kernel K_j = sum_n C dA^j B_bar, retention as its parallel form
(Q K^T * D) V. Both must equal the recurrent form, forward, final state and every gradient
(inputs, params, the initial state)."""
import pytest
import torch

import mixc
from mixc.derive.convform import AUTO_MIN_T, conv_form
from mixc.pipeline import from_text
from mixc.runtime.op import use_conv_form
from mixc.runtime.signature import ArgumentError, bind

from helpers import case_id, random_args, random_state

# a time-invariant spec whose output reads prev(h) (the kernel shifted by one lag) and h, with a
# decay per value channel read directly: the FFT form's other cases
PREV_SPEC = """
mixer ti_prev
  dims   N
  input  x[]
  param  A[N], B[N], C[N]
  let    a = exp(-softplus(A))
  state  h[N]
  update h = a * h + B * x
  output y = C @ prev(h) + 0.5 * (C @ h)
"""
VALUE_SPEC = """
mixer ti_value
  dims   D
  input  x[D]
  param  g[D]
  state  h[D]
  update h = exp(-softplus(g)) * h + x
  output y = h
"""


def _op(name):
    return {"ti_prev": lambda: from_text(PREV_SPEC, "ti_prev.mix"),
            "ti_value": lambda: from_text(VALUE_SPEC, "ti_value.mix")}.get(name, lambda: mixc.load(name))()


CASES = [("s4d", 2, 100, 3, {"N": 8}), ("s4d", 1, 9, 2, {"N": 4}), ("retention", 2, 37, 3, {"K": 8, "V": 4}),
         ("ti_prev", 2, 80, 2, {"N": 4}), ("ti_value", 2, 70, 2, {"D": 3}), ("aft_simple", 2, 30, 2, {"D": 3})]


@pytest.mark.parametrize("name,B,T,H,dims", CASES, ids=[f"{n}-" + case_id(B=B, T=T, H=H, **d) for n, B, T, H, d in CASES])
def test_conv_form_equals_the_recurrence(name, B, T, H, dims):
    op = _op(name)
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=dims, dtype=torch.float64, requires_grad=True, seed=7)
    st = random_state(op.ir, B, H, sizes, requires_grad=True)
    leaves = list(args.values()) + list(st.values())
    o, fin = op(**args, initial_state=st, output_final_state=True, mode="conv")
    r, rfin = op(**args, initial_state=st, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)
    for k in rfin:                                       # states come back float32
        torch.testing.assert_close(fin[k].double(), rfin[k], rtol=1e-6, atol=1e-6)
    w = torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = (o * w).sum() + sum((v.double() * (i + 1)).sum() for i, v in enumerate(fin.values()))
    rloss = (r * w).sum() + sum((v * (i + 1)).sum() for i, v in enumerate(rfin.values()))
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(rloss, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["s4d", "retention"])
def test_conv_form_equals_the_recurrent_kernels_in_float32(name):
    """mode="conv" against the recurrent Triton kernels (the interpreter), forward and gradients."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=24, H=2, sizes={"N": 4, "K": 4, "V": 4}, dtype=torch.float32,
                              requires_grad=True, seed=3)
    st = random_state(op.ir, 2, 2, sizes, dtype=torch.float32, requires_grad=True)
    leaves = list(args.values()) + list(st.values())
    outs = {}
    for mode in ("conv", "recurrent"):
        o, fin = op(**args, initial_state=st, output_final_state=True, mode=mode)
        loss = o.square().sum() + sum(v.sum() for v in fin.values())
        outs[mode] = (o, fin, torch.autograd.grad(loss, leaves))
    (o, fin, g), (ro, rfin, rg) = outs["conv"], outs["recurrent"]
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    for k in fin:
        torch.testing.assert_close(fin[k], rfin[k], rtol=1e-4, atol=1e-4)
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


def test_conv_form_with_packed_sequences():
    op = mixc.load("s4d")
    args, sizes = random_args(op.ir, B=1, T=20, H=2, sizes={"N": 4}, dtype=torch.float64, seed=2)
    st = random_state(op.ir, 3, 2, sizes)
    cu = torch.tensor([0, 6, 6, 20])
    o, fin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="conv")
    r, rfin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, r)
    torch.testing.assert_close(fin["h"].double(), rfin["h"], rtol=1e-6, atol=1e-6)


def test_which_specs_have_which_form():
    s4d, ret = conv_form(mixc.load("s4d").plan()), conv_form(mixc.load("retention").plan())
    assert s4d.fft and s4d.why_not_fft is None
    assert not ret.fft and ret.why_not_fft == "the key of state S reads input k"
    assert conv_form(mixc.load("gla").plan()) is None
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=4, H=1)
    with pytest.raises(ArgumentError, match="mode='conv': mixer 'gla' has no convolution form: the transition of S "
                                            "depends on the token"):
        op(**args, mode="conv")


def test_auto_takes_the_fft_form_from_its_threshold():
    """On the torch backend (CPU without the interpreter) "auto" runs the FFT form of S4D from
    AUTO_MIN_T tokens on; retention's parallel form never (the chunked one is cheaper)."""
    for name, T, want in (("s4d", AUTO_MIN_T, True), ("s4d", AUTO_MIN_T - 1, False), ("retention", 4096, False)):
        op = mixc.load(name)
        args, _ = random_args(op.ir, B=1, T=T, H=1, sizes={"N": 2, "K": 2, "V": 2})
        assert use_conv_form(op.plan(), bind(op.ir, args)) == want, (name, T)


def test_explain_prints_the_kernel():
    from mixc.derive.explain import explain
    text = explain(mixc.load("s4d").plan())
    assert "_r0: kernel K_j = sum over N of (C) * (dA)^(j) * (B*(dA - 1)/A)" in text
    assert "FFT of size n = the next power of two >= 2T - 1" in text
    assert "O = (Q K^T * D) V" in explain(mixc.load("retention").plan())

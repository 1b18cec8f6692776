"""float64 in means float64 states out in modes torch and reference (issue 19): the torch
backend returned float32 states for float64 inputs, so a float64 caller's carried state (and
the gradients through it) fell to float32 precision, ~1e-8."""
import pytest
import torch

import mixc

from helpers import case_id, random_args, random_state

# the torch backend's three paths: chunked (gla), the token loop (mamba: no chunked torch
# form), the convolution form (s4d, mode="auto" from T >= 64 takes it; here mode="conv")
CASES = [("gla", "torch"), ("mamba", "torch"), ("s4d", "conv")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}-{case_id(B=2, T=9, H=2)}" for n, m in CASES])
def test_states_keep_the_inputs_precision(name, mode, dtype):
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=9, H=2, dtype=dtype, seed=7)
    init = random_state(op.ir, 2, 2, sizes, dtype=dtype)
    want_o, want = op.reference(**args, initial_state=init, output_final_state=True)
    o, st = op(**args, initial_state=init, output_final_state=True, mode=mode)
    states = torch.float64 if dtype == torch.float64 else torch.float32
    assert o.dtype == dtype and {v.dtype for v in st.values()} == {states}
    if dtype == torch.float64:          # float64 all the way: agreement far past float32's 1e-7
        for k in want:
            torch.testing.assert_close(st[k], want[k], rtol=1e-10, atol=1e-12, msg=f"final {k}")
    # one decode step from that state keeps it too
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in names else v) for k, v in args.items()}
    o1, st1 = op.step(**one, state=st, mode="torch")
    r1, rs1 = op.reference_step(**one, state=want)
    assert {v.dtype for v in st1.values()} == {states}
    if dtype == torch.float64:
        for k in rs1:
            torch.testing.assert_close(st1[k], rs1[k], rtol=1e-10, atol=1e-12, msg=f"step {k}")


MIXED = [("kda", "g", "torch"), ("gla", "g", "torch"), ("mamba", "dt", "torch"), ("mamba2", "A", "torch"),
         ("s4d", "C", "conv")]


@pytest.mark.parametrize("name,low,mode", MIXED, ids=[f"{n}-{x}-{m}" for n, x, m in MIXED])
def test_one_float32_argument_among_float64_computes_in_float64(name, low, mode):
    """B2-T9-H2: float64 inputs with one float32 input or param (Kimi-Linear's layer passes its
    gate so) compute in float64, torch's type promotion: output (float64, the first input's
    dtype), final states (float64) and a step within 1e-12 of the float64 reference on the
    same values (were float32: 2.7e-7 off, issue 30)."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=9, H=2, dtype=torch.float64, seed=8)
    args[low] = args[low].float()
    exact = {k: v.double() for k, v in args.items()}
    want_o, want = op.reference(**exact, output_final_state=True)
    o, st = op(**args, output_final_state=True, mode=mode)
    assert o.dtype == torch.float64 and {v.dtype for v in st.values()} == {torch.float64}
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    for k in want:
        torch.testing.assert_close(st[k], want[k], rtol=1e-12, atol=1e-12, msg=f"final {k}")
    names = {d.name for d in op.ir.inputs}
    init = random_state(op.ir, 2, 2, sizes)
    o1, _ = op.step(**{k: (v[:, 0] if k in names else v) for k, v in args.items()}, state=init, mode="torch")
    want1, _ = op.reference(**{k: (v[:, :1] if k in names else v) for k, v in exact.items()}, initial_state=init)
    assert o1.dtype == torch.float64
    torch.testing.assert_close(o1, want1[:, 0], rtol=1e-12, atol=1e-12)

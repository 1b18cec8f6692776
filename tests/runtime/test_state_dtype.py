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

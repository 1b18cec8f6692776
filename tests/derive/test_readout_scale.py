"""A read of a state scaled by a value over a dim the state does not hold (the typed fuzzer's
`(k @ z) * sum(P, K)` with z[K]: a [V] scale of a read without value dims). The chunked forms
scale each read over its state's value dims, so they refuse it by name and the recurrent
forms serve it (mode torch passed the [V] scale as a scalar and failed in expand)."""
from __future__ import annotations

import pytest
import torch

from mixc.pipeline import from_text
from mixc.runtime.inputs import random_args

SPEC = """mixer m
  dims   K, V
  input  q[K], k[K], v[V]
  param  P[K, V]
  state  S[K, V], z[K]
  update S = S + k * v
  update z = z * head + k
  output o = q @ S + {read} * sum(P, K)
"""


@pytest.mark.parametrize("read", ["(k @ z)", "(prev(k) @ prev(z))"], ids=["read", "prev-read"])
def test_scale_outside_value_dims_is_refused_by_chunked_forms(read):
    op = from_text(SPEC.format(read=read), "m.mix")
    layout = op.plan().layout
    for why in (layout.chunk_unsupported, layout.torch_chunk_unsupported):
        assert why is not None and "the output scales its read of state z by a value over V" in why
        assert "_r" not in why                                   # the user's names, not the plan's


@pytest.mark.parametrize("seed", [0, 7], ids=lambda s: f"B2-T9-H3-K3-V2-seed{s}")
def test_scale_outside_value_dims_torch_equals_reference(seed):
    op = from_text(SPEC.format(read="(k @ z)"), "m.mix")
    args, _ = random_args(op.ir, B=2, T=9, H=3, sizes={"K": 3, "V": 2}, dtype=torch.float64, seed=seed)
    ref, ref_state = op(**args, mode="reference", output_final_state=True)
    got, got_state = op(**args, mode="torch", output_final_state=True)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    for name in ref_state:
        torch.testing.assert_close(got_state[name], ref_state[name], rtol=1e-9, atol=1e-9)

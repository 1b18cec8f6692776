"""A spec's fixed dim (`dims E = 3`) at call time: every mode binds it without a tensor that
carries it, equals the float64 loop, and a tensor that disagrees is named."""
import pytest
import torch

from helpers import case_id, random_args, random_state
from mixc.pipeline import from_text
from mixc.runtime.signature import ArgumentError
from range_specs import STACK

CASES = [dict(B=2, T=21, H=2, K=4, V=4)]


@pytest.fixture(scope="module")
def stack():
    return from_text(STACK, "stack.mix")


@pytest.mark.parametrize("mode", ["torch", "recurrent", "chunk"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(**c) for c in CASES])
def test_every_mode_equals_the_reference(stack, mode, case):
    args, sizes = random_args(stack.ir, B=case["B"], T=case["T"], H=case["H"], sizes={"K": case["K"], "V": case["V"]},
                              dtype=torch.float32, seed=3)
    assert sizes["E"] == 3 and args["w"].shape == (case["H"], 3)
    init = random_state(stack.ir, case["B"], case["H"], sizes, dtype=torch.float32)
    want, want_st = stack(**{k: v.double() for k, v in args.items()}, initial_state={"Z": init["Z"].double()},
                          mode="reference", output_final_state=True)
    got, got_st = stack(**args, initial_state=init, mode=mode, output_final_state=True)
    assert got_st["Z"].shape == (case["B"], case["H"], 3, case["K"], case["V"])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_st["Z"].double(), want_st["Z"], rtol=1e-4, atol=1e-4)


def test_a_step_carries_the_stack(stack):
    args, sizes = random_args(stack.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4})
    token = {k: (v[:, 0] if k in ("q", "k", "v", "g") else v) for k, v in args.items()}
    o, st = stack.step(**token, state={"Z": torch.zeros(2, 2, 3, 4, 4, dtype=torch.float64)}, mode="reference")
    assert st["Z"].shape == (2, 2, 3, 4, 4)


def test_a_tensor_that_disagrees_with_the_spec_is_named(stack):
    args, _ = random_args(stack.ir, B=2, T=5, H=2, sizes={"K": 4, "V": 4})
    with pytest.raises(ArgumentError, match=r"^w: dim E \(axis 1\) is 2, but the spec \(dims E = 3\) gives E = 3"):
        stack(**dict(args, w=args["w"][:, :2]), mode="torch")
    with pytest.raises(ArgumentError, match=r"initial_state\['Z'\]: expected shape \[B=2, H=2, E=3, K=4, V=4\]"):
        stack(**args, initial_state={"Z": torch.zeros(2, 2, 2, 4, 4)}, mode="torch")

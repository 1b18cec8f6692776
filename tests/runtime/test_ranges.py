"""Declared ranges at call time (runtime/inputs.check_ranges): the reference, torch and conv
modes refuse a value outside its input's or param's range with an ArgumentError naming the
argument, the range, the first bad index and its value; a call inside the range runs. And the
chunked kernels that a range (or the prover's corner test) gives HGRN-1 equal the float64 loop."""
import pytest
import torch

from helpers import case_id, random_args
from mixc.pipeline import from_text
from mixc.runtime.inputs import RANGE_CHECKED_MODES
from mixc.runtime.signature import ArgumentError
from range_specs import DELTA_NEG, HGRN1, HGRN1_RANGED


@pytest.fixture(scope="module")
def delta_neg():
    return from_text(DELTA_NEG, "delta_neg.mix")


@pytest.fixture(scope="module")
def hgrn1_ranged():
    return from_text(HGRN1_RANGED, "hgrn1_ranged.mix")


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_a_call_inside_the_range_runs(delta_neg, mode):
    args, _ = random_args(delta_neg.ir, B=2, T=6, H=2, sizes={"K": 4, "V": 4})
    args["beta"] = torch.full_like(args["beta"], 1.9)          # past fla's (0, 1), inside (0, 2)
    o, _ = delta_neg(**args, mode=mode)
    want, _ = delta_neg(**args, mode="reference")
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("bad,shown", [(2.0, "2"), (-0.5, "-0.5"), (float("nan"), "nan")],
                         ids=["at-an-open-end", "below", "nan"])
def test_an_input_outside_its_range_is_named_with_its_first_bad_index(delta_neg, mode, bad, shown):
    args, _ = random_args(delta_neg.ir, B=2, T=6, H=2, sizes={"K": 4, "V": 4})
    args["beta"][1, 4, 0] = bad
    args["beta"][1, 5, 1] = bad
    with pytest.raises(ArgumentError) as info:
        delta_neg(**args, mode=mode)
    assert str(info.value) == (f"beta: expected values in (0, 2), as the spec declares (`input beta[] in (0, 2)`), "
                               f"got beta[1, 4, 0] = {shown} (and 1 more outside it)")


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_a_param_outside_its_range_is_refused(hgrn1_ranged, mode):
    args, _ = random_args(hgrn1_ranged.ir, B=1, T=4, H=3, sizes={"D": 5})
    assert ((args["lb"] >= 0) & (args["lb"] <= 1)).all()       # random_args draws inside the range
    args["lb"][2, 3] = 1.5
    with pytest.raises(ArgumentError, match=r"^lb: expected values in \[0, 1\], as the spec declares "
                                            r"\(`param lb\[D\] in \[0, 1\]`\), got lb\[2, 3\] = 1.5$"):
        hgrn1_ranged(**args, mode=mode)


def test_a_step_checks_its_token(delta_neg):
    args, sizes = random_args(delta_neg.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4})
    token = {k: v[:, 0] for k, v in args.items()}
    state = {"S": torch.zeros(2, 2, 4, 4, dtype=torch.float64)}
    delta_neg.step(**token, state=state, mode="reference")
    token["beta"][0, 1] = 0.0
    with pytest.raises(ArgumentError, match=r"got beta\[0, 1\] = 0$"):
        delta_neg.step(**token, state=state, mode="torch")


@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
def test_a_replayed_torch_step_still_checks_every_token(delta_neg, inplace):
    """op.step(mode="torch") replays a call that looks like an earlier one without binding
    (runtime/torch_step.py): the ranges are checked on the replay too, on every token."""
    args, _ = random_args(delta_neg.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4})
    token = {k: v[:, 0].float() for k, v in args.items()}
    state = {"S": torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(2))}
    for _ in range(3):                                         # the first binds, the next replay
        delta_neg.step(**token, state=state, mode="torch", inplace=inplace)
    token["beta"][1, 0] = 2.5
    with pytest.raises(ArgumentError, match=r"got beta\[1, 0\] = 2.5$"):
        delta_neg.step(**token, state=state, mode="torch", inplace=inplace)


def test_the_checked_modes_are_the_torch_ones():
    assert set(RANGE_CHECKED_MODES) == {"reference", "torch", "conv"}


CASES = [dict(B=2, T=37, H=2, D=8)]


@pytest.mark.parametrize("text", [HGRN1, HGRN1_RANGED], ids=["lower-bound-a-sigmoid", "lower-bound-a-ranged-param"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(**c) for c in CASES])
def test_hgrn1_chunked_kernels_equal_the_float64_loop(text, case):
    """The chunked kernels the prover now allows HGRN-1 (f = lb + (1 - lb) sigmoid(fz)): output,
    final state and every gradient within 1e-4 of the float64 reference, fp32 inputs, on fresh
    random values."""
    op = from_text(text)
    assert "chunk" in op.plan().forms
    args, _ = random_args(op.ir, B=case["B"], T=case["T"], H=case["H"], sizes={"D": case["D"]},
                          dtype=torch.float32, seed=5)
    w = torch.randn(case["B"], case["T"], case["H"], case["D"], generator=torch.Generator().manual_seed(6),
                    dtype=torch.float64)
    a64 = {n: x.double().requires_grad_() for n, x in args.items()}
    want, want_st = op(**a64, mode="reference", output_final_state=True)
    (want * w).sum().backward()
    a32 = {n: x.clone().requires_grad_() for n, x in args.items()}
    got, got_st = op(**a32, mode="chunk", chunk=16, output_final_state=True)
    (got.double() * w).sum().backward()
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_st["h"].double(), want_st["h"].detach(), rtol=1e-4, atol=1e-5)
    for n in a64:
        torch.testing.assert_close(a32[n].grad.double(), a64[n].grad, rtol=1e-4, atol=1e-5, msg=n)

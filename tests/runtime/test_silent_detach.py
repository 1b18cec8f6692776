"""Gradients that were silently lost (issue 30): op.step(..., inplace=True) writes the cache
outside autograd, and a number option given as a tensor is read as a float. Both refuse a
tensor that requires grad (with grad enabled) by name; under torch.no_grad, or detached,
they run as before."""
import pytest
import torch

import mixc
from mixc.standalone.errors import ArgumentError

from helpers import random_args, random_state


def _step_args(requires_grad):
    op = mixc.load("gla")
    args, sizes = random_args(op.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32,
                              requires_grad=requires_grad, seed=34)
    st = {k: v.float() for k, v in random_state(op.ir, 2, 2, sizes).items()}     # the cache is float32
    return op, {k: v[:, 0] for k, v in args.items()}, st


@pytest.mark.parametrize("mode", ["recurrent", "torch"])
def test_an_in_place_step_refuses_inputs_that_require_grad(mode):
    op, x, st = _step_args(True)
    with pytest.raises(ArgumentError, match=r"^q: requires grad.*inplace=False"):
        op.step(**x, state=st, inplace=True, mode=mode)
    with pytest.raises(ArgumentError, match=r"^state\[.S.\]: requires grad"):
        op.step(**{k: v.detach() for k, v in x.items()}, state={"S": st["S"].clone().requires_grad_()},
                inplace=True, mode=mode)
    with torch.no_grad():           # decoding: the same call runs, and equals the functional step
        cache = {k: v.clone() for k, v in st.items()}
        o, same = op.step(**x, state=cache, inplace=True, mode=mode)
        want_o, want = op.step(**x, state=st, mode=mode)
    assert same is cache
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(cache["S"], want["S"])


@pytest.mark.parametrize("mode", ["recurrent", "torch", "reference"])
def test_a_number_option_as_a_tensor_that_requires_grad_is_refused(mode):
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=4, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32, seed=35)
    scale = torch.tensor(0.37, requires_grad=True)
    with pytest.raises(ArgumentError, match=r"^scale: a tensor that requires grad"):
        op(**args, scale=scale, mode=mode)
    with pytest.raises(ArgumentError, match=r"^scale: a tensor that requires grad"):
        op.step(**{k: v[:, 0] for k, v in args.items()}, state=None, scale=scale, mode=mode)
    got, _ = op(**args, scale=scale.detach(), mode=mode)
    want, _ = op(**args, scale=0.37, mode=mode)
    torch.testing.assert_close(got, want)

"""A second derivative (create_graph=True, a gradient penalty) through the kernels (issue 30):
their backward records no graph, so the gradient came back without one and a penalty's term
silently dropped (|dL/dv| 9.68 against 264 in torch mode). The kernel modes refuse it by name;
modes torch and reference support it and agree with each other."""
import pytest
import torch

import mixc
from mixc.standalone.errors import ArgumentError

from helpers import random_args


def _penalty_grad(op, args, mode):
    o, _ = op(**args, mode=mode)
    (dv,) = torch.autograd.grad((o * o).sum(), [args["v"]], create_graph=True)
    return torch.autograd.grad((dv * dv).sum(), [args["q"], args["k"], args["v"], args["g"]])


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_create_graph_through_the_kernels_is_refused_by_name(mode):
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=8, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32, requires_grad=True,
                          seed=32)
    with pytest.raises(ArgumentError, match="create_graph.*mode='torch'"):
        _penalty_grad(op, args, mode)
    # a plain backward still runs
    o, _ = op(**args, mode=mode)
    assert all(g is not None for g in torch.autograd.grad(o.sum(), list(args.values())))


def test_create_graph_in_torch_mode_matches_the_reference():
    """B1-T8-H2-K4-V4 in float64: the penalty's gradient from mode torch equals the reference's."""
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=8, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float64, requires_grad=True,
                          seed=33)
    for got, want in zip(_penalty_grad(op, args, "torch"), _penalty_grad(op, args, "reference")):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)

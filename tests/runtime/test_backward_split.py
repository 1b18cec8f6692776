"""The chunked backward's tiles kernel with its tile loop split (mixc/codegen/tile_split.py) where a
value is not finite in one tile block. The tiles kernel now zeroes a key by its own entries only and a
block's value rows (and their gradients) by the key's and the block's values (sanitize's
_badv_<S>): the statements after the loop read one key matrix for every block. What the
forward makes of such a token is NaN from it on, so what must hold is what a right-padded batch
needs: with dO zero from the bad token on, the earlier tokens' gradients are those of a run
where the value is finite, and finite. Every chunked spec's float64 checks of the split kernels
over three tile blocks: tests/ops/test_kernel_shapes.py."""
import pytest
import torch

import mixc
from mixc.runtime import launch
from mixc.runtime.inputs import random_args

BAD = 21                        # the token, in chunk 1 (tokens 16..31)
COLUMN = 20                     # its value's bad entry: tile block 1 of V (16..31)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf * 0
@pytest.mark.parametrize("name", ["simple_gla", "delta_rule"])
def test_a_bad_value_leaves_the_earlier_gradients_of_a_finite_run(name, monkeypatch):
    """B1-T32-H1-K8-V40, C = 16, tiles of 16 (three blocks), two launches: an inf in token 21's
    value (block 1); dO zero from token 21 on. Every gradient's rows 0..20 equal (to fp32
    rounding) those of the same call with that entry finite, and are finite; the bad value's
    gradient is zero in its block, also where dO is not (the gradient of the zeroed row, as
    the fused walk gives: there the block zeroes the key too). delta_rule: the rank-1 class, whose keys enter the
    transition (the tiles kernel keeps them where the forward zeroed them in that block)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=32, H=1, sizes={"K": 8, "V": 40}, dtype=torch.float32, seed=17)
    names = [d.name for d in op.ir.inputs]
    dout = torch.randn(1, 32, 1, 40, generator=torch.Generator().manual_seed(5))
    dout[:, BAD:] = 0.0
    full = torch.randn(1, 32, 1, 40, generator=torch.Generator().manual_seed(6))
    grads = {}
    for value, do in ((float("inf"), dout), (0.75, dout), (float("inf"), full)):
        inputs = {k: (v.detach().clone().requires_grad_(True) if k in names else v) for k, v in args.items()}
        with torch.no_grad():
            inputs["v"][0, BAD, 0, COLUMN] = value
        o, _ = op(**inputs, mode="chunk", chunk=16)
        grads[value, do is full] = dict(zip(names, torch.autograd.grad(o, [inputs[k] for k in names], do)))
    bad, good = grads[float("inf"), False], grads[0.75, False]
    for k in names:
        assert torch.isfinite(bad[k][0, :BAD]).all(), k
        torch.testing.assert_close(bad[k][0, :BAD], good[k][0, :BAD], rtol=1e-5, atol=1e-5, msg=k)
    for g in (bad, grads[float("inf"), True]):
        assert (g["v"][0, BAD, 0, 16:32] == 0).all()
        assert torch.isfinite(g["v"][0, :BAD]).all() and torch.isfinite(g["k"][0, :BAD]).all()

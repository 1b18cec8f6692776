"""A contracted dim of size 0 (issue 19: gla with K = 0, mamba2 with N = 0): the state is empty,
and the output is the reference's state-free part (zeros for gla, D * x for mamba2), in the
recurrent and chunked kernels and in step(), gradients included. Before the fix the recurrent
kernel launched no program along its split axis and left the output unwritten (NaN under
MIXC_POISON=1)."""
import pytest
import torch

import mixc

from helpers import case_id, random_args, random_state

CASES = [("gla", {"K": 0, "V": 5}), ("mamba2", {"N": 0, "P": 5})]
# gla's default scale K ** -0.5 is not a finite number at K = 0 (refused at the call): pass one
OPTIONS = {"gla": {"scale": 0.5}, "mamba2": {}}


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, want {list(want.shape)}"
    assert not got.isnan().any(), f"{what}: NaN (an element the kernel did not write)"
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{case_id(B=2, T=7, H=3, **s)}" for n, s in CASES])
def test_empty_contracted_dim_sequence(name, sizes, mode):
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=2, T=7, H=3, sizes=sizes, dtype=torch.float32, requires_grad=True, seed=19)
    args.update(OPTIONS[name])
    st = random_state(op.ir, 2, 3, sizes, requires_grad=True)
    want, want_st = op.reference(**args, initial_state=st, output_final_state=True)
    got, got_st = op(**args, initial_state=st, output_final_state=True, mode=mode)
    _close(got, want, f"{mode} o")
    for k in want_st:
        _close(got_st[k], want_st[k], f"{mode} final {k}")
    w = torch.randn(want.shape, dtype=torch.float64)
    leaves = [x for x in args.values() if isinstance(x, torch.Tensor) and x.numel()]
    g_want = torch.autograd.grad((want * w).sum(), leaves, allow_unused=True)
    g_got = torch.autograd.grad((got.double() * w).sum(), leaves, allow_unused=True)
    for x, a, b in zip(leaves, g_got, g_want):
        if b is not None:
            _close(a, b, f"{mode} gradient")


@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{case_id(B=2, H=3, **s)}" for n, s in CASES])
def test_empty_contracted_dim_step(name, sizes):
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=2, T=1, H=3, sizes=sizes, dtype=torch.float32, seed=20)
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in names else v) for k, v in args.items()} | OPTIONS[name]
    st = random_state(op.ir, 2, 3, sizes)
    want, want_st = op.reference_step(**one, state=st)
    got, got_st = op.step(**one, state=st)
    _close(got, want, "step o")
    for k in want_st:
        _close(got_st[k], want_st[k], f"step state {k}")

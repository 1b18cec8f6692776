"""The kernels against the independent formulas of the reference tests (quadratic masked
forms, decay matrices, SSD, selective scan, fla's loops, stabilized mLSTM), not only against
the float64 reference: forward, final states and every gradient. The chunked kernels run in
two launches per direction (the CUDA default); the walk is diffed against the float64
reference in tests/ops/test_kernels.py."""
import pytest
import torch

import mixc
from mixc.derive.layout import chunk_supported

from helpers import random_state
from kernel_checks import check_against_reference
from tests.ops import test_reference_linear as lin
from tests.ops import test_reference_ssm_delta as ssm

LINEAR = [(c.id, m) for c in lin.CASES for m in ("recurrent", "chunk")]
# every system in the recurrent kernels, and in the chunked ones where the spec has them; the
# delta rules also with beta in (1.9, 1.99) (the "-beta2" systems: near the edge of (0, 2))
SSM = [(n, "recurrent") for n in ssm.SYSTEMS] + [
    (n, "chunk") for n in ssm.SYSTEMS if n.split("-")[0] not in ("mamba", "s4d")] + [("s4d", "chunk")]


@pytest.fixture(autouse=True)
def _two_launches(monkeypatch):
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)


def _to32(d):
    return {k: v.detach().float().requires_grad_(True) for k, v in d.items()}


@pytest.mark.parametrize("case,mode", LINEAR, ids=[f"{c}-{m}" for c, m in LINEAR])
def test_linear_kernels_vs_formula(case, mode):
    case = next(c for c in lin.CASES if c.id == case)
    op = mixc.load(case.spec)
    assert chunk_supported(op.plan(**case.flags)) is None    # every linear case has a chunked kernel
    args, sizes = lin._args(case, op, B=2, T=19, H=2, sizes=lin.SIZES, seed=31)
    st = lin._initial_state(case, op, n=2, H=2, sizes=lin.SIZES, seed=32)
    opts = lin._opts(case, op, sizes)
    check_against_reference(op, case.flags, _to32(args), _to32(st), torch.float32, mode=mode, chunk=16,
                            formula=lambda a, s: case.closed(a, opts, s))


@pytest.mark.parametrize("name,mode", SSM, ids=[f"{n}-{m}" for n, m in SSM])
def test_ssm_and_delta_kernels_vs_formula(name, mode):
    sysd = ssm.SYSTEMS[name]
    op = ssm._op(name)
    sizes = ssm._sizes_for(name)[0]
    args, sizes = ssm.make_args(name, B=2, T=11, H=2, sizes=sizes, seed=33)
    st = random_state(op.ir, 2, 2, sizes, seed=34)
    call, full = ssm.options(name, sizes)
    check_against_reference(op, call, _to32(args), _to32(st), torch.float32, mode=mode, chunk=16,
                            formula=lambda a, s: sysd.formula(a, full, s))

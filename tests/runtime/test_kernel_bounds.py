"""Every element the kernels load or store lies inside the tensors of their launch
(tests/interpreter_bounds.py: Triton's interpreter, every pointer under a true mask checked
against the launch's tensor arguments). The checker itself first: an access one past a buffer
is caught and named, also where the caller swallows the error (the autotuner did). Then a few
specs at tiny shapes in their default runs, and retention (the H200 fault, 2026-12-04) at the
CUDA launch's structure: two launches each way, a checkpoint every 4 chunks, the key dim in
blocks, the output kernel in V blocks of 32 below the walk's 64, bf16 with DOT = 1 (the GPU's matmul
inputs). MIXC_BOUNDS_CHECK=1 runs the whole suite so (tests/conftest.py)."""
import pytest
import torch
import triton
import triton.language as tl

import mixc
from mixc import classes
from mixc.runtime import launch
from mixc.standalone import launcher
from mixc.standalone.launcher import Launcher
from mixc.runtime.inputs import random_args

from interpreter_bounds import OutOfBounds, bounds_checked


@triton.jit
def _twice(x, y, n, m, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < m)


def test_checker_names_the_kernel_argument_and_offset():
    x, y = torch.arange(10.0), torch.zeros(10)
    with bounds_checked() as seen:
        _twice[(2,)](x, y, 10, 10, B=8)                   # masked lanes past the end: fine
        assert torch.equal(y, 2 * x) and not seen["errors"]
        try:
            _twice[(2,)](x, y, 10, 11, B=8)               # one store past y's end
        except Exception:                                 # noqa: BLE001 - as a caller that swallows it
            pass
    assert len(seen["errors"]) == 1 and isinstance(seen["errors"][0], OutOfBounds)
    msg = str(seen["errors"][0])
    assert "_twice" in msg and "store" in msg and "element 10 of `y`" in msg and "program (1, 0, 0)" in msg
    assert ("_twice", {"B": 8}) in seen["launches"]
    with pytest.raises(Exception, match=r"load of 3 element\(s\).*element 10 of `x`.*10\.\.12"):
        with bounds_checked():
            _twice[(2,)](x, y, 13, 0, B=8)                # loads 3 past x's end, raised at once


def _fwd_bwd(op, args, **kw):
    o, st = op(**args, output_final_state=True, **kw)
    loss = o.float().square().sum() + sum(v.square().sum() for v in st.values())
    loss.backward()
    return o


@pytest.mark.parametrize("name,mode", [("retention", "chunk"), ("simple_gla", "chunk"), ("gla", "chunk"),
                                       ("retention", "recurrent"), ("delta_rule", "chunk")])
def test_default_runs_stay_in_bounds(name, mode):
    """B2-T40-H2, K = V = 8, C = 16: chunks with a partial last one, the untuned launch."""
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=2, T=40, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, requires_grad=True,
                          seed=3)
    with bounds_checked() as seen:
        _fwd_bwd(op, args, mode=mode, **({"chunk": 16} if mode == "chunk" else {}))
    assert seen["launches"] and not seen["errors"], seen["errors"][:1]


@pytest.mark.parametrize("phases", [2, 1])
def test_retention_at_the_cuda_launch_structure_stays_in_bounds(phases, monkeypatch):
    """retention as launched on the H200 at K = V = 128, scaled down: K = V = 64 at C = 16, the
    walk's V blocks of 64 (CHUNK_TILE) and the output kernel's of 32 (the scalar decay's output_tile), the
    key dim in blocks of 32 (KEY_BLOCK < K), a checkpoint every 4 chunks (CKPT_EVERY, T = 150: a
    partial last span), two sequences, bf16 with the GPU's bf16 matmul code."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 4)
    monkeypatch.setattr(launch, "KEY_BLOCK", 32)
    monkeypatch.setattr(launcher, "dot_code", lambda dtype, half, interpreting: {torch.bfloat16: 1,
                                                                                torch.float16: 2}.get(dtype, 0))
    monkeypatch.setattr(type(classes.unit("scalar decay")), "output_tile", 32)      # as on the H200
    monkeypatch.setattr(launch, "_PLANS", {})          # the LaunchPlans derived again, with the class's 32
    op = mixc.load("retention")
    args, _ = random_args(op.ir, B=2, T=150, H=2, sizes={"K": 64, "V": 64}, dtype=torch.bfloat16,
                          requires_grad=True, seed=5)
    seen_phases = []
    real = Launcher.forward

    def spy(*a, **kw):
        seen_phases.append((kw["launch"]["stage"], kw["launch"]["block", "V"], kw["launch"]["ckpt_every"]))
        return real(*a, **kw)
    monkeypatch.setattr(Launcher, "forward", spy)
    with bounds_checked() as seen:
        _fwd_bwd(op, args, mode="chunk", chunk=16)
    assert not seen["errors"], seen["errors"][:1]
    if phases == 2:             # the structure asked for: the output kernel in V blocks of 32 below the walk's 64
        assert ("walk", 64, 4) in seen_phases and ("output", 32, 4) in seen_phases and ("refill", 64, 4) in seen_phases

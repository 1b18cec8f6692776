"""The segmented walk (issue 34 item 4, mixc/standalone/segments.py): each sequence's chunk walk
cut into S segments walked at once from zero, their summaries (Phi, Z) folded, the checkpoints
and the backward's dL/dS corrected where the output and tiles kernels load them (SEGMENTED). Forced S (launch.SEGMENTS) under the interpreter at
small T: T not a multiple of S * C, packed sequences shorter than a segment (and empty), initial
and final states, fp32 and bf16; each against the unsegmented launch (the same kernels) and the
float64 reference (kernel_checks), forward and every gradient. And the policy: S from the SM
count and the shape, 1 where the grid fills the device."""
import pytest
import torch

import mixc
from mixc.runtime import launch
from mixc.runtime.inputs import random_args
from mixc.standalone.binding import Bound
from mixc.standalone import launcher

from helpers import random_state
from kernel_checks import check_against_reference

# the scalar decay (simple_gla, mamba2) and the key-diagonal decay (gla, rwkv6 with its bonus u)
# the key-diagonal cases take ~30 s each under the interpreter: slow (the default suite keeps
# gla's bf16 case below, packed and S = 3)
_slow = pytest.mark.slow
CASES = [("simple_gla", 2, False), pytest.param("gla", 3, True, marks=_slow), ("mamba2", 2, True),
         pytest.param("rwkv6", 3, False, marks=_slow), pytest.param("gla", 2, False, marks=_slow),
         ("simple_gla", 3, True)]
_IDS = ["simple_gla-S2-B2-T75", "gla-S3-packed", "mamba2-S2-packed", "rwkv6-S3-B2-T75", "gla-S2-B2-T75",
        "simple_gla-S3-packed"]


def _args(op, packed: bool, dtype=torch.float32, seed=5):
    sizes = {d.name: 4 + i for i, d in enumerate(op.ir.dims) if not d.alias_of}
    if packed:       # lengths 40, 0, 75, 9, 1 at C = 16: 9 and 1 are shorter than a segment
        lens = [40, 0, 75, 9, 1]
        args, sizes = random_args(op.ir, B=1, T=sum(lens), H=2, sizes=sizes, dtype=dtype, requires_grad=True,
                                  seed=seed)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        return args, random_state(op.ir, len(lens), 2, sizes, requires_grad=True), cu
    args, sizes = random_args(op.ir, B=2, T=75, H=2, sizes=sizes, dtype=dtype, requires_grad=True, seed=seed)
    return args, random_state(op.ir, 2, 2, sizes, requires_grad=True), None


def _run(op, args, st, cu, S, monkeypatch):
    monkeypatch.setattr(launch, "SEGMENTS", S)
    leaves = list(args.values()) + list(st.values())
    kw = {} if cu is None else {"cu_seqlens": cu}
    with launcher.recording() as log:
        o, s = op(**args, initial_state=st, output_final_state=True, mode="chunk", chunk=16, **kw)
        w = torch.Generator().manual_seed(2)
        loss = (o.float() * torch.randn(o.shape, generator=w)).sum() + sum(
            (x * torch.randn(x.shape, generator=w)).sum() for x in s.values())
        grads = torch.autograd.grad(loss, leaves)
    return o, s, grads, {r["kernel"].rsplit("_", 1)[-1] + ("_bwd" if "bwd" in r["kernel"] else ""): r["grid"]
                         for r in log}


@pytest.mark.parametrize("name,S,packed", CASES, ids=_IDS)
def test_segments_equal_the_unsegmented_walk_and_float64(name, S, packed, monkeypatch):
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load(name)
    args, st, cu = _args(op, packed)
    o1, s1, g1, grids1 = _run(op, args, st, cu, 1, monkeypatch)
    oS, sS, gS, gridsS = _run(op, args, st, cu, S, monkeypatch)
    n = 5 if packed else 2
    # the walks run on S times the programs (sequences x S x heads)
    assert grids1["walk"][0] == n * 2 and gridsS["walk"][0] == n * S * 2, gridsS
    assert grids1["walk_bwd"][0] == n * 2 and gridsS["walk_bwd"][0] == n * S * 2, gridsS
    torch.testing.assert_close(oS, o1, rtol=1e-5, atol=1e-5)
    for k in s1:
        torch.testing.assert_close(sS[k], s1[k], rtol=1e-5, atol=1e-5)
    for a, b in zip(gS, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and against float64 (kernel_checks: within 4x the torch backend's error), S forced
    monkeypatch.setattr(launch, "SEGMENTS", S)
    check_against_reference(op, {}, args, st, torch.float32, cu_seqlens=cu, mode="chunk", chunk=16)


@pytest.mark.parametrize("name", ["gla", "mamba2"])
def test_segments_bf16_against_float64(name, monkeypatch):
    """bf16 inputs (checkpoints and dL/dS in bf16, corrected as loaded): forced S = 3, packed."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "SEGMENTS", 3)
    op = mixc.load(name)
    args, st, cu = _args(op, True, dtype=torch.bfloat16, seed=8)
    check_against_reference(op, {}, args, st, torch.bfloat16, cu_seqlens=cu, mode="chunk", chunk=16)


@pytest.mark.parametrize("packed", [False, True], ids=["B2-T75", "packed"])
def test_segments_with_sparse_checkpoints(packed, monkeypatch):
    """A checkpoint every 2 chunks (the GPU's rule; the interpreter's is every chunk): the output
    kernel corrects the checkpoint it loads before walking its 2 chunks and stores it back, the
    refill walks from the stored one (without the store the backward's states are the segments'
    local ones and the gradients differ)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    op = mixc.load("simple_gla")
    args, st, cu = _args(op, packed, seed=11)
    o1, s1, g1, _ = _run(op, args, st, cu, 1, monkeypatch)
    oS, sS, gS, grids = _run(op, args, st, cu, 3, monkeypatch)
    assert "refill_bwd" not in grids and "refill" in grids, grids
    torch.testing.assert_close(oS, o1, rtol=1e-5, atol=1e-5)
    for k in s1:
        torch.testing.assert_close(sS[k], s1[k], rtol=1e-5, atol=1e-5)
    for a, b in zip(gS, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(launch, "SEGMENTS", 3)
    check_against_reference(op, {}, args, st, torch.float32, cu_seqlens=cu, mode="chunk", chunk=16)


def _bound(name, B, T, H, K=128, V=128):
    """A call's shapes on the meta device (the policy reads shapes only)."""
    op = mixc.load(name)
    sizes = {d.name: (K if i == 0 else V) for i, d in enumerate(d for d in op.ir.dims if not d.alias_of)}
    x = torch.empty((B, T, H, K), dtype=torch.bfloat16, device="meta")
    return op.plan(), Bound(B=B, T=T, H=H, sizes=sizes, inputs={"x": x}, params={}, options={}, flags={},
                            initial_state=None, cu_seqlens=None)


@pytest.mark.parametrize("name", ["simple_gla", "gla", "mamba2", "rwkv6"])
def test_segments_policy(name, monkeypatch):
    """On an H100's 132 SMs at B = 1, H = 8, T = 65,536 (K = V = 128): 16 walk programs (2 tile
    blocks of 64 per head) -> S = 9 (144 programs, a ninth of the chain); at B = 16 the grid
    fills the SMs (S = 1); short sequences keep at least two checkpoint spans per segment; off
    the GPU without a forced count, and for a class it does not serve (delta_rule), S = 1."""
    monkeypatch.setattr(launch, "SM_COUNT", 132)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", None)
    monkeypatch.setattr(launch, "SEGMENTS", None)
    plan, b = _bound(name, 1, 65536, 8)
    rules = launch.rules(plan)
    assert rules.segments(b, 64) == 9
    assert rules.checkpoint_count(b, 64) == launch.checkpoint_slots(b, 64 * rules.checkpoint_every(b, 64)) + 8
    assert launch.rules(plan).segments(_bound(name, 16, 65536, 8)[1], 64) == 1
    assert launch.rules(plan).segments(_bound(name, 1, 256, 8)[1], 64) == 2        # 4 chunks (R = 1 there)
    assert launch.rules(plan).segments(_bound(name, 1, 128, 8)[1], 64) == 1        # 2 chunks: no split
    monkeypatch.setattr(launch, "SM_COUNT", None)
    assert launch.rules(plan).segments(b, 64) == 1                                 # the CPU
    plan, b = _bound("delta_rule", 1, 65536, 8)
    monkeypatch.setattr(launch, "SEGMENTS", 4)
    assert launch.rules(plan).segments(b, 64) == 1


def test_segments_env_refuses_a_bad_count(monkeypatch):
    from mixc.standalone.launch_data import env_segments
    monkeypatch.setenv("MIXC_SEGMENTS", "two")
    with pytest.raises(ValueError, match="MIXC_SEGMENTS: expected a positive integer"):
        env_segments()
    monkeypatch.setenv("MIXC_SEGMENTS", "3")
    assert env_segments() == 3


def test_segmented_calls_are_not_replayed(monkeypatch):
    """The replay fast path repeats a no-grad call's launches; the segmented walk corrects the
    checkpoints between its launches (not a launch), so such a call is never replayed: the
    second and third calls equal the unsegmented output too."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load("simple_gla")
    op._fast.clear()
    args, _ = random_args(op.ir, B=1, T=70, H=2, sizes={"K": 4, "V": 5}, dtype=torch.float32, seed=9)
    monkeypatch.setattr(launch, "SEGMENTS", 1)
    with torch.no_grad():
        want = op(**args, mode="chunk", chunk=16)
    assert op._fast                 # the unsegmented call is replayable (its key holds SEGMENTS)
    op._fast.clear()
    monkeypatch.setattr(launch, "SEGMENTS", 3)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(op(**args, mode="chunk", chunk=16), want, rtol=1e-5, atol=1e-5)
    assert not op._fast, "a segmented call left a replay recipe"

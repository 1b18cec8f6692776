"""The chunked forward's stages beside the walk and the output kernel (docs/kernels.md). The staged intra-chunk
matrices (plan.layout.intra_matrices, the key-diagonal decay's): in two launches the intra kernel computes
each chunk's [C, C] matrix A once and the output kernel, every tile block, reads it back instead of
computing it (launch.STAGE_INTRA). A is stored in the dtype the output kernel's matmul takes it in (bf16
inputs: bf16 on a GPU, fp32 under the interpreter, whose bf16 tl.dot is wrong), so the staged
forward equals the computing one bit for bit: checked with two tile blocks, fp32 and bf16, a
readout of S_t (gla) and of S_{t-1} (rwkv6), a value that is not finite in one tile block only
and a key that is not finite; A itself against float64 pairs. Packed sequences:
test_sparse_checkpoints.py's packed test runs gla too; every chunked spec's two-launch test in
tests/ops/test_kernels.py runs the staged path. The scalar decay's output kernel tile blocks (32,
narrower than the walk's) against the float64 reference."""
import pytest
import torch

import mixc
from mixc import classes
from mixc.runtime import launch
from mixc.standalone.launcher import Launcher
from mixc.runtime.inputs import random_args
from mixc.runtime.signature import bind

from helpers import random_state  # noqa: F401
from kernel_checks import check_against_reference


def _phases_of_one_call(monkeypatch, call) -> list:
    seen = []
    real = Launcher.forward
    monkeypatch.setattr(Launcher, "forward", lambda *a, **kw: (seen.append(kw["launch"]["stage"]), real(*a, **kw))[1])
    out = call()
    monkeypatch.setattr(Launcher, "forward", real)
    return out, seen


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf * 0
@pytest.mark.parametrize("name,dtype", [("gla", torch.float32), ("rwkv6", torch.bfloat16)],
                         ids=["gla-fp32", "rwkv6-bf16"])
def test_staged_forward_equals_the_computing_one(name, dtype, monkeypatch):
    """B1-T60-H1-K8-V32, C = 16, tiles of 16 (two tile blocks), R = 2: outputs and final states
    bit for bit with STAGE_INTRA on (launches 4, 1, 2) and off (1, 2); an inf in one value of
    tile block 0 (the block the intra kernel's program loads: were its keys zeroed by that value, block
    1's outputs would lose the pairs with that token) and a NaN in one key give the same
    non-finite values and the same finite ones both ways."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    op = mixc.load(name)
    assert op.plan().layout.intra_matrices == 1
    args, sizes = random_args(op.ir, B=1, T=60, H=1, sizes={"K": 8, "V": 32}, dtype=dtype, seed=41)
    st = random_state(op.ir, 1, 1, sizes)
    bad = dict(args)
    bad["v"] = args["v"].clone()
    bad["v"][0, 20, 0, 5] = float("inf")               # tile block 0 of V only (the intra kernel's block)
    bad["k"] = args["k"].clone()
    bad["k"][0, 50, 0, 3] = float("nan")
    for inputs in (args, bad):
        results = {}
        for staged in (True, False):
            monkeypatch.setattr(launch, "STAGE_INTRA", staged)
            op._fast.clear()            # launched, not a replay (runtime/fastpath.py)
            (o, final), phases = _phases_of_one_call(
                monkeypatch, lambda: op(**inputs, initial_state=st, output_final_state=True, mode="chunk", chunk=16))
            assert phases == (["intra", "walk", "output"] if staged else ["walk", "output"])
            results[staged] = (o, final)
        (o1, f1), (o2, f2) = results[True], results[False]
        torch.testing.assert_close(o1, o2, rtol=0, atol=0, equal_nan=True)
        for k in f1:
            torch.testing.assert_close(f1[k], f2[k], rtol=0, atol=0, equal_nan=True)
        if inputs is args:
            assert torch.isfinite(o1).all()
        else:       # not finite from the bad token on: in its value's column (tile block 1), or everywhere
            assert not torch.isfinite(o1[0, 21:, 0, 5]).any() and torch.isfinite(o1[0, :50, 0, 16:]).all()
            assert not torch.isfinite(o1[0, 51:, 0]).any() and torch.isfinite(o1[0, :20, 0]).all()


def test_intra_buffer_holds_each_chunks_matrix_by_token_row(monkeypatch):
    """What the intra kernel writes: row t of p_intra is token t's row of its chunk's A (causal: zero
    past the diagonal), each chunk's A equal to the pairs sum_d q_id k_jd exp(b_id - b_jd)
    computed here in float64 from the inputs (gla, B1-T40-H1, C = 16: chunks of 16, 16, 8)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load("gla")
    plan = op.plan()
    args, _ = random_args(op.ir, B=1, T=40, H=1, sizes={"K": 4, "V": 4}, dtype=torch.float32, seed=44)
    bound = bind(op.ir, args)
    kept = {}
    real = Launcher.forward

    def spy(*a, **kw):
        r = real(*a, **kw)
        if kw["launch"]["stage"] == "intra":
            kept["A"] = kw["intra"].clone()
        return r
    monkeypatch.setattr(Launcher, "forward", spy)
    launch.chunk_forward(plan, bound, output_final_state=False, C=16)
    A = kept["A"][:, 0, 0].double()                     # [T, C]
    q, k, g = (args[x][0, :, 0].double() for x in ("q", "k", "g"))
    scale = 4 ** -0.5
    for c0 in (0, 16, 32):
        n = min(16, 40 - c0)
        b = g[c0:c0 + n].cumsum(0)                          # [n, K]
        want = torch.einsum("ik,jk,ijk->ij", q[c0:c0 + n] * scale, k[c0:c0 + n],
                            torch.exp(b[:, None] - b[None, :])).tril()
        torch.testing.assert_close(A[c0:c0 + n, :n], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,sizes", [("mamba2", {"N": 4, "P": 48}), ("mlstm", {"K": 4, "V": 48})],
                         ids=["mamba2-N4-P48", "mlstm-K4-V48"])
def test_output_tile_blocks_differ_from_the_walks(name, sizes, monkeypatch):
    """The scalar decay's output kernel in tile blocks of 32 (classes/scalar.py output_tile), the walk
    blocks of 64 (launch.CHUNK_TILE): a tile dim of 48 (one walk block, two output blocks,
    the second partial), B1-T40-H2, C = 16, R = 2, against the float64 reference in forward,
    final state and every gradient: mamba2, and mlstm (a stabilizer and a normalizer n[K]
    without the tile dim, whole in every block)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    # the class's own setting is the walk's blocks since the H200 fault (classes/scalar.py): the
    # mechanism stays, tested at 32
    monkeypatch.setattr(type(classes.unit("scalar decay")), "output_tile", 32)
    monkeypatch.setattr(launch, "_PLANS", {})          # the LaunchPlans derived again, with the class's 32
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=1, T=40, H=2, sizes=sizes, dtype=torch.float32,
                              requires_grad=True, seed=45)
    bound = bind(op.ir, {k: v.detach() for k, v in args.items()})
    tile = op.plan().layout.tile
    assert launch.rules(op.plan()).chunk_blocks(bound)["block", tile] == 64
    assert launch.rules(op.plan()).output_blocks(bound) == {("block", tile): 32}
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16)

"""The chunked forward's intra kernel and the output kernel over the key dim's blocks (mixc/codegen/
key_split.py): KEY_BLOCK = 16 at a key dim of 40 (three blocks, the last partial), two launches,
one chunk a program (the interpreter's CKPT_EVERY), so the output kernel (and the intra kernel where staged) run
the loop; the output, final state and every gradient against the float64 reference (mutation:
one block instead of three fails every spec). And a key
that is not finite in one block: a block zeroes its keys by its own entries, the output is NaN
from that token on by the whole test, and the earlier rows are those of a finite run."""
import pytest
import torch

import mixc
from mixc.codegen.key_split import key_dim
from mixc.runtime import launch

from helpers import random_args, random_state
from kernel_checks import check_against_reference

# every library spec the pass splits (tests/codegen/test_key_split.py): the key-diagonal decay
# (staged A: the intra and output kernels; rwkv6's prev readout and bonus, s4d, hgrn2), the rank-1 class (a
# scalar decay, a per-key one: kda, comba, rwkv7), the scalar and prefix-sum classes
SPECS = ["gla", "rwkv6", "hgrn2", "s4d", "delta_rule", "gated_delta_rule", "kda", "comba", "rwkv7", "simple_gla",
         "retention", "lightning_attn", "mamba2", "mlstm", "linear_transformer", "performer"]


# ... and whose backward tiles kernel also loops over key blocks after its tile loop
BACKWARD = {"gla", "rwkv6", "hgrn2", "simple_gla", "retention", "lightning_attn", "mamba2"}


def _against_float64(name, monkeypatch, *, every: int, cu, grads: bool, seed: int):
    """B1-T37-H2, the key dim 40 in blocks of 16, the others 8, chunks of 16, a checkpoint
    every `every` chunks, two launches; output and final state (and every gradient: grads)
    against float64."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "KEY_BLOCK", 16)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", every)
    op = mixc.load(name)
    key = key_dim(op.plan())
    sizes = {d.name: 8 for d in op.ir.dims if not d.alias_of} | {key: 40}
    args, sizes = random_args(op.ir, B=1, T=37, H=2, sizes=sizes, dtype=torch.float32, requires_grad=grads, seed=seed)
    st = random_state(op.ir, 1 if cu is None else len(cu) - 1, 2, sizes, requires_grad=grads)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16, cu_seqlens=cu, grads=grads)


@pytest.mark.parametrize("name", SPECS)
def test_forward_over_key_blocks_matches_float64(name, monkeypatch):
    """One chunk a program (a packed batch for gla). Output and final state; every gradient
    too where the backward's tiles kernel loops over key blocks (elsewhere the backward is
    unchanged and reads the forward's checkpoints from the walk, which has no key loop)."""
    _against_float64(name, monkeypatch, every=1, cu=torch.tensor([0, 5, 21, 37]) if name == "gla" else None,
                     grads=name in BACKWARD, seed=31)


# ... and whose forward output kernel walking several chunks holds the state in static key blocks
# (codegen/key_walk.py: the key-diagonal decay's)
WALK = ["gla", "rwkv6", "hgrn2", "s4d"]


@pytest.mark.parametrize("name", WALK)
def test_a_walk_over_static_key_blocks_matches_float64(name, monkeypatch):
    """The key dim 40 in static blocks of 16 (three of the eight copies, the third partial, the
    rest past K), a checkpoint every two chunks: the output kernel's first program walks two chunks with
    each block's state rows carried (a packed batch for gla: sequences of 3 and 34 tokens).
    Output and final state (mutation: the state not carried from one chunk to the next, or a
    block left out, fails every spec)."""
    _against_float64(name, monkeypatch, every=2, cu=torch.tensor([0, 3, 37]) if name == "gla" else None,
                     grads=False, seed=37)


BAD, COLUMN = 21, 20            # token 21 (chunk 1 of 16), key entry 20 (key block 1 of 16)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf * 0
@pytest.mark.parametrize("name", ["gla", "delta_rule"])
def test_a_bad_key_in_one_block_leaves_the_earlier_rows_of_a_finite_run(name, monkeypatch):
    """B1-T37-H1-K40-V8, KEY_BLOCK = 16, two launches: an inf in token 21's key, entry 20
    (block 1 of three; block 0 and 2 of that key are finite and still enter their blocks'
    sums). Rows 0..20 of the output equal those of the call with the entry finite; rows 21 on
    are NaN, as the recurrence gives."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "KEY_BLOCK", 16)
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=37, H=1, sizes={"K": 40, "V": 8}, dtype=torch.float32, seed=23)
    outs = {}
    for value in (float("inf"), 0.5):
        inputs = {k: v.clone() for k, v in args.items()}
        inputs["k"][0, BAD, 0, COLUMN] = value
        outs[value], _ = op(**inputs, mode="chunk", chunk=16)
    bad, good = outs[float("inf")], outs[0.5]
    assert torch.isfinite(good).all()
    torch.testing.assert_close(bad[0, :BAD], good[0, :BAD], rtol=1e-5, atol=1e-5)
    assert torch.isnan(bad[0, BAD:]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf * 0
def test_a_bad_key_in_one_static_block_makes_the_walk_nan_from_there(monkeypatch):
    """gla walking two chunks a program in static key blocks (codegen/key_walk.py), an inf in
    token 5's key, entry 20 (chunk 0, key block 1 of three): rows 0..4 equal the finite call's,
    every row from 5 on is NaN, chunk 1's too, which the same program computes from the block
    states it carried (block 1's NaN; blocks 0 and 2 saw the token's value and stay finite, the
    readout sums them all)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "KEY_BLOCK", 16)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=37, H=1, sizes={"K": 40, "V": 8}, dtype=torch.float32, seed=29)
    outs = {}
    for value in (float("inf"), 0.5):
        inputs = {k: v.clone() for k, v in args.items()}
        inputs["k"][0, 5, 0, COLUMN] = value
        outs[value], _ = op(**inputs, mode="chunk", chunk=16)
    bad, good = outs[float("inf")], outs[0.5]
    assert torch.isfinite(good).all()
    torch.testing.assert_close(bad[0, :5], good[0, :5], rtol=1e-5, atol=1e-5)
    assert torch.isnan(bad[0, 5:]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf * 0
def test_a_bad_key_leaves_the_earlier_gradients_of_a_finite_run(monkeypatch):
    """gla (whose backward tiles kernel loops over key blocks too), as above with dO zero from token
    21 on (a padded batch): every gradient's rows 0..20 equal those of the finite call, and are
    finite."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "KEY_BLOCK", 16)
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=37, H=1, sizes={"K": 40, "V": 8}, dtype=torch.float32, seed=23)
    names = [d.name for d in op.ir.inputs]
    dout = torch.randn(1, 37, 1, 8, generator=torch.Generator().manual_seed(5))
    dout[:, BAD:] = 0.0
    grads = {}
    for value in (float("inf"), 0.5):
        inputs = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
        with torch.no_grad():
            inputs["k"][0, BAD, 0, COLUMN] = value
        o, _ = op(**inputs, mode="chunk", chunk=16)
        grads[value] = dict(zip(names, torch.autograd.grad(o, [inputs[k] for k in names], dout)))
    for k in names:
        assert torch.isfinite(grads[float("inf")][k][0, :BAD]).all(), k
        torch.testing.assert_close(grads[float("inf")][k][0, :BAD], grads[0.5][k][0, :BAD], rtol=1e-5, atol=1e-5,
                                   msg=k)

"""The chunked forward's checkpoints at every CKPT_EVERY-th chunk start (launch.checkpoint_every):
the walk stores 1/R of the states, the output kernel walks each checkpoint's R chunks from it, the backward
refills the state at every chunk start first (the refill, launch.chunk_states). Checked against the
float64 reference with several checkpoints per sequence, a partial last one (chunks not a
multiple of R), packed sequences of several lengths (one empty), initial and final states, in one
launch (the fused walk writes the same sparse checkpoints) and two; the checkpoint buffer's size and
the refilled states against a dense forward's, bit for bit; and the policy on a GPU's shapes."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mixc
from mixc.runtime import custom_op, launch
from mixc.runtime.inputs import random_args
from mixc.runtime.signature import bind

from helpers import random_state  # noqa: F401
from kernel_checks import check_against_reference

# a class each: scalar decay (and simple_gla's two-launch default), key-diagonal, rank-1, a
# value-diagonal one with a stabilizer state (mlstm's m: its checkpoints go through the same path)
SPECS = [("simple_gla", {"K": 5, "V": 6}), ("gla", {"K": 5, "V": 6}), ("delta_rule", {"K": 5, "V": 6}),
         ("mlstm", None)]


# R = 3 over five chunks: spans of 3 and 2; R = 2: 2, 2 and a last span of one chunk (the refill
# stores its start and loads nothing); the one-launch walk writes the same sparse checkpoints
CASES = [(name, sizes, 2, 3) for name, sizes in SPECS] + [(*SPECS[0], 2, 2), (*SPECS[2], 1, 3)]


@pytest.mark.parametrize("name,sizes,phases,every", CASES,
                         ids=[f"{n}-{'phases' if p == 2 else 'walk'}-R{r}" for n, _, p, r in CASES])
def test_sparse_checkpoints_match_reference(name, sizes, phases, every, monkeypatch):
    """B2-T75-H1, C = 16: five chunks, so R = 2 leaves a last checkpoint of one chunk, R = 3 of two."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", every)
    op = mixc.load(name)
    sizes = sizes or {d.name: 4 + i for i, d in enumerate(op.ir.dims) if not d.alias_of}
    args, sizes = random_args(op.ir, B=2, T=75, H=1, sizes=sizes, dtype=torch.float32, requires_grad=True,
                              seed=20 + every)
    st = random_state(op.ir, 2, 1, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16)


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule", "gla"])
def test_sparse_checkpoints_packed_sequences(name, monkeypatch):
    """Packed lengths 40, 0, 75, 17, 1 at C = 16, R = 2: the output and refill programs find their
    sequence from a table of checkpoint slots (bos_i // 32 + i, ...); gla's intra kernel (its staged
    intra-chunk matrices, tests/runtime/test_forward_stages.py) takes the output kernel's table and writes
    A by token row."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    op = mixc.load(name)
    lens = [40, 0, 75, 17, 1]
    args, sizes = random_args(op.ir, B=1, T=sum(lens), H=1, sizes={"K": 5, "V": 6}, dtype=torch.float32,
                              requires_grad=True, seed=31)
    st = random_state(op.ir, len(lens), 1, sizes, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    check_against_reference(op, {}, args, st, torch.float32, cu_seqlens=cu, mode="chunk", chunk=16)


@pytest.mark.parametrize("packed", [False, True], ids=["B2-T75", "packed"])
def test_refilled_states_equal_the_dense_ones(packed, monkeypatch):
    """The refill from checkpoints every 3 chunks gives the very states a dense walk stores (the
    same fp32 walk, bit for bit), in a buffer of the dense size; the sparse buffer has
    checkpoint_slots(bound, 3 C) slots."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load("simple_gla")
    plan = op.plan()
    B, T = (1, 100) if packed else (2, 75)
    args, _ = random_args(op.ir, B=B, T=T, H=2, sizes={"K": 5, "V": 6}, dtype=torch.float32, seed=4)
    cu = torch.tensor([0, 40, 40, 93, 100], dtype=torch.int32) if packed else None
    bound = bind(op.ir, args | ({"cu_seqlens": cu} if packed else {}))
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 1)
    _, _, dense = launch.chunk_forward(plan, bound, output_final_state=False, checkpoints=True, C=16)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 3)
    _, _, sparse = launch.chunk_forward(plan, bound, output_final_state=False, checkpoints=True, C=16)
    refilled = launch.chunk_states(plan, bound, sparse, C=16)
    # the slots of sequence i's chunks: bos_i // C + i + c (the rest is slack, never written)
    starts, lens = ([0, 40, 40, 93], [40, 0, 53, 7]) if packed else ([0, 75], [75, 75])
    used = [b // 16 + i + c for i, (b, n) in enumerate(zip(starts, lens)) for c in range(-(-n // 16))]
    assert len(used) == (8 if packed else 10)
    for name, d in dense.items():
        assert sparse[name].shape[0] == launch.checkpoint_slots(bound, 48)
        assert refilled[name].shape == d.shape
        assert torch.isfinite(d[used]).all()
        assert torch.equal(refilled[name][used], d[used]), name


def test_policy_on_gpu_shapes(monkeypatch):
    """Off the interpreter: CHECKPOINT_TOKENS // C chunks per checkpoint (64 tokens by default,
    the time model's choice; 256 here, as it was, to see the rule), halved while the output
    kernel would have fewer than MIN_PROGRAMS programs; the registered op's fake checkpoints take
    the same count (torch.compile)."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", None)
    assert launch.CHECKPOINT_TOKENS == 64
    monkeypatch.setattr(launch, "CHECKPOINT_TOKENS", 256)
    op = mixc.load("simple_gla")
    plan = op.plan()

    def every(B, T, H, C):
        args, _ = random_args(op.ir, B=B, T=T, H=H, sizes={"K": 16, "V": 128}, dtype=torch.bfloat16, seed=1)
        bound = bind(op.ir, args)
        r = launch.checkpoint_every(plan, bound, C)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:      # the registered op's fake: same slots
            fake = [mode.from_tensor(x) for x in args.values()]
            outs = custom_op.ops_for(plan)[0](fake, [], [], [], None, False, True, True, C)
        assert outs[-1].shape[0] == launch.checkpoint_slots(bound, C * r)
        return r
    # V = 128 in blocks of 64: two tile programs per head
    assert every(1, 8192, 16, 64) == 4            # 32 checkpoints x 16 heads x 2 tiles = 1024 programs
    assert every(1, 8192, 16, 32) == 8
    assert every(2, 2048, 16, 64) == 4            # 16 x 32 = 512
    assert every(1, 2048, 16, 64) == 2            # R = 4: 8 x 32 = 256 < 512; R = 2: 16 x 32 = 512
    assert every(1, 512, 4, 64) == 1              # 8 programs per checkpoint: 8 x 8 = 64 even at R = 1


def test_a_changed_checkpoint_count_between_forward_and_backward_is_an_error(monkeypatch):
    """The backward reads the checkpoints at the forward's R: R changed in between (the
    knob set between the two) is a ValueError naming it, not states read from wrong slots."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    op = mixc.load("simple_gla")
    args, _ = random_args(op.ir, B=1, T=80, H=1, sizes={"K": 4, "V": 4}, dtype=torch.float32, requires_grad=True,
                          seed=8)
    o, _ = op(**args, mode="chunk", chunk=16)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 1)
    with pytest.raises(ValueError, match="CHECKPOINT_EVERY .* changed between the forward and its backward"):
        o.sum().backward()


def test_class_policies_the_rank1_checkpoint_per_chunk_and_backward_tiles(monkeypatch):
    """The rank-1 class asks a checkpoint per 64 tokens (its output kernel walking several chunks
    spilled on sm_90: classes/rank1.py checkpoint_tokens), so R = 1 at its C = 64 and 2 at
    C = 32 whatever the launch's tokens (256 here); its backward takes V blocks of 16
    (backward_tile), the forward 64; a per-key decay (KDA) and the other classes keep the
    launch's tokens and blocks."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", None)
    monkeypatch.setattr(launch, "CHECKPOINT_TOKENS", 256)

    def policy(name, C):
        op = mixc.load(name)
        args, _ = random_args(op.ir, B=1, T=4096, H=16, sizes={"K": 128, "V": 128}, dtype=torch.bfloat16, seed=1)
        plan, bound = op.plan(), bind(op.ir, args)
        rules = launch.rules(plan)
        return (rules.checkpoint_every(bound, C), rules.chunk_blocks(bound)["block", "V"],
                rules.backward_blocks(bound).get(("block", "V")))
    assert mixc.load("delta_rule").plan().layout.chunk_size == 64
    assert policy("delta_rule", 64) == (1, 64, 16)
    assert policy("gated_delta_rule", 32) == (2, 64, 16)
    assert policy("simple_gla", 64) == (4, 64, None)
    assert launch.rules(mixc.load("kda").plan()).checkpoint_tokens() == launch.CHECKPOINT_TOKENS

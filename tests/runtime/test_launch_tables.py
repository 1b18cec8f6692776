"""Host-side tables of the chunked kernels' two-launch form (runtime/launch.py): which
sequence and chunk each output program (a checkpoint slot) takes."""
import pytest
import torch

import mixc
from mixc.runtime import launch
from mixc.runtime.signature import bind

from helpers import random_args


@pytest.mark.parametrize("lens,C", [([5], 16), ([0, 16, 0, 33, 1, 0], 16), ([64, 64], 16), ([1] * 9, 16),
                                    ([0, 0, 40], 32), ([17, 0, 0, 15, 48], 16)],
                         ids=lambda x: str(x))
def test_chunk_slot_table_names_every_chunk_once(lens, C):
    """Slot s of sequence i's chunk c is bos_i // C + i + c (the checkpoints' layout); the table
    must give each such slot its sequence, and every other slot a sequence whose chunk index
    there is past its last chunk (the program does nothing)."""
    op = mixc.load("gla")
    T = sum(lens)
    kw, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 4, "V": 4})
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    bound = bind(op.ir, dict(kw, cu_seqlens=cu))
    programs, args = launch.rules(op.plan()).chunk_launch(bound, C)
    table = args["chunk_seq"].tolist()
    assert programs == len(table) == launch.checkpoint_slots(bound, C)
    want = {}
    for i, (bos, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        for c in range(-(-n // C)):
            want[bos // C + i + c] = (i, c)
    got = {}
    for slot, i in enumerate(table):
        bos, eos = cu[i].item(), cu[i + 1].item()
        c = slot - bos // C - i                      # what the kernel computes (codegen/chunk_ir.programs)
        assert c >= 0, (slot, i)
        if c < -(-(eos - bos) // C):
            got[slot] = (i, c)
    assert got == want


def test_forced_phases_win_over_the_launch_config(monkeypatch):
    """gpu_check's "chunk walk" mode sets CHUNK_PHASES = 1 while CUDA's untuned launch config
    says two launches: the forced choice must win, or the mode would test the wrong form."""
    from mixc.runtime.autotune import Config
    cpu, plan = torch.device("cpu"), mixc.load("gla").plan()

    def phases(cfg):
        return launch.rules(plan).phases(cfg, cpu)
    monkeypatch.setattr(launch, "CHUNK_PHASES", None)
    assert phases(Config(8, 3, phases=2)) == 2 and phases(Config(8, 1, phases=1)) == 1
    assert phases(None) == 1                     # the interpreter's default: the walk
    monkeypatch.setattr(launch, "CHUNK_PHASES", 1)
    assert phases(Config(8, 3, phases=2)) == 1
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    assert phases(Config(8, 1, phases=1)) == 2 and phases(None) == 2

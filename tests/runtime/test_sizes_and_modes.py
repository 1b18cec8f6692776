"""Crashes from issue 30: a chunk far past the sequence (mode torch allocated 62.5 GB for
chunk=10**6 at T = 8; a kernel chunk of 2**20 passed Triton's block limit) is clamped to the
sequence, and a mode that is not a string (`mode=['auto']`) is an ArgumentError, not the fast
path's TypeError (unhashable)."""
import pytest
import torch

import mixc
from mixc.runtime.errors import ArgumentError

from helpers import random_args


def _gla(T=8):
    op = mixc.load("gla")
    args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32, seed=36)
    return op, args


@pytest.mark.parametrize("mode,huge,small", [("torch", 10**6, 8), ("chunk", 2**20, 16)])
def test_a_chunk_past_the_sequence_is_clamped(mode, huge, small):
    """T = 8: the huge chunk gives the small chunk's output and final state, bit for bit."""
    op, args = _gla()
    o, st = op(**args, mode=mode, chunk=huge, output_final_state=True)
    want_o, want = op(**args, mode=mode, chunk=small, output_final_state=True)
    assert torch.equal(o, want_o) and torch.equal(st["S"], want["S"])


@pytest.mark.parametrize("call", ["op", "step", "step-inplace"])
def test_a_mode_that_is_not_a_string_is_named(call):
    op, args = _gla()
    one = {k: v[:, 0] for k, v in args.items()}
    with pytest.raises(ArgumentError, match=r"^mode: expected one of"):
        if call == "op":
            op(**args, mode=["auto"])
        else:
            state = {"S": torch.zeros(1, 2, 4, 4)}
            op.step(**one, state=state, mode=["auto"], inplace=call == "step-inplace")

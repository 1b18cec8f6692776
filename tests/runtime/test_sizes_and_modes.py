"""Crashes from issue 30: a chunk far past the sequence (mode torch allocated 62.5 GB for
chunk=10**6 at T = 8; a kernel chunk of 2**20 passed Triton's block limit) is clamped to the
sequence, and a mode that is not a string (`mode=['auto']`) is an ArgumentError, not the fast
path's TypeError (unhashable)."""
import pytest
import torch

import mixc
from mixc.standalone.errors import ArgumentError

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


def _recurrences():
    from mixc.dsl import library_names
    return library_names("recurrent")


@pytest.mark.parametrize("B,H", [(0, 2), (2, 0)], ids=["B0", "H0"])
@pytest.mark.parametrize("name", _recurrences())
def test_the_torch_backend_returns_empty_outputs_for_no_sequence_or_head(name, B, H):
    """B = 0 or H = 0 in mode torch: op() and step() return empty outputs and states of the
    reference's shapes (the chunked and convolution forms raised reshape errors, issue 30)."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=B, T=5, H=H, sizes={"K": 4, "V": 4, "N": 4, "P": 4, "D": 4},
                              dtype=torch.float32, seed=37)
    want_o, want = op(**args, mode="reference", output_final_state=True)
    o, st = op(**args, mode="torch", output_final_state=True)
    assert o.shape == want_o.shape and o.numel() == 0
    assert {k: v.shape for k, v in st.items()} == {k: v.shape for k, v in want.items()}
    names = {d.name for d in op.ir.inputs}
    o1, st1 = op.step(**{k: (v[:, 0] if k in names else v) for k, v in args.items()}, state=st, mode="torch")
    assert o1.shape == want_o[:, 0].shape
    assert {k: v.shape for k, v in st1.items()} == {k: v.shape for k, v in want.items()}


def test_tokens_per_checkpoint_past_the_sequence_are_clamped(tmp_path):
    """CK = 2**40 sized the recurrent backward's scratch at 281 TB; clamped to T it gives CK = 8's
    output and gradients, bit for bit, in mixc.load's op and in the compiled module."""
    import subprocess
    import sys
    op, args = _gla()

    def run(call, CK):
        leaves = {k: v.detach().requires_grad_(True) for k, v in args.items()}
        o, _ = call(**leaves, mode="recurrent", CK=CK)
        o.square().sum().backward()
        return [o.detach()] + [leaves[k].grad for k in leaves]
    for a, b in zip(run(op, 2 ** 40), run(op, 8)):
        assert torch.equal(a, b)
    subprocess.run([sys.executable, "-m", "mixc.cli", "compile", "gla", "-o", str(tmp_path)], check=True,
                   capture_output=True)
    sys.path.insert(0, str(tmp_path))
    try:
        import gla as compiled
        for a, b in zip(run(compiled.op, 2 ** 40), run(compiled.op, 8)):
            assert torch.equal(a, b)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gla", None)

"""output_final_state must be a bool (a string "no" is truthy); a sliding window far longer
than the sequence allocates its cache by the tokens seen, not by the window."""
import pytest
import torch

import mixc
from mixc.runtime.signature import ArgumentError
from tests.helpers import random_args


@pytest.mark.parametrize("name", ["gla", "swa"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, torch.tensor(False)], ids=["str", "0", "1", "None", "tensor"])
def test_output_final_state_must_be_a_bool(name, value):
    op = mixc.load(name)
    kw, _ = random_args(op.ir, B=1, T=5, H=2, seed=1)
    with pytest.raises(ArgumentError, match=r"output_final_state: expected True or False, got "):
        op(**kw, output_final_state=value, mode="torch")


def test_a_huge_window_allocates_by_the_sequence():
    op = mixc.load("swa")
    kw, _ = random_args(op.ir, B=2, T=16, H=2, sizes={"K": 4, "V": 4}, seed=2)
    window = 30_000_000                                # [2, 2, window - 1, 4] floats would be 1.9 GB
    o, st = op(**kw, window=window, output_final_state=True, mode="torch")
    assert st["attend0_k"].shape == (2, 2, 16, 4) and st["attend0_v"].shape == (2, 2, 16, 4)
    ref, _ = op(**kw, window=window, mode="reference")
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)
    # steps grow the cache up to the window and equal the whole sequence
    more, _ = random_args(op.ir, B=2, T=20, H=2, sizes={"K": 4, "V": 4}, seed=3)
    whole = {k: torch.cat([kw[k], more[k][:, :4]], 1) for k in kw}
    want, _ = op(**whole, window=5, mode="reference")
    _, st = op(**{k: v[:, :3] for k, v in whole.items()}, window=5, output_final_state=True, mode="torch")
    assert st["attend0_k"].shape[2] == 3
    for t in range(3, 20):
        ot, st = op.step(**{k: v[:, t] for k, v in whole.items()}, window=5, state=st)
        assert st["attend0_k"].shape[2] == min(4, t + 1)
        torch.testing.assert_close(ot.double(), want[:, t], rtol=1e-5, atol=1e-6)
    # a cache shorter than the tokens it must hold is refused, naming it
    _, st = op(**{k: v[:, :3] for k, v in whole.items()}, window=5, output_final_state=True, mode="torch")
    st = dict(st, pos=st["pos"] + 2)
    with pytest.raises(ArgumentError, match=r"initial_state\['attend0_k'\]: .*it holds 3 past tokens where this "
                                            r"call needs the last 4 of 5"):
        op.step(**{k: v[:, 3] for k, v in whole.items()}, window=5, state=st)


def test_packed_sequences_of_different_lengths_keep_one_window_cache():
    op = mixc.load("swa")
    kw, _ = random_args(op.ir, B=1, T=9, H=2, sizes={"K": 4, "V": 4}, seed=4)
    cu = torch.tensor([0, 2, 9])
    o, st = op(**kw, window=6, cu_seqlens=cu, output_final_state=True, mode="torch")
    assert st["attend0_k"].shape == (2, 2, 5, 4) and st["pos"].tolist() == [2, 7]
    ref, _ = op(**kw, window=6, cu_seqlens=cu, mode="reference")
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)
    # the shorter sequence's cache is zero-padded in front; a step from both equals the reference
    nxt, _ = random_args(op.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4}, seed=5)
    ot, _ = op.step(**{k: v[:, 0] for k, v in nxt.items()}, window=6, state=st)
    for i, (a, b) in enumerate([(0, 2), (2, 9)]):
        seq = {k: torch.cat([kw[k][:, a:b], nxt[k][i:i + 1]], 1) for k in kw}
        want, _ = op(**seq, window=6, mode="reference")
        torch.testing.assert_close(ot[i].double(), want[0, -1], rtol=1e-5, atol=1e-6)

"""prev(x) of inputs at call time (mixc/standalone/shift.py): the shift along T within packed
sequences and its gradient, the state's prev_x entries, and the errors of a call that gets
them wrong (an ArgumentError naming the argument, never a torch error)."""
from __future__ import annotations

import inspect

import pytest
import torch

import mixc
from helpers import random_args, random_state
from mixc.runtime.signature import ArgumentError
from mixc.standalone.shift import last, shift

SIZES = {"N": 3, "P": 2}


@pytest.fixture(scope="module")
def op():
    return mixc.load("mamba3")


def _loop_shift(x, cu, first):
    """Row t holds x_{t-1} of its own sequence; a sequence's first row `first[i]` or 0."""
    y = torch.zeros_like(x)
    segs = [(0, x.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for i, (a, b) in enumerate(segs):
        for t in range(a, b):
            if t > a:
                y[:, t] = x[:, t - 1]
            elif first is not None:
                y[:, t] = first[i] if cu is not None else first
    return y


@pytest.mark.parametrize("given", [False, True], ids=["zeros", "given-first"])
@pytest.mark.parametrize("cu", [None, [0, 3, 3, 4, 9], [0, 0, 9]], ids=["fixed", "packed-empty", "leading-empty"])
def test_shift_and_last_equal_a_loop(cu, given):
    gen = torch.Generator().manual_seed(0)
    B = 2 if cu is None else 1
    x = torch.randn(B, 9, 2, 3, generator=gen, dtype=torch.float64)
    cu = torch.tensor(cu) if cu is not None else None
    n = B if cu is None else len(cu) - 1
    first = torch.randn(n, 2, 3, generator=gen, dtype=torch.float64) if given else None
    assert torch.equal(shift(x, cu, first), _loop_shift(x, cu, first))
    want = x[:, -1] if cu is None else torch.stack(
        [x[0, b - 1] if b > a else (first[i] if given else torch.zeros(2, 3, dtype=torch.float64))
         for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))])
    assert torch.equal(last(x, cu, first), want)


def test_the_shift_gradient_is_the_reverse_shift():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    first = torch.randn(3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 2, 7])
    torch.autograd.gradcheck(lambda a, f: shift(a, cu, f), (x, first))
    torch.autograd.gradcheck(lambda a, f: last(a, cu, f), (x, first))


def test_grouped_heads_carry_their_own_heads(op):
    """B, C shared by two heads ([B, T, 1, N]): prev_B keeps one head; every mode agrees."""
    kw, sizes = random_args(op.ir, B=2, T=20, H=2, sizes=SIZES, seed=2)
    kw["B"], kw["C"] = kw["B"][:, :, :1], kw["C"][:, :, :1]
    ro, rst = op(**kw, mode="reference", output_final_state=True)
    assert rst["prev_B"].shape == (2, 1, 3) and torch.equal(rst["prev_B"], kw["B"][:, -1])
    for mode in ("torch", "chunk"):
        o, st = op(**kw, mode=mode, output_final_state=True, **({"chunk": 16} if mode == "chunk" else {}))
        torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
        for k in rst:
            torch.testing.assert_close(st[k].double(), rst[k], rtol=1e-5, atol=1e-5)


def test_a_step_without_the_entry_starts_a_sequence(op):
    kw, sizes = random_args(op.ir, B=2, T=1, H=2, sizes=SIZES, seed=3)
    o, st = op(**kw, mode="reference", output_final_state=True)
    tok = {k: (v[:, 0] if k not in ("A", "D", "dt_bias") else v) for k, v in kw.items()}
    zero = {"h": torch.zeros(2, 2, 3, 2, dtype=torch.float64)}
    for mode in ("reference", "torch", "recurrent"):
        o1, s1 = op.step(**tok, state=zero, mode=mode)
        torch.testing.assert_close(o1.double(), o[:, 0], rtol=1e-5, atol=1e-6)
        assert set(s1) == {"h", "prev_B", "prev_x"}
        torch.testing.assert_close(s1["prev_x"].double(), kw["x"][:, 0], rtol=1e-7, atol=0)     # fp32 states


def test_the_signature_and_help_show_what_a_caller_passes(op):
    params = inspect.signature(op).parameters
    assert "x" in params and "prev_x" not in params and "prev_B" not in params
    assert "state['prev_x']: [B, H, P]" in op.__doc__


@pytest.mark.parametrize("case", ["passed", "bad-first", "inplace-missing", "bad-offsets", "offsets-past-T"])
def test_errors_name_the_argument(op, case):
    kw, sizes = random_args(op.ir, B=1, T=5, H=2, sizes=SIZES, seed=4)
    st = random_state(op.ir, 1, 2, sizes, dtype=torch.float32)
    if case == "passed":
        with pytest.raises(ArgumentError, match=r"prev_x: computed by the op from input 'x' \(prev\(x\) in the spec\); "
                                                r"the x before the first token comes from initial_state\['prev_x'\]"):
            op(**kw, prev_x=kw["x"])
    elif case == "bad-first":
        st["prev_B"] = torch.zeros(1, 2, 4)
        with pytest.raises(ArgumentError, match=r"initial_state\['prev_B'\]: expected shape \[1, 2, 3\]"):
            op(**kw, initial_state=st)
    elif case == "inplace-missing":
        del st["prev_x"]
        tok = {k: (v[:, 0].float() if k not in ("A", "D", "dt_bias") else v.float()) for k, v in kw.items()}
        with pytest.raises(ArgumentError, match=r"state: missing 'prev_x' .*an in-place step writes this token's x"):
            op.step(**tok, state=st, inplace=True, mode="torch")
    elif case == "bad-offsets":
        with pytest.raises(ArgumentError, match="cu_seqlens: expected a 1-D int32 or int64 tensor"):
            op(**kw, cu_seqlens=torch.tensor([0.0, 5.0]))
    else:
        with pytest.raises(ArgumentError, match="cu_seqlens: must start at 0 and end at T = 5"):
            op(**kw, cu_seqlens=torch.tensor([0, 2, 9]))

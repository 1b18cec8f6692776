"""Bad arguments get an error naming the argument, the expected and the actual shape or dtype."""
import pytest
import torch

import mixc
from mixc.pipeline import from_text
from mixc.runtime.signature import ArgumentError

from helpers import random_args, random_state


@pytest.fixture(scope="module")
def gla():
    return mixc.load("gla")


def _args(op, **kw):
    args, sizes = random_args(op.ir, B=2, T=5, H=3, sizes={"K": 4, "V": 6})
    args.update(kw)
    return args


@pytest.mark.parametrize("change,match", [
    (lambda a: a.pop("q"), r"missing input 'q' of shape \[B, T, H, K\]"),
    (lambda a: a.update(q=a["q"][..., 0]), r"q: expected an input of shape \[B, T, H, K\] \(rank 4\), got shape \[2, 5, 3\]"),
    (lambda a: a.update(k=a["k"][..., :3]), r"k: dim K \(axis 3\) is 3, but q gives K = 4"),
    (lambda a: a.update(v=a["v"][:1]), r"v: dim B \(axis 0\) is 1, but q gives B = 2"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), r"q: expected a floating-point tensor .* got dtype torch.int32"),
    (lambda a: a.update(q=a["q"].tolist()), r"q: expected a tensor of shape \[B, T, H, K\], got list"),
    (lambda a: a.update(kk=a["k"]), r"unexpected argument 'kk' for mixer 'gla'"),
    (lambda a: a.update(scale="big"), r"scale: expected a number, got 'big'"),
], ids=["missing", "rank", "dim", "batch", "dtype", "not-tensor", "extra", "option"])
def test_argument_errors(gla, change, match):
    args = _args(gla)
    change(args)
    with pytest.raises(ArgumentError, match=match):
        gla.reference(**args)


def test_param_and_flag_errors():
    rw = mixc.load("rwkv6")
    args, _ = random_args(rw.ir, B=1, T=3, H=2, sizes={"K": 4, "V": 4})
    args["u"] = args["u"][:1]
    with pytest.raises(ArgumentError, match=r"u: dim H \(axis 0\) is 1, but r gives H = 2"):
        rw.reference(**args)
    dr = mixc.load("delta_rule")
    args, _ = random_args(dr.ir, B=1, T=3, H=2)
    with pytest.raises(ArgumentError, match="use_qk_l2norm_in_kernel: expected True or False, got 1"):
        dr.reference(**args, use_qk_l2norm_in_kernel=1)


def test_state_errors(gla):
    args = _args(gla)
    st = random_state(gla.ir, 2, 3, {"K": 4, "V": 6})
    with pytest.raises(ArgumentError, match=r"initial_state\['S'\]: expected shape \[B=2, H=3, K=4, V=6\], got \[2, 3, 6, 4\]"):
        gla.reference(**args, initial_state={"S": st["S"].transpose(-1, -2)})
    with pytest.raises(ArgumentError, match="initial_state: unknown state 'T'; mixer 'gla' has S"):
        gla.reference(**args, initial_state={"S": st["S"], "T": st["S"]})
    la = mixc.load("linear_attn")
    a2, _ = random_args(la.ir, B=2, T=5, H=3, sizes={"K": 4, "V": 6})
    s2 = random_state(la.ir, 2, 3, {"K": 4, "V": 6})
    with pytest.raises(ArgumentError, match="initial_state: missing state 'z'"):
        la.reference(**a2, initial_state={"S": s2["S"]})
    with pytest.raises(ArgumentError, match="has several states"):
        la.reference(**a2, initial_state=s2["S"])
    # one-state specs also take a bare tensor, as fla does
    o1, _ = gla.reference(**args, initial_state=st["S"])
    o2, _ = gla.reference(**args, initial_state=st)
    torch.testing.assert_close(o1, o2)


@pytest.mark.parametrize("cu,match", [
    ([0, 2, 4], r"must start at 0 and end at T = 5"),
    ([1, 5], r"must start at 0"),
    ([0, 3, 2, 5], r"non-decreasing"),
])
def test_cu_seqlens_errors(gla, cu, match):
    args, _ = random_args(gla.ir, B=1, T=5, H=3)
    with pytest.raises(ArgumentError, match=match):
        gla.reference(**args, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ArgumentError, match="expected a 1-D int32 or int64"):
        gla.reference(**args, cu_seqlens=torch.tensor([0.0, 5.0]))
    args2, _ = random_args(gla.ir, B=2, T=5, H=3)
    with pytest.raises(ArgumentError, match="packed sequences need B = 1"):
        gla.reference(**args2, cu_seqlens=torch.tensor([0, 5]))


def test_dims_alias_must_agree():
    based = mixc.load("based")
    args, _ = random_args(based.ir, B=1, T=3, H=2, sizes={"K": 3, "V": 5})
    o, _ = based.reference(**args)
    assert o.shape == (1, 3, 2, 5)


def test_reference_dtypes_and_grad_flow(gla):
    args, _ = random_args(gla.ir, B=2, T=4, H=2, dtype=torch.float32, requires_grad=True)
    o, st = gla.reference(**args, output_final_state=True)
    assert o.dtype == torch.float64 and st["S"].dtype == torch.float64
    o.sum().backward()
    assert all(a.grad is not None and a.grad.dtype == torch.float32 for a in args.values())


def test_empty_segment_and_zero_length():
    gla = mixc.load("gla")
    args, sizes = random_args(gla.ir, B=1, T=4, H=2)
    st = random_state(gla.ir, 3, 2, sizes)
    o, fin = gla.reference(**args, cu_seqlens=torch.tensor([0, 2, 2, 4]), initial_state=st, output_final_state=True)
    torch.testing.assert_close(fin["S"][1], st["S"][1])       # an empty sequence keeps its state
    assert o.shape[1] == 4


OPTION_SPEC = """mixer m
  dims   K, V
  input  q[K], k[K], v[V]
  option x = {default}
  state  S[K, V]
  update S = S + x * k * v
  output o = q @ S
"""


@pytest.mark.parametrize("default,match", [
    ("(0 - K) ** 0.5", r"option 'x': its default \(0 - K\) \*\* 0.5 is not a real number \(a negative number to a "
                       r"fractional power\) at K = 4; pass x=<a number> or change the default"),
    ("1 / (K - 4)", r"option 'x': its default 1 / \(K - 4\) divides by zero at K = 4"),
    ("2 * K ** (K * 200)", r"its default 2 \* K \*\* \(K \* 200\) has no finite real value at K = 4: "
                          r"K \*\* \(K \* 200\) is too large for a float"),
], ids=["complex", "zero-division", "overflow"])
@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_an_option_default_without_a_finite_value_at_the_bound_dims_is_an_argument_error(default, match, mode):
    """Defaults that read dims are evaluated at the call (the checker cannot): these gave NaN."""
    op = from_text(OPTION_SPEC.format(default=default))
    args = _args(op)
    with pytest.raises(ArgumentError, match=match):
        op(**args, mode=mode)
    o, _ = op(**args, x=0.5, mode=mode)        # a value passed replaces the default
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10 ** 400],
                         ids=["nan", "inf", "-inf", "int-past-float64"])
def test_an_option_passed_must_be_finite(gla, value):
    with pytest.raises(ArgumentError, match=r"scale: expected a finite number, got"):
        gla.reference(**_args(gla), scale=value)


@pytest.mark.parametrize("default,value", [("1000 + 1000", 2000.0), ("0 * (0 - 1)", 0.0), ("2 * 1024", 2048.0),
                                           ("max(K, 2) ** 3 / 8", 8.0), ("sigmoid(0 - 800) + 1", 1.0)])
def test_an_option_default_evaluates_only_its_own_operators(default, value):
    """The evaluator computed every operator at once: `1000 + 1000` raised OverflowError
    (from 1000 ** 1000) and `0 * (0 - 1)` ZeroDivisionError (from 0 ** -1) on every call."""
    from mixc.runtime.signature import bind, option_values
    op = from_text(OPTION_SPEC.format(default=default))
    args = _args(op)
    assert option_values(op.ir, bind(op.ir, args)) == {"x": value}
    o, _ = op.reference(**args)
    assert torch.isfinite(o).all()


def test_a_window_of_two_thousand_tokens_runs():
    """swa with window = 2 * 1024 could not run (2 ** 1024 overflowed while evaluating 2 * 1024)."""
    text = mixc.dsl.read_spec("swa").text.replace("window = 512", "window = 2 * 1024")
    op = from_text(text)
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float64)
    o, _ = op(**args)
    torch.testing.assert_close(o, mixc.load("swa")(**args)[0])       # 2048 and 512 both cover 6 tokens

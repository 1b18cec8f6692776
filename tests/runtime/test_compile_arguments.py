"""torch.compile(fullgraph=True) with the arguments round three found failing (issue 30):
packed offsets, dynamic shapes, a number option given as a tensor, op.step(inplace=True).
Each either traces and equals eager (forward and gradients) or is refused with mixc's message
naming the argument (dynamo carries it as the cause of its Unsupported error)."""
from __future__ import annotations

import warnings

import pytest
import torch

import mixc
from helpers import random_args
from mixc.standalone.errors import ArgumentError

B, T, H, K = 1, 12, 2, 4


@pytest.fixture(scope="module")
def gla():
    return mixc.load("gla")


def _args(op, seed=0):
    args, _ = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": K}, dtype=torch.float32, seed=seed)
    return args


def _compiled(f, **kw):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.compile(f, fullgraph=True, backend="aot_eager", **kw)


def _grads_equal(f, args):
    leaves = {n: x.detach().requires_grad_(True) for n, x in args.items()}
    got = _compiled(f)(leaves)
    dgot = torch.autograd.grad(got, list(leaves.values()))
    ref = f(leaves)
    dref = torch.autograd.grad(ref, list(leaves.values()))
    torch.testing.assert_close(got, ref)
    for n, a, b in zip(leaves, dgot, dref):
        torch.testing.assert_close(a, b, msg=lambda m: f"d{n}: {m}")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_offsets_trace_in_the_kernel_modes(gla, mode):
    """The offsets' values are checked inside the kernels' custom op (bind checks their kind while
    tracing): the compiled call equals eager in the output, final state and every gradient."""
    cu = torch.tensor([0, 5, 12])

    def f(a):
        o, st = gla(**a, cu_seqlens=cu, output_final_state=True, mode=mode)
        return o.square().sum() + st["S"].sum()
    _grads_equal(f, _args(gla))


def test_bad_packed_offsets_are_refused_when_the_compiled_graph_runs(gla):
    args = _args(gla)
    f = _compiled(lambda a, cu: gla(**a, cu_seqlens=cu, mode="chunk")[0])
    with pytest.raises(ArgumentError, match=r"cu_seqlens: offsets must be non-decreasing, got 7 then 5"):
        f(args, torch.tensor([0, 7, 5, 12]))


def test_packed_offsets_in_a_torch_mode_are_refused_by_name(gla):
    args = _args(gla)
    with pytest.raises(Exception, match=r"cu_seqlens: mode 'torch' splits the packed sequences"):
        _compiled(lambda a: gla(**a, cu_seqlens=torch.tensor([0, 5, 12]), mode="torch")[0])(args)


@pytest.mark.parametrize("mode", ["torch", "chunk"])
def test_dynamic_shapes(gla, mode):
    """dynamic=True: the option default K ** -0.5 is evaluated on a symbolic K (comparisons, not
    math.isnan: dsl/scalar.py); two lengths, one compiled function."""
    f = _compiled(lambda a: gla(**a, mode=mode)[0], dynamic=True)
    for seed, t in ((0, T), (1, T - 3)):
        args = {n: x[:, :t] for n, x in _args(gla, seed).items()}
        torch.testing.assert_close(f(args), gla(**args, mode=mode)[0])


def test_a_number_option_as_a_tensor_is_refused_by_name(gla):
    args = _args(gla)
    with pytest.raises(Exception, match=r"scale: a tensor under torch.compile"):
        _compiled(lambda a, s: gla(**a, scale=s, mode="torch")[0])(args, torch.tensor(0.3))


@pytest.mark.parametrize("mode", ["torch", "recurrent"])
def test_step_in_place_traces(gla, mode):
    """op.step(inplace=True): while tracing, the functional step and index_copy_ into the buffers
    (the in-place launch loaded the module under a lock, which dynamo refused)."""
    tok = {n: x[:, 0] for n, x in _args(gla).items()}
    S0 = torch.randn(B, H, K, K, generator=torch.Generator().manual_seed(3))

    def f(t, S):
        o, st = gla.step(**t, state={"S": S}, inplace=True, mode=mode)
        return o
    S_c, S_e = S0.clone(), S0.clone()
    o_c = _compiled(f)(tok, S_c)
    o_e = f(tok, S_e)
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(S_c, S_e)
    assert not torch.equal(S_c, S0)

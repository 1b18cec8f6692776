"""The torch backend without autograd keeps its groups' intermediates in buffers reused across
calls (classes/torch_ops.py Arena): nothing returned may alias them, they must not grow with
the shapes seen, and nothing under autograd may use them. And the scalar class's factors taken
without exp(-inf) (pair_factors) or as row and column factors (row_col_factors)."""
from __future__ import annotations

import threading

import pytest
import torch

import mixc
from mixc.classes import torch_ops
from mixc.runtime import torch_chunk
from mixc.runtime.inputs import random_args

SPECS = ["simple_gla", "gated_delta_rule", "linear_attn", "delta_rule", "rwkv6", "gla", "retention"]


def _args(op, T, seed, H=2, D=16, grad=False):
    args, _ = random_args(op.ir, B=1, T=T, H=H, sizes={"K": D, "V": D}, dtype=torch.float32, seed=seed,
                          bounded=True)
    if grad:
        for x in args.values():
            x.requires_grad_(True)
    return args


def _arena_buffers():
    return [b for a in torch_ops._ARENAS.__dict__.get("by_key", {}).values() for b in a.bufs if b is not None]


def _shares_arena(t):
    ptrs = {b.untyped_storage().data_ptr() for b in _arena_buffers()}
    return t.untyped_storage().data_ptr() in ptrs


def _run(op, args, **kw):
    with torch.no_grad():
        return op(**args, mode="torch", output_final_state=True, **kw)


@pytest.mark.parametrize("groups", ["one", "several"])
@pytest.mark.parametrize("name", SPECS)
def test_two_calls_outputs_are_independent(name, groups, monkeypatch):
    """A second call (other inputs, same shapes) leaves the first call's output and final
    states as they were, returns what a call without the arena returns (bit for bit), and
    nothing it returns shares storage with the arena."""
    if groups == "several":             # ~3 chunks a group: the state carried between groups
        monkeypatch.setattr(torch_chunk, "GROUP_ELEMENTS", 3 * 2 * 64 * 64)
    op = mixc.load(name)
    a1, a2 = _args(op, 640, 1), _args(op, 640, 2)
    o1, f1 = _run(op, a1)
    keep_o, keep_f = o1.clone(), {k: v.clone() for k, v in f1.items()}
    o2, f2 = _run(op, a2)
    assert _arena_buffers(), "the no-grad call took nothing from the arena"
    assert torch.equal(o1, keep_o)
    for k in f1:
        assert torch.equal(f1[k], keep_f[k])
    for t in [o1, o2, *f1.values(), *f2.values()]:
        assert not _shares_arena(t)
    monkeypatch.setattr(torch_chunk, "arena", lambda like: None)
    o3, f3 = _run(op, a2)
    assert torch.equal(o2, o3)
    for k in f2:
        assert torch.equal(f2[k], f3[k])


def test_the_arena_does_not_grow_with_the_shapes_seen():
    """Shapes seen twice over add nothing the second time; the arena stays within its bound."""
    torch_ops.free_arenas()
    op = mixc.load("simple_gla")
    shapes = [(64, 2, 16), (1024, 4, 64), (4096, 4, 64), (512, 8, 32), (2048, 1, 128)]

    def kept():
        return sum(b.numel() for b in _arena_buffers())
    for T, H, D in shapes:
        _run(op, _args(op, T, 0, H=H, D=D))
    first = kept()
    for T, H, D in shapes + shapes[::-1]:
        _run(op, _args(op, T, 0, H=H, D=D))
        assert kept() == first
    assert first <= torch_ops.ARENA_TOTAL
    assert all(b.numel() <= max(torch_ops.ARENA_ELEMENTS, torch_ops.ARENA_MIN) for b in _arena_buffers())


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule", "rwkv6"])
def test_nothing_under_autograd_takes_from_the_arena(name, monkeypatch):
    """With inputs that require grad, no arena is asked for (a take is overwritten by the next
    call, so the graph must save none), and the gradients are those of a no-arena run."""
    op = mixc.load(name)
    asked = []
    real = torch_chunk.arena
    monkeypatch.setattr(torch_chunk, "arena", lambda like: asked.append(1) or real(like))
    args = _args(op, 256, 3, grad=True)
    o, _ = op(**args, mode="torch")
    assert not asked
    _run(op, _args(op, 256, 4))                     # a no-grad call between: its arena is used
    assert asked
    o.square().sum().backward()
    grads = {k: v.grad.clone() for k, v in args.items()}
    args2 = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
    op(**args2, mode="torch")[0].square().sum().backward()
    for k in grads:
        assert torch.equal(grads[k], args2[k].grad), k


def test_threads_have_their_own_arena():
    """Two threads calling at once get what one thread gets."""
    op = mixc.load("simple_gla")
    inputs = [_args(op, 1024, s, H=4, D=32) for s in range(2)]
    want = [_run(op, a)[0] for a in inputs]
    got = [[], []]
    errors = []

    def work(i):
        try:
            for _ in range(6):
                got[i].append(_run(op, inputs[i])[0])
        except Exception as err:            # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        for o in got[i]:
            assert torch.equal(o, want[i])


def test_inference_mode_and_no_grad_alternate():
    """Inference tensors cannot be written outside inference mode: one arena per mode."""
    op = mixc.load("simple_gla")
    args = _args(op, 256, 5)
    want = _run(op, args)[0]
    with torch.inference_mode():
        a = op(**args, mode="torch")[0]
    b = _run(op, args)[0]
    with torch.inference_mode():
        c = op(**args, mode="torch")[0]
    for o in (a, b, c):
        assert torch.equal(o, want)


def test_an_arena_in_use_is_not_handed_out_twice(monkeypatch):
    """A call inside a call gets no arena (None: fresh tensors); a call that raised gives its
    arena back."""
    x = torch.zeros(3)
    a = torch_ops.arena(x)
    assert a is not None and torch_ops.arena(x) is None
    torch_ops.release_arena(a)
    assert torch_ops.arena(x) is a
    torch_ops.release_arena(a)

    op = mixc.load("simple_gla")
    args = _args(op, 256, 6)
    real = torch_chunk._readout_part

    def fail(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(torch_chunk, "_readout_part", fail)
    with pytest.raises(RuntimeError, match="boom"):
        _run(op, args)
    monkeypatch.setattr(torch_chunk, "_readout_part", real)
    b = torch_ops.arena(x)
    assert b is a
    torch_ops.release_arena(b)


def test_a_warm_no_grad_call_allocates_little():
    """simple_gla at T = 1K (B = 1, H = 4, d = 64): a warm call without autograd allocates its
    output, the scaled query (the generated pieces) and small tensors; its [C, C] products,
    scaled keys, chunk updates and walk come from the arena. Fresh each call they were ~10x
    the output, each a page fault per 4 KB once glibc had returned them to the OS."""
    from torch.profiler import ProfilerActivity, profile
    op = mixc.load("simple_gla")
    args = _args(op, 1024, 7, H=4, D=64)
    _run(op, args)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        o = _run(op, args)[0]
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated <= 5 * o.numel() * o.element_size(), allocated / (o.numel() * o.element_size())


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("prev", [False, True])
def test_pair_factors_equal_the_exp_of_the_masked_pair_logs(prev, axis):
    """pair_factors (exp of the unmasked sums, then the causal 0 / 1) equals exp(pair_logs)
    bit for bit, with resets (-inf) and NaN in g, and so do its gradients."""
    gen = torch.Generator().manual_seed(11)
    shape = (2, 3, 16) if axis == -1 else (2, 3, 16, 5)
    g = -torch.rand(shape, generator=gen) * 4
    g[0, 1, 5] = float("-inf")
    g[1, 2, 9] = float("nan")
    g[1, 0, 0] = float("-inf")
    want = torch_ops.pair_logs(g, prev, axis).exp()
    got = torch_ops.pair_factors(g, prev, axis)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.equal(want.nan_to_num(), got.nan_to_num())
    gf = (-torch.rand(shape, generator=gen, dtype=torch.float64) * 4)
    w = torch.rand(want.shape, generator=gen, dtype=torch.float64)
    g1, g2 = gf.clone().requires_grad_(True), gf.clone().requires_grad_(True)
    (torch_ops.pair_logs(g1, prev, axis).exp() * w).sum().backward()
    (torch_ops.pair_factors(g2, prev, axis) * w).sum().backward()
    assert torch.equal(g1.grad, g2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_col_factors_equal_the_pair_sums(dtype):
    """u_i v_j is the per-pair factor to a few ulp of itself, also for neighbours beside a
    large cumulative decay; out of range (strong decay, a reset, NaN) it declines."""
    gen = torch.Generator().manual_seed(12)
    g = -torch.rand(3, 4, 64, generator=gen, dtype=torch.float64) * 1.2
    g[1, 2, :] = -1.2                   # cumulative -77 over the chunk: about its middle, +-39
    g = g.to(dtype)
    u, uq, v, R = torch_ops.row_col_factors(g)
    eps = torch.finfo(dtype).eps
    b = g.double().cumsum(-1)                           # u R = exp(b) and, shifted, exp(b_{i-1})
    torch.testing.assert_close((u * R).double(), b.exp(), rtol=8 * eps * (1 + float(b.abs().max())), atol=0)
    torch.testing.assert_close((uq[..., 1:] * R).double(), b[..., :-1].exp(),
                               rtol=8 * eps * (1 + float(b.abs().max())), atol=0)
    for prev, rows in ((False, u), (True, uq)):
        want = torch_ops.pair_logs(g.double(), prev, -1).exp()
        got = (rows.unsqueeze(-1) * v.unsqueeze(-2)).double().tril(-int(prev))
        live = want > 0
        assert torch.equal(got[~live], want[~live])
        rel = ((got - want).abs() / want)[live]
        # the pair's own sum in this dtype is good to ~|log| eps; the factors add a few eps
        bound = 8 * eps * (1 + torch_ops.pair_logs(g.double(), prev, -1).abs()[live])
        assert (rel <= bound).all(), float((rel / bound).max())
    for bad in (float("-inf"), float("nan"), -50.0):
        h = g.clone()
        h[0, 0, 3] = bad
        assert torch_ops.row_col_factors(h) is None


@pytest.mark.parametrize("scale", [0.2, 3.0])
def test_scalar_forward_against_float64(scale):
    """simple_gla without autograd (row and column factors at mild decay, the sub-chunk
    factors at strong decay) against the float64 reference."""
    op = mixc.load("simple_gla")
    args = _args(op, 512, 9, H=2, D=32)
    args["g"] = args["g"] * scale
    got = _run(op, args)[0].double()
    want = op(**{k: v.double() for k, v in args.items()}, mode="reference")[0]
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()

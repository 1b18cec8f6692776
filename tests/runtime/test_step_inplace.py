"""Decode for serving (issue 17 item 2): op.step(..., inplace=True) updates the given state
buffers in place, and with state_indices the state is a cache of slots [N_slots, H, ...] (fla's
and vLLM's ssm_state_indices). Checked on the CPU: equal to the functional step and the float64
reference, slots not named untouched, the buffers' storage kept, and a dry run for CUDA-graph
safety (no host read of a tensor, the same ops on the same shapes at every call)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixc
from mixc.runtime.signature import ArgumentError

from helpers import case_id, random_args, random_state

# gla: tile V, split K; linear_attn with V = 40: two tiles of V and a normalizer z[K] without V
# (every tile reads and writes z whole: the launch keeps one tile block in place); mlstm: a
# stabilized spec (the kernel keeps S exp(-m)), computed functionally and copied into the slots
CASES = [("gla", {"K": 8, "V": 6}), ("linear_attn", {"K": 4, "V": 40}), ("mlstm", {"K": 4, "V": 6})]
B, H, SLOTS = 3, 2, 6


def _token(op, sizes, seed):
    args, sizes = random_args(op.ir, B=B, T=1, H=H, sizes=sizes, dtype=torch.float32, seed=seed)
    names = {d.name for d in op.ir.inputs}
    return {k: (v[:, 0] if k in names else v) for k, v in args.items()}, sizes


def _cache(op, sizes, seed=1):
    return {k: v.float() for k, v in random_state(op.ir, SLOTS, H, sizes, seed=seed).items()}


@pytest.mark.parametrize("mode", ["recurrent", "torch"])
@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{case_id(B=B, H=H, **s)}" for n, s in CASES])
def test_step_into_cache_slots_equals_the_functional_step(name, sizes, mode):
    op = mixc.load(name)
    idx = torch.tensor([4, 0, 2])
    cache = _cache(op, sizes)
    before = {k: v.clone() for k, v in cache.items()}
    ptrs = {k: v.data_ptr() for k, v in cache.items()}
    for seed in (5, 6):             # two steps: the second reads what the first wrote
        one, sizes = _token(op, sizes, seed)
        rows = {k: v[idx].clone() for k, v in cache.items()}
        want_o, want_st = op.step(**one, state=rows, mode=mode)
        ref_o, ref_st = op.reference_step(**one, state=rows)
        o, st = op.step(**one, state=cache, state_indices=idx, inplace=True, mode=mode)
        assert st is cache and {k: v.data_ptr() for k, v in cache.items()} == ptrs
        torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o.double(), ref_o, rtol=1e-4, atol=1e-5)
        for k in cache:
            torch.testing.assert_close(cache[k][idx], want_st[k], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(cache[k][idx].double(), ref_st[k], rtol=1e-4, atol=1e-5)
    for k in cache:                  # slots 1, 3, 5 were never named: untouched, bit for bit
        assert torch.equal(cache[k][[1, 3, 5]], before[k][[1, 3, 5]])


@pytest.mark.parametrize("name,sizes", CASES[:2], ids=[f"{n}-{case_id(B=B, H=H, **s)}" for n, s in CASES[:2]])
def test_step_inplace_without_slots_updates_the_given_state(name, sizes):
    op = mixc.load(name)
    one, sizes = _token(op, sizes, 7)
    state = {k: v[:B].clone() for k, v in _cache(op, sizes).items()}
    want_o, want_st = op.step(**one, state={k: v.clone() for k, v in state.items()})
    o, st = op.step(**one, state=state, inplace=True)
    assert st is state
    torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], want_st[k], rtol=1e-6, atol=1e-6)


class _Trace(TorchDispatchMode):
    """Every aten op of a call with its output shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.ops.append((str(func), [tuple(x.shape) for x in outs if isinstance(x, torch.Tensor)]))
        return out


def _no_host_reads(monkeypatch):
    def refuse(what):
        def f(*a, **k):
            raise AssertionError(f"{what} on the decode path: a host sync that CUDA-graph capture refuses")
        return f
    for attr in ("item", "tolist", "cpu", "nonzero", "__bool__"):
        monkeypatch.setattr(torch.Tensor, attr, refuse(f"Tensor.{attr}"))
    monkeypatch.setattr(torch, "nonzero", refuse("torch.nonzero"))


@pytest.mark.parametrize("name,mode", [("gla", "recurrent"), ("mlstm", "torch")])
def test_step_inplace_is_graph_safe_dry_run(name, mode, monkeypatch):
    """What a CUDA graph needs, checked without CUDA: no tensor read on the host, and the same
    ops with the same shapes (so the same allocations) whatever the slots and the values."""
    op = mixc.load(name)
    sizes = dict(CASES[[n for n, _ in CASES].index(name)][1])
    cache = _cache(op, sizes)
    traces = []
    for seed, idx in ((8, [4, 0, 2]), (9, [1, 5, 3])):
        one, _ = _token(op, sizes, seed)
        idx = torch.tensor(idx)
        op.step(**one, state=cache, state_indices=idx, inplace=True, mode=mode)   # warm: derive, compile
        with monkeypatch.context() as m:
            _no_host_reads(m)
            with _Trace() as t:
                op.step(**one, state=cache, state_indices=idx, inplace=True, mode=mode)
        traces.append(t.ops)
        assert not [f for f, _ in t.ops if "_local_scalar_dense" in f or "nonzero" in f]
    assert traces[0] == traces[1]


@pytest.mark.parametrize("change,message", [
    (lambda c, i: ({k: v.double() for k, v in c.items()}, i), "float32"),
    (lambda c, i: ({k: v[:, :1].contiguous() for k, v in c.items()}, i), "expected shape"),
    (lambda c, i: ({k: v[:, :, ::2] for k, v in c.items()}, i), "expected shape"),
    (lambda c, i: (c, torch.tensor([4, 0, 6])), "slots must be in [0, 6)"),
    (lambda c, i: (c, torch.tensor([4, 0, 4])), "same slot"),
    (lambda c, i: (c, torch.tensor([4.0, 0.0, 2.0])), "int32 or int64"),
    (lambda c, i: (c, torch.tensor([4, 0])), "expected shape [B=3]"),
], ids=["float64-state", "one-head-state", "strided-slice", "out-of-range", "duplicate", "float-indices", "short"])
def test_step_inplace_bad_arguments_name_the_problem(change, message):
    op = mixc.load("gla")
    one, sizes = _token(op, {"K": 4, "V": 4}, 10)
    cache, idx = change(_cache(op, sizes), torch.tensor([4, 0, 2]))
    with pytest.raises(ArgumentError, match=r"state|state_indices") as err:
        op.step(**one, state=cache, state_indices=idx, inplace=True)
    assert message in str(err.value)


def test_step_inplace_noncontiguous_buffer_is_refused():
    op = mixc.load("gla")
    one, sizes = _token(op, {"K": 4, "V": 4}, 11)
    cache = {k: v.transpose(-1, -2).contiguous().transpose(-1, -2) for k, v in _cache(op, sizes).items()}
    with pytest.raises(ArgumentError, match="contiguous"):
        op.step(**one, state=cache, state_indices=torch.tensor([4, 0, 2]), inplace=True)
    with pytest.raises(ArgumentError, match="inplace=True"):
        op.step(**one, state={k: v[:B] for k, v in _cache(op, sizes).items()}, state_indices=torch.tensor([0, 1, 2]))

"""The torch backend over all chunks at once (mixc/runtime/torch_chunk.py, torch_forward_batched): packed sequences
through the padded chunk layout, the key class's sub-chunk products (mixc/classes/torch_ops.py)
against the per-pair sums, and the promise that only the state walk is sequential (a few ops
per chunk)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixc
from mixc.classes import torch_ops
from mixc.runtime import torch_chunk as tc

from helpers import random_args, random_state

# one spec per class of the walk: key (sub-chunks), rank-1, value, prefix (two states), scalar
VARLEN = ["gla", "gated_delta_rule", "hgrn", "linear_attn", "simple_gla"]


@pytest.mark.parametrize("name", VARLEN)
def test_packed_sequences_match_the_reference(name, monkeypatch):
    """cu_seqlens with an empty sequence, one shorter than a chunk and one over three chunks,
    initial states in and final states out: output, final states and every gradient. In
    groups of 2 chunks (B' H C max(C, dims) = 512 elements a chunk): sequences reset inside a
    group and the state (and its gradient) is carried across groups."""
    monkeypatch.setattr(tc, "GRAD_GROUP_ELEMENTS", 1024)
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=1, T=37, H=2, sizes={d.name: 5 for d in op.ir.dims if not d.alias_of},
                              dtype=torch.float64, requires_grad=True, seed=5)
    st = random_state(op.ir, 4, 2, sizes, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 37])
    leaves = list(args.values()) + list(st.values())
    st3 = {k: v[:3] for k, v in st.items()}
    o, fin = op(**args, initial_state=st3, cu_seqlens=cu, output_final_state=True, mode="torch", chunk=16)
    ro, rfin = op(**args, initial_state=st3, cu_seqlens=cu, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-9)
    for k in rfin:
        torch.testing.assert_close(fin[k].double(), rfin[k], rtol=1e-6, atol=1e-6)
    w = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g = torch.autograd.grad((o * w).sum() + sum((f.double() * 0.5).sum() for f in fin.values()), leaves,
                            allow_unused=True)
    rg = torch.autograd.grad((ro * w).sum() + sum((f * 0.5).sum() for f in rfin.values()), leaves, allow_unused=True)
    for a, b in zip(g, rg):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("packed", [False, True], ids=["B2-T70", "B1-T37-cu"])
@pytest.mark.parametrize("name", VARLEN + ["delta_rule"])
def test_without_autograd_matches_the_reference(name, packed, monkeypatch):
    """Without an autograd graph the forward updates its intermediates in place, runs one
    matmul per head on the chunk layout's views and writes the walk into one buffer, in groups
    of chunks (B2: 2 per group, the state carried between groups; packed: one group of 4, the
    sequences resetting inside it): output and final states against float64."""
    monkeypatch.setattr(tc, "GROUP_ELEMENTS", 2048)         # per chunk: B' H C max(C, dims) = 512 B'
    op = mixc.load(name)
    B, T, cu = (1, 37, torch.tensor([0, 3, 3, 37])) if packed else (2, 70, None)
    args, sizes = random_args(op.ir, B=B, T=T, H=2, sizes={d.name: 5 for d in op.ir.dims if not d.alias_of},
                              dtype=torch.float64, seed=9)
    st = random_state(op.ir, 3 if packed else B, 2, sizes)
    with torch.no_grad():
        o, fin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="torch", chunk=16)
    ro, rfin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-9)
    for k in rfin:
        torch.testing.assert_close(fin[k].double(), rfin[k], rtol=1e-6, atol=1e-6)      # states come back fp32


def _pairwise(X, Y, g, prev):
    """sum_k X_ik Y_jk exp(sum_{j < s <= i - prev} g_sk), the definition, in float64 loops."""
    C = X.shape[-2]
    A = torch.zeros(X.shape[:-2] + (C, C), dtype=torch.float64)
    for i in range(C):
        for j in range(i + 1 - int(prev)):
            A[..., i, j] = (X[..., i, :] * Y[..., j, :] * g[..., j + 1:i + 1 - int(prev), :].sum(-2).exp()).sum(-1)
    return A


@pytest.mark.parametrize("prev", [False, True], ids=["S_t", "S_t-1"])
def test_key_sub_chunks_equal_the_pair_sums(prev):
    """Across sub-chunks the products are factored; a decay of 0 (log -inf) must still reset
    (no NaN) and a strong decay keep each neighbour's exp(g) to rounding."""
    gen = torch.Generator().manual_seed(7)
    X, Y = (torch.randn(2, 3, 32, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -torch.rand(2, 3, 32, 4, generator=gen, dtype=torch.float64) * 3
    g[0, 1, 11, 2] = float("-inf")                 # a reset inside a sub-chunk
    g[1, 2, 16, :] = float("-inf")                 # at a sub-chunk's first token
    g[1, 0] = -20.0 - torch.rand(32, 4, generator=gen, dtype=torch.float64)
    got = torch_ops.key_product(X, Y, g, prev)
    want = _pairwise(X, Y, g, prev)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-300)


@pytest.mark.parametrize("prev", [False, True], ids=["S_t", "S_t-1"])
def test_scalar_sub_chunk_factors_equal_the_pair_sums(prev):
    """The scalar class's factors without autograd (sub-chunks, factored across them) against
    the per-pair sums: a reset inside and at the start of a sub-chunk, strong decay."""
    gen = torch.Generator().manual_seed(8)
    g = -torch.rand(2, 3, 32, generator=gen, dtype=torch.float64) * 3
    g[0, 1, 11] = float("-inf")
    g[1, 2, 16] = float("-inf")
    g[1, 0] = -20.0 - torch.rand(32, generator=gen, dtype=torch.float64)
    got = torch_ops.scalar_factors(g, prev)
    one = torch.ones(2, 3, 32, 1, dtype=torch.float64)
    want = _pairwise(one, one, g.unsqueeze(-1), prev)                   # X = Y = 1: the factors alone
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-300)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["simple_gla", "gla", "gated_delta_rule", "linear_attn"])
def test_only_the_state_walk_grows_with_the_chunks(name):
    """The forward's op count grows by at most 3 per added chunk (the walk's addcmul, and
    for rank-1 two baddbmm: every product over the chunks is batched). The per-chunk loop
    this replaced ran ~166 ops per chunk, 2-3x the time of fla's naive chunked reference."""
    op = mixc.load(name)

    def ops(T):
        args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=1)
        with _CountOps() as c:
            op(**args, mode="torch", chunk=16)
        return c.n
    ops(16)             # warm: the [C, C] masks kept per chunk size (torch_ops._pair_masks)
    per_chunk = (ops(16 * 12) - ops(16 * 4)) / 8
    assert per_chunk <= 3, per_chunk


def test_bench_fla_column_without_fla(monkeypatch):
    """`mixc bench`'s fla column says why it is empty when fla is not importable."""
    from mixc import bench_fla
    monkeypatch.setattr(bench_fla, "FLA_NAIVE", {"simple_gla": ("no_such_module_fla", "f")})
    res = bench_fla.side_by_side([64], threads=None)
    assert res["rows"] == [] and res["fla"].startswith("fla not importable: ModuleNotFoundError")
    assert bench_fla.fla_table(res).startswith("fla column: fla not importable")


@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", "kda"])
def test_scaled_key_rank1_form_equals_the_general_one(name, monkeypatch):
    """A rank-1 left that is a scaled key (the delta rules' -beta k, -a beta k; kda's with a
    decay per key) comes as its scale (torch_pieces' "Lc") and the batched form solves for the
    corrected values: the same output, final states and gradients as the general WY form (Lc
    withheld), with and without autograd, across groups of chunks, and causal under a NaN."""
    from mixc.runtime.cache import load_module
    monkeypatch.setattr(tc, "GROUP_ELEMENTS", 2048)
    monkeypatch.setattr(tc, "GRAD_GROUP_ELEMENTS", 2048)
    op = mixc.load(name)
    mod = load_module(op.plan())
    general = mod.torch_pieces
    args, sizes = random_args(op.ir, B=2, T=70, H=2, sizes={d.name: 5 for d in op.ir.dims if not d.alias_of},
                              dtype=torch.float64, requires_grad=True, seed=3)
    assert list(general(args, {}, {"scale": 0.5}, sizes, 2, 70, 2)["Lc"]) == ["S"]
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    leaves = list(args.values()) + list(st.values())

    def run(scaled, grad):
        if not scaled:
            monkeypatch.setattr(mod, "torch_pieces", lambda *a: {**general(*a), "Lc": {}})
        with torch.set_grad_enabled(grad):
            o, fin = op(**args, initial_state=st, output_final_state=True, mode="torch", chunk=16)
        monkeypatch.setattr(mod, "torch_pieces", general)
        if not grad:
            return [o, *fin.values()]
        return [o, *fin.values(), *torch.autograd.grad(o.sum() + sum(f.sum() for f in fin.values()), leaves)]
    for grad in (False, True):
        for a, b in zip(run(True, grad), run(False, grad)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        args["k"][1, 40, 1, 0] = float("nan")
    o = run(True, False)[0]
    assert torch.isfinite(o[:, :40]).all() and torch.isfinite(o[0]).all() and torch.isnan(o[1, 40:, 1]).all()

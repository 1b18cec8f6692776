"""Worker functions for the multi-process tests (torch.multiprocessing.spawn pickles them by
name, so they live in a module of their own). Each worker joins a gloo group, draws the same
inputs as every other rank (same seed), runs the op on the whole sequence itself (the
single-process result) and on its shard with cp_group, and compares forward and every
gradient. An assertion in any rank fails the spawning test."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def init(rank: int, world: int, store: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def shard_bounds(T: int, world: int, rank: int, lengths=None) -> tuple[int, int]:
    """Contiguous shards; `lengths` gives uneven ones."""
    if lengths is None:
        base = T // world
        lengths = [base + (1 if r < T % world else 0) for r in range(world)]
    start = sum(lengths[:rank])
    return start, start + lengths[rank]


def check_cp(rank, world, name, mode, dtype, T, sizes, cu_seqlens=None, lengths=None, tol=1e-5, seed=0):
    import mixc
    from helpers import random_args, random_state

    op = mixc.load(name)
    B = 1 if cu_seqlens is not None else 2
    H = 2
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=sizes, dtype=dtype, seed=seed)
    n_seqs = B if cu_seqlens is None else len(cu_seqlens) - 1
    init_state = random_state(op.ir, n_seqs, H, sizes)
    cu = torch.tensor(cu_seqlens) if cu_seqlens is not None else None
    inputs = {d.name for d in op.ir.inputs}

    # the whole sequence in one process
    full = {k: v.clone().requires_grad_() for k, v in args.items()}
    full_init = {k: v.clone().requires_grad_() for k, v in init_state.items()}
    o, st = op(**full, initial_state=full_init, output_final_state=True, cu_seqlens=cu, mode=mode)
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    (o.double() * w).sum().backward()

    # this rank's shard
    a, b = shard_bounds(T, world, rank, lengths)
    mine = {k: (v[:, a:b] if k in inputs else v).clone().requires_grad_() for k, v in args.items()}
    my_init = {k: v.clone().requires_grad_() for k, v in init_state.items()}
    o_cp, st_cp = op(**mine, initial_state=my_init if rank == 0 or cu is not None else None,
                     output_final_state=True, cu_seqlens=cu, mode=mode, cp_group=dist.group.WORLD)
    scale = o.detach().abs().max().item()
    err = (o_cp.detach().double() - o.detach()[:, a:b].double()).abs().max().item()
    assert err <= tol * scale, f"{name} rank {rank}: output error {err:.3g} (scale {scale:.3g})"
    if cu is None and rank == world - 1:
        for k in st:
            torch.testing.assert_close(st_cp[k].double(), st[k].detach().double(), rtol=tol, atol=tol * scale)
    (o_cp.double() * w[:, a:b]).sum().backward()

    for k, x in mine.items():
        got = x.grad.double()
        want = full[k].grad.double()
        if k in inputs:
            want = want[:, a:b]
        else:                            # a param's gradient: the sum of the ranks' parts
            dist.all_reduce(got)
        gscale = want.abs().max().item() + 1e-30
        gerr = (got - want).abs().max().item()
        assert gerr <= tol * max(gscale, 1.0), f"{name} rank {rank}: d{k} error {gerr:.3g} (scale {gscale:.3g})"
    for k, x in my_init.items():
        got = x.grad.double() if x.grad is not None else torch.zeros_like(x, dtype=torch.float64)
        if cu is not None:               # every rank may start sequences: sum the parts
            dist.all_reduce(got)
        want = full_init[k].grad
        want = want.double() if want is not None else torch.zeros_like(got)     # a state the output never reads
        if cu is None and rank != 0:
            continue
        gerr = (got - want).abs().max().item()
        assert gerr <= tol * max(want.abs().max().item(), 1.0), f"{name} rank {rank}: d init {k} error {gerr:.3g}"


def cp_cases(rank: int, world: int, store: str, cases: list) -> None:
    init(rank, world, store)
    try:
        for case in cases:
            check_cp(rank, world, **case)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def layer_cp(rank: int, world: int, store: str, names: list, lengths: list) -> None:
    """MixerLayer(cp_group=...) on shards of `lengths` tokens (short conv across the shard
    boundaries, the op's state carried over) against the layer on the whole sequence: the
    output, the input's gradient and every param's gradient summed over the ranks; and a shard
    shorter than conv_size - 1 is refused on every rank alike."""
    import pytest

    from mixc.nn import MixerLayer
    init(rank, world, store)
    try:
        for name in names:
            torch.manual_seed(0)
            layer = MixerLayer(name, d_model=16, n_heads=2, mode="torch").double()
            T = sum(lengths)
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(2, T, 16, dtype=torch.float64, generator=gen)
            w = torch.randn(2, T, 16, dtype=torch.float64, generator=gen)
            whole = x.clone().requires_grad_(True)
            y_want, _ = layer(whole)
            (y_want * w).sum().backward()
            want = {n: p.grad.clone() for n, p in layer.named_parameters()}
            layer.zero_grad()
            start, end = shard_bounds(T, world, rank, lengths)
            part = x[:, start:end].clone().requires_grad_(True)
            y, _ = layer(part, cp_group=dist.group.WORLD)
            # states travel between ranks in fp32 (the op's state dtype): agreement ~1e-8, not 1e-12
            err = (y - y_want[:, start:end]).abs().max().item()
            assert err < 1e-6, f"{name} rank {rank}: output error {err:.3g}"
            (y * w[:, start:end]).sum().backward()
            gerr = (part.grad - whole.grad[:, start:end]).abs().max().item()
            assert gerr < 1e-6, f"{name} rank {rank}: dx error {gerr:.3g}"
            for n, p in layer.named_parameters():
                g = p.grad.clone()
                dist.all_reduce(g)
                perr = (g - want[n]).abs().max().item()
                assert perr < 1e-6 * max(want[n].abs().max().item(), 1.0), f"{name} rank {rank}: d{n} error {perr:.3g}"
            dist.barrier()
        short = [2] + [5] * (world - 1)                 # rank 0 holds 2 tokens: conv_size 4 needs 3
        start, end = shard_bounds(sum(short), world, rank, short)
        with pytest.raises(ValueError, match="rank 0's shard has 2 tokens; the short conv"):
            layer(torch.randn(1, end - start, 16, dtype=torch.float64), cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def disagreeing_ranks(rank: int, world: int, store: str) -> None:
    """Rank 1 passes a different B, H, dim, dtype, option, flag or cu_seqlens than rank 0, or an
    argument it alone refuses: every rank raises the same ArgumentError before the summaries'
    collectives (no SIGABRT inside gloo, no rank left waiting); then an agreeing call works."""
    from datetime import timedelta

    import pytest

    import mixc
    from helpers import random_args
    from mixc.nn import MixerLayer
    from mixc.runtime.signature import ArgumentError
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        def call(name, B=2, T=6, H=2, K=4, dtype=torch.float32, **extra):
            op = mixc.load(name)
            kw, _ = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": 4}, dtype=dtype, seed=rank)
            kw.update(extra.pop("replace", {}))
            return op(**kw, **extra, mode="torch", cp_group=dist.group.WORLD)

        other = rank == 1
        cases = [  # (what rank 1 changes, the message every rank gives)
            (dict(H=3 if other else 2), "the ranks disagree on H: rank 0 has 2, rank 1 has 3"),
            (dict(B=1 if other else 2), "the ranks disagree on B: rank 0 has 2, rank 1 has 1"),
            (dict(K=8 if other else 4), "the ranks disagree on dim K: rank 0 has 4, rank 1 has 8"),
            (dict(dtype=torch.float64 if other else torch.float32),
             "the ranks disagree on the dtype of q: rank 0 has float32, rank 1 has float64"),
            (dict(scale=0.5 if other else 0.25), "the ranks disagree on option scale: rank 0 has 0.25, rank 1 has 0.5"),
        ]
        for change, message in cases:
            with pytest.raises(ArgumentError, match="cp_group: " + message.replace("(", r"\(")):
                call("gla", **change)
        with pytest.raises(ArgumentError, match="the ranks disagree on flag use_qk_l2norm_in_kernel: rank 0 has "
                                                "False, rank 1 has True"):
            call("delta_rule", use_qk_l2norm_in_kernel=other)
        with pytest.raises(ArgumentError, match=r"the ranks disagree on cu_seqlens: rank 0 has \[0, 3, 12\], "
                                                r"rank 1 has \[0, 5, 12\]"):
            call("gla", B=1, cu_seqlens=torch.tensor([0, 5 if other else 3, 12]))
        with pytest.raises(ArgumentError, match=r"cp_group: rank 1 refused its arguments: g: .*got shape \[2, 6, 2\]"):
            call("gla", replace={"g": torch.randn(2, 6, 2)} if other else {})
        with pytest.raises(ArgumentError, match="the ranks disagree on spec: rank 0 has gla"):
            call("simple_gla" if other else "gla")
        # a bad initial state on one rank: refused on every rank, before any other collective (it
        # raised on that rank alone and left rank 0 in the all-gather until the group's timeout)
        good = {"S": torch.randn(2, 2, 4, 4)}
        with pytest.raises(ArgumentError, match=r"cp_group: rank 1 refused its arguments: initial_state\['S'\]: "
                                                r"expected shape \[B=2, H=2, K=4, V=4\], got \[2, 2, 4, 5\]"):
            call("gla", initial_state={"S": torch.randn(2, 2, 4, 5)} if other else good)
        with pytest.raises(ArgumentError, match="cp_group: rank 1 refused its arguments: cu_seqlens: expected a 1-D "
                                                "int32 or int64 tensor"):
            call("gla", B=1, cu_seqlens=[0, 3, 12] if other else torch.tensor([0, 3, 12]))
        # a shard of no tokens: one error on every rank (it crashed that rank, gloo errors elsewhere)
        with pytest.raises(ArgumentError, match=r"cp_group: rank 1 holds no tokens \(T = 0\)"):
            call("gla", B=1, T=0 if other else 6, cu_seqlens=torch.tensor([0, 2, 6]))
        # a bare tensor for a one-state spec, as the op takes it: the same numbers as the dict
        st = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(7))
        o_bare, _ = call("gla", initial_state=st)
        o_dict, _ = call("gla", initial_state={"S": st})
        assert torch.equal(o_bare, o_dict)
        # the group still works: an agreeing call, shards of 6 and 5 tokens
        o, _ = call("gla", T=6 - rank)
        assert o.shape == (2, 6 - rank, 2, 4) and torch.isfinite(o).all()
        layer = MixerLayer("gla", d_model=16, n_heads=2, mode="torch")
        with pytest.raises(ArgumentError, match="cp_group: the ranks disagree on the batch size B of x: rank 0 has "
                                                "2, rank 1 has 1"):
            layer(torch.randn(1 if other else 2, 5, 16), cp_group=dist.group.WORLD)
        dist.barrier()
    finally:
        dist.destroy_process_group()

"""Workers for the data-parallel tests: a MixerLM trained one step under
DistributedDataParallel or FSDP (fully_shard) on gloo, each rank holding half of the batch,
against the same step in one process on the whole batch."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .cp_workers import init


def model_and_batch(spec: str):
    from mixc.nn import MixerLM
    torch.manual_seed(0)
    model = MixerLM(vocab_size=32, d_model=16, n_layers=2, specs=spec, n_heads=2, mode="torch").double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (4, 12), generator=gen)
    return model, ids


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def one_step(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = loss_of(model, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads


def ddp_and_fsdp(rank: int, world: int, store: str, specs: list, kind: str) -> None:
    init(rank, world, store)
    try:
        for spec in specs:
            check_step(rank, world, spec, kind)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def check_step(rank: int, world: int, spec: str, kind: str) -> None:
    ref_model, ids = model_and_batch(spec)
    ref_loss, ref_grads = one_step(ref_model, ids)
    ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}

    model, _ = model_and_batch(spec)
    per = ids.shape[0] // world
    mine = ids[rank * per:(rank + 1) * per]
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        loss, grads = one_step(wrapped, mine)
        grads = {n.removeprefix("module."): g for n, g in grads.items()}
        params = {n.removeprefix("module."): p.detach() for n, p in wrapped.named_parameters()}
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        loss, grads = one_step(model, mine)
        grads = {n: g.full_tensor() for n, g in grads.items()}
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    total = loss.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world, ref_loss, rtol=1e-10, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-8, atol=1e-10, msg=lambda m: f"d{n}: {m}")
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-8, atol=1e-10, msg=lambda m: f"{n}: {m}")

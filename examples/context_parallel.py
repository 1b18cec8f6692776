"""Context parallelism with torchrun: each rank holds a contiguous shard of one long sequence.

    torchrun --nproc_per_node 2 examples/context_parallel.py            # CPU, gloo
    torchrun --nproc_per_node 8 examples/context_parallel.py --cuda     # one GPU per rank, nccl

Every rank draws the same full sequence (same seed), keeps its shard, runs the op with
cp_group, and compares its part of the output and of the gradients with the op run on the
whole sequence in one process (float64 through the torch backend on the CPU)."""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import mixc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="gla")
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    dtype = torch.float32 if args.cuda else torch.float64
    mode = "auto" if args.cuda else "torch"

    op = mixc.load(args.spec)
    from mixc.runtime.inputs import random_args
    full, _ = random_args(op.ir, B=2, T=args.T, H=4, sizes={"K": 16, "V": 16, "N": 8, "P": 16}, dtype=dtype,
                          device=device, seed=0)
    per_token = {d.name for d in op.ir.inputs}
    start, end = rank * args.T // world, (rank + 1) * args.T // world
    mine = {k: (v[:, start:end] if k in per_token else v).clone().requires_grad_() for k, v in full.items()}

    o, _ = op(**mine, cp_group=dist.group.WORLD, mode=mode)
    o.square().sum().backward()

    whole = {k: v.clone().requires_grad_() for k, v in full.items()}
    o_ref, _ = op(**whole, mode=mode)
    o_ref.square().sum().backward()
    err = (o - o_ref[:, start:end]).abs().max().item() / o_ref.abs().max().item()
    grad_err = max((mine[k].grad - whole[k].grad[:, start:end]).abs().max().item()
                   / whole[k].grad.abs().max().item() for k in per_token)
    # one write per line: with PYTHONUNBUFFERED, print writes the text and the newline apart,
    # and the other rank's line could land between them
    sys.stdout.write(f"rank {rank}/{world}: tokens {start}..{end}, output error {err:.2e}, "
                     f"input gradient error {grad_err:.2e}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Buffers and launch-argument helpers the launcher (launcher.py) and the segmented walk
(segments.py) share: below both, so that neither imports the other."""
from __future__ import annotations

import os

import torch


def empty(shape, dtype, device) -> torch.Tensor:
    """An output buffer; filled with NaN under MIXC_POISON=1 (the tests) so that an element a
    kernel forgets to write shows up instead of passing with stale memory."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("MIXC_POISON") == "1":
        t.fill_(float("nan"))
    return t


def checkpoint_slots(b, CK: int) -> int:
    """Slots for the chunk checkpoints of all sequences (see codegen.recurrent_ir.state_base)."""
    return (b.B * b.T) // CK + b.n_seqs + 1


def chunk_seqs(cu_seqlens: torch.Tensor, C: int, n: int, programs: int, device) -> torch.Tensor:
    """Each checkpoint slot's sequence (the slot kernels of packed sequences, int32 [programs]): the last
    whose first slot (cu_seqlens[i] // C + i) is at most the slot; made on the device (no sync).
    runtime/fastpath.py makes it per replayed call."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts = cu[:-1] // C + torch.arange(n, device=device)
    return (torch.searchsorted(starts, torch.arange(programs, device=device), right=True) - 1).to(torch.int32)


def one_stage(kw: dict) -> dict:
    """An output (refill, intra, tiles) launch's arguments: one pipeline stage where stages are set (its chunk loop has
    one iteration per program, or checkpoint_every; pipelining would hold the next chunk's
    inputs in shared memory; not measured on a GPU)."""
    return kw | {"num_stages": 1} if "num_stages" in kw else kw


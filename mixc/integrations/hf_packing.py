"""Packed sequences in transformers' mixer layers.

transformers says where packed sequences start in two ways: mamba_ssm's `seq_idx` [batch, T]
(the index of each token's sequence, DataCollatorWithFlattening(return_seq_idx=True); the
Mamba-2 family passes it on to its scan and conv) and flash-attention's `cu_seq_lens_q` (the
start offsets over one row, return_flash_attn_kwargs=True; Qwen3-Next and OlmoHybrid pass it to
their delta rule as `cu_seqlens`). mixc's ops take fla's `cu_seqlens` over a batch of one row.
Segments: seq_idx becomes cu_seqlens over the batch's rows laid end to end (a segment ends
where seq_idx changes or a row ends), and a row's initial state is its first segment's, its
final state its last segment's (mamba_ssm's rule).

transformers' pure-torch causal conv keeps nothing apart: `packed_conv` wraps it so that with
seq_idx or cu_seq_lens_q a token's window reads only its own sequence (causal_conv1d's rule).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..runtime.signature import ArgumentError


class Segments:
    """seq_idx [batch, T] as cu_seqlens over the batch * T tokens flattened, with the first and
    last segment of each row."""

    def __init__(self, seq_idx: torch.Tensor, batch: int, length: int):
        if seq_idx.shape != (batch, length):
            raise ArgumentError(f"seq_idx: expected [batch, T] = {[batch, length]}, got {list(seq_idx.shape)}")
        flat = seq_idx.reshape(-1)
        start = torch.ones_like(flat, dtype=torch.bool)
        start[1:] = flat[1:] != flat[:-1]
        start[::length] = True                          # a row starts a segment
        seg = torch.cumsum(start.long(), 0) - 1        # each token's segment
        n = batch * length
        # the host reads the segment starts (nonzero): packed batches are not CUDA-graph safe
        self.cu_seqlens = torch.cat([start.nonzero().flatten(), flat.new_tensor([n], dtype=torch.long)]).to(torch.int32)
        self.first, self.last = seg[::length], seg[length - 1::length]
        self.batch, self.length, self.count = batch, length, len(self.cu_seqlens) - 1

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape((1, self.batch * self.length) + tuple(x.shape[2:]))

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape((self.batch, self.length) + tuple(x.shape[2:]))

    def initial(self, state: dict | None) -> dict | None:
        """A row's initial state -> its first segment's; the other segments start at zero."""
        if state is None:
            return None
        out = {}
        for name, s in state.items():
            full = s.new_zeros((self.count,) + tuple(s.shape[1:]))
            out[name] = full.index_copy(0, self.first, s)
        return out

    def final(self, state: dict | None) -> dict | None:
        """The segments' final states -> each row's last segment's."""
        return None if state is None else {name: s[self.last] for name, s in state.items()}


def segments(seq_idx, batch: int, length: int) -> Segments | None:
    return None if seq_idx is None else Segments(seq_idx, batch, length)


def token_sequences(batch: int, length: int, seq_idx, cu_seqlens, device) -> torch.Tensor | None:
    """The sequence of each token [batch, length] from seq_idx or cu_seq_lens_q, or None."""
    if seq_idx is not None:
        seq = seq_idx.to(device=device, dtype=torch.long)
        if seq.shape[0] != batch or seq.dim() != 2 or seq.shape[1] > length:
            raise ArgumentError(f"seq_idx: expected [batch, T] with batch {batch} and T <= {length}, "
                                f"got {list(seq.shape)}")
    elif cu_seqlens is not None:
        if batch != 1:
            raise ArgumentError(f"cu_seq_lens_q: packed sequences are one row (batch 1), got batch {batch}")
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        positions = torch.arange(int(cu[-1]), device=device)
        seq = torch.searchsorted(cu[1:], positions, right=True)[None]
        if seq.shape[1] > length:
            raise ArgumentError(f"cu_seq_lens_q: its offsets cover {seq.shape[1]} tokens, the row has {length}")
    else:
        return None
    # a cached conv state ahead of the tokens (prefill with a cache) belongs to a row's first sequence
    return torch.cat([seq[:, :1].expand(-1, length - seq.shape[1]), seq], dim=1)


def packed_conv(original, refuse: str | None = None):
    """transformers' causal_conv1d_fn(x [batch, D, T], weight [D, W], bias, activation, **kwargs),
    with packed sequences kept apart: tap j of token t reads token t - j only when both are in
    one sequence. Without seq_idx or cu_seq_lens_q it is the original function. refuse: a reason
    to raise an ArgumentError on packed sequences instead (the layer's core cannot keep them apart)."""
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if refuse is not None and (seq_idx is not None or kwargs.get("cu_seq_lens_q") is not None
                                   or kwargs.get("cu_seqlens") is not None):
            raise ArgumentError(f"packed sequences (seq_idx, cu_seq_lens_q): {refuse}; run the sequences in "
                                "rows of their own (padding) instead")
        batch, _, length = hidden_states.shape
        seq = token_sequences(batch, length, seq_idx, kwargs.get("cu_seq_lens_q"), hidden_states.device)
        if seq is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        width = weight.shape[-1]
        x = F.pad(hidden_states.to(weight.dtype), (width - 1, 0)).unfold(-1, width, 1)    # [b, D, T, W]
        same = F.pad(seq, (width - 1, 0), value=-1).unfold(-1, width, 1) == seq[..., None]  # [b, T, W]
        out = torch.einsum("bdtw,dw->bdt", x * same[:, None].to(x.dtype), weight)
        if bias is not None:
            out = out + bias[:, None]
        if activation is not None:
            from transformers.activations import ACT2FN     # optional: transformers, only in a patched model
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)
    return causal_conv1d_fn

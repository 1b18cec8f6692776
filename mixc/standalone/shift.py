"""prev(x) of inputs at call time (dsl/ir.py Shifted): the previous token's x, 0 at each
sequence's start.

The checker lowers prev(x) to a derived input prev_x, so every mode (the kernels, the torch
backend, the reference) reads an ordinary input. This module computes it before them:

    op(x=..., initial_state={..., "prev_x": x before the first token})
        prev_x = x shifted one token along T within each sequence (packed ones by cu_seqlens),
                 row 0 of a sequence from initial_state["prev_x"], else 0
        final state["prev_x"] = x at each sequence's last token
    op.step(x=..., state=state)
        prev_x = state["prev_x"] (0 where the state lacks it); new state["prev_x"] = this x

The shift is torch ops (a cat and a where), so autograd carries the gradient of prev_x back to
x (the reverse shift) and to initial_state["prev_x"]; nothing reads the offsets on the host.
Torch only (this package's rule): mixc.load's op (runtime/op.py) and a compiled module
(support.py) shift with the same code; `mixer` is a MixerIR or a compiled module's Signature
(binding.py), each with .shifted (name, source) and .inputs. The
carried entry has x's heads, [B or N, H_x, *x's dims], and the dtype of the states it comes
with (float32 from the kernels and the torch backend, float64 from the reference and float64
inputs; an in-place step's buffer keeps its own)."""
from __future__ import annotations

import torch

from .errors import ArgumentError

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def refuse_derived(mixer, kwargs: dict, step: bool) -> None:
    """prev_x is the op's to compute: passed by the caller it would be two answers to one question."""
    for s in mixer.shifted:
        if s.name in kwargs:
            where = "state" if step else "initial_state"
            raise ArgumentError(f"{s.name}: computed by the op from input '{s.source}' (prev({s.source}) in the spec); "
                                f"the {s.source} before the first token comes from {where}['{s.name}']")


def split_state(mixer, state) -> tuple[object, dict]:
    """(the state without the carried prev_x entries, those entries)."""
    if not isinstance(state, dict):
        return state, {}
    names = {s.name for s in mixer.shifted}
    return {k: v for k, v in state.items() if k not in names}, {k: v for k, v in state.items() if k in names}


def _check_carried(arg: str, name: str, v, want: tuple, x: torch.Tensor, lead: str) -> None:
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(want):
        got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ArgumentError(f"{arg}['{name}']: expected shape {list(want)} ([{lead}, H, dims] of the input it "
                            f"follows, the previous token's value), got {got}")
    if v.dtype not in FLOATS:
        raise ArgumentError(f"{arg}['{name}']: expected a floating-point tensor, got dtype {v.dtype}")
    if v.device != x.device:
        raise ArgumentError(f"{arg}['{name}']: on device {v.device}, but the inputs are on {x.device}")


def _offsets(cu) -> torch.Tensor | None:
    """cu_seqlens as the shift reads it, or None where bind() will refuse it (its message then)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 \
            or cu.numel() < 2 or cu.device.type == "meta":
        return None
    return cu.to(torch.long)


def shift(x: torch.Tensor, cu: torch.Tensor | None, first: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, ...] one token later: row t holds x_{t-1}; a sequence's first row holds `first`
    ([B or N, ...]: the token before it) or 0. cu: packed offsets (B = 1) or None."""
    T = x.shape[1]
    if T == 0:
        return x
    head = first.to(x.dtype).unsqueeze(1) if first is not None and cu is None else x.new_zeros(x[:, :1].shape)
    y = torch.cat([head, x[:, :-1]], 1)
    if cu is None:
        return y
    cu = cu.to(x.device)
    t = torch.arange(T, device=x.device)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.numel() - 2)      # each token's sequence
    start = (t == cu[seq]).view((1, T) + (1,) * (x.dim() - 2))                     # its first token
    if first is None:
        return y.masked_fill(start, 0.0)
    return torch.where(start, first.to(x.dtype)[seq].unsqueeze(0), y)


def last(x: torch.Tensor, cu: torch.Tensor | None, first: torch.Tensor | None) -> torch.Tensor:
    """x at each sequence's last token [B or N, ...]; an empty sequence keeps `first` (or 0)."""
    n = x.shape[0] if cu is None else cu.numel() - 1
    before = first.to(x.dtype) if first is not None else x.new_zeros((n,) + tuple(x.shape[2:]))
    if x.shape[1] == 0:
        return before
    if cu is None:
        return x[:, -1]
    cu = cu.to(x.device)
    rows = x[0, (cu[1:] - 1).clamp(min=0)]
    empty = (cu[1:] == cu[:-1]).view((n,) + (1,) * (x.dim() - 2))
    return torch.where(empty, before, rows)


class Carry:
    """The derived inputs of one call and what its final state carries."""

    def __init__(self, mixer, kwargs: dict, initial_state, cu_seqlens):
        refuse_derived(mixer, kwargs, step=False)
        self.mixer = mixer
        self.state, given = split_state(mixer, initial_state)
        self.kwargs = dict(kwargs)
        self.cu = _offsets(cu_seqlens) if cu_seqlens is not None else None
        self.firsts, self.sources = {}, {}
        for s in mixer.shifted:
            x = kwargs.get(s.source)
            if not isinstance(x, torch.Tensor) or x.dim() < 3 or (cu_seqlens is not None and self.cu is None):
                self.kwargs[s.name] = x      # bind() refuses x or cu_seqlens, in its words
                continue
            first = given.get(s.name)
            if first is not None:
                n = x.shape[0] if self.cu is None else self.cu.numel() - 1
                _check_carried("initial_state", s.name, first, (n,) + tuple(x.shape[2:]), x,
                               "B" if self.cu is None else "N")
            self.kwargs[s.name] = shift(x, self.cu, first)
            self.firsts[s.name], self.sources[s.name] = first, x

    def final(self, st):
        """The final state with each prev_x entry: x at each sequence's last token."""
        if st is None:
            return None
        st = dict(st)
        dtype = next(iter(st.values())).dtype if st else None
        for name, x in self.sources.items():
            st[name] = last(x, self.cu, self.firsts[name]).to(dtype)
        return st


class StepCarry:
    """One step's derived inputs (the state's prev_x) and the state it returns."""

    def __init__(self, mixer, kwargs: dict, state, inplace: bool, state_indices):
        refuse_derived(mixer, kwargs, step=True)
        self.given = state
        self.state, self.carried = split_state(mixer, state)
        self.kwargs = dict(kwargs)
        self.inplace, self.idx = inplace, state_indices
        self.sources = {}
        for s in mixer.shifted:
            x = kwargs.get(s.source)
            if not isinstance(x, torch.Tensor) or x.dim() < 2:
                self.kwargs[s.name] = x      # bind() refuses x, in its words
                continue
            v = self.carried.get(s.name)
            if v is None:
                if inplace:
                    raise ArgumentError(f"state: missing '{s.name}' ([B, H, dims] of input '{s.source}', the previous "
                                        f"token's {s.source}): an in-place step writes this token's {s.source} there; "
                                        "take the state from output_final_state=True, or add a zero buffer")
                v = torch.zeros_like(x)          # a sequence's start
            else:
                rows = v.shape[0] if isinstance(v, torch.Tensor) and state_indices is not None else x.shape[0]
                _check_carried("state", s.name, v, (rows,) + tuple(x.shape[1:]), x, "B" if state_indices is None
                               else "N_slots")
                if state_indices is not None and isinstance(state_indices, torch.Tensor):
                    v = v[state_indices.to(device=v.device, dtype=torch.long)]
            self.kwargs[s.name] = v.to(x.dtype)
            self.sources[s.name] = x

    def new_state(self, st):
        """The step's state with each prev_x entry: this token's x (the given buffers, in place)."""
        if self.inplace:
            with torch.no_grad():
                for name, x in self.sources.items():
                    buf = self.carried[name]
                    if self.idx is None:
                        buf.copy_(x)
                    else:
                        buf.index_copy_(0, self.idx.to(device=buf.device, dtype=torch.long), x.to(buf.dtype))
            return self.given
        st = dict(st)
        dtype = next(iter(st.values())).dtype if st else None
        for name, x in self.sources.items():
            st[name] = x.to(dtype, copy=True)
        return st

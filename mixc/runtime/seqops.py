"""The numerics of the sequence ops, over tensors laid out [batch, time, H, *channels]:
causal and centred convolutions (direct or FFT), token mixing and softmax attention.

`method` is "torch" (the fast path: FFT for long filters, scaled_dot_product_attention or
flex_attention) or "reference" (direct sums and the masked softmax written out, for the
float64 reference). Gradients are torch autograd's through either."""
from __future__ import annotations

import functools
import warnings

import torch

from ..derive.sequence import DIRECT_MAX_ROWS, DIRECT_MAX_TAPS


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _fft_conv(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The first N outputs of the full linear convolution (N = x's length): FFT of size the next
    power of two >= N + L - 1, so the circular wrap-around never reaches them."""
    N, L = x.shape[1], h.shape[1]
    n = next_pow2(N + L - 1)
    dtype = torch.promote_types(torch.promote_types(x.dtype, h.dtype), torch.float32)
    X = torch.fft.rfft(x.to(dtype), n=n, dim=1)
    Hf = torch.fft.rfft(h.to(dtype), n=n, dim=1)
    return torch.fft.irfft(X * Hf, n=n, dim=1).narrow(1, 0, N)


def causal_conv(h: torch.Tensor, x: torch.Tensor, rows: int | None = None, method: str = "torch") -> torch.Tensor:
    """y[:, i] = sum_{j <= i, j < L} h[:, j] x[:, i - j] for the last `rows` rows of x (all by default).

    h: [1 or B, L, H, *C] (channels broadcast against x's), x: [B, N, H, *C]."""
    N, L = x.shape[1], h.shape[1]
    rows = N if rows is None else rows
    if rows == 0 or N == 0:
        shape = torch.broadcast_shapes(h[:, :1].shape, x[:, :1].shape)
        return x.new_zeros((shape[0], rows) + shape[2:])
    if rows <= DIRECT_MAX_ROWS:
        # decode: each output is one dot product over the taps that reach it
        outs = []
        for i in range(N - rows, N):
            n = min(L, i + 1)
            outs.append((h[:, :n].flip(1) * x[:, i - n + 1:i + 1]).sum(1))
        return torch.stack(outs, 1)
    if method == "reference" or L <= DIRECT_MAX_TAPS:
        # a sum over the taps: tap j meets x shifted by j (taps beyond N never meet x)
        Lu = min(L, N)
        xp = torch.cat([x.new_zeros((x.shape[0], Lu - 1) + x.shape[2:]), x], 1)
        y = 0
        for j in range(Lu):
            start = N - rows - j + Lu - 1
            y = y + h[:, j:j + 1] * xp[:, start:start + rows]
        return y
    return _fft_conv(h, x).narrow(1, N - rows, rows).to(torch.promote_types(h.dtype, x.dtype))


def centred_conv(h: torch.Tensor, x: torch.Tensor, method: str = "torch") -> torch.Tensor:
    """y[:, i] = sum_j h[:, j] x[:, i - j + c], c = (L - 1) // 2, x zero beyond its ends."""
    N, L = x.shape[1], h.shape[1]
    c = (L - 1) // 2
    pad = x.new_zeros((x.shape[0], c) + x.shape[2:])
    return causal_conv(h, torch.cat([x, pad], 1), method=method).narrow(1, c, N)


def token_mix(W: torch.Tensor, x: torch.Tensor, causal: bool, q0: int) -> torch.Tensor:
    """y[:, i] = sum_s W[:, i, ..., s] x[:, s] over s <= q0 + i (causal) or every s.

    W: [1 or B, R, H, *C, P] (the source positions last), x: [B, P, H, *C]."""
    R, P = W.shape[1], W.shape[-1]
    if causal:
        i = torch.arange(R, device=W.device).unsqueeze(1) + q0
        allowed = torch.arange(P, device=W.device).unsqueeze(0) <= i             # [R, P]
        W = W * allowed.reshape((1, R, 1) + (1,) * (W.dim() - 4) + (P,)).to(W.dtype)
    c = "cdefgijklmnopqruvwxyz"[:W.dim() - 4]
    return _einsum_squeezed(W, "brh" + c + "s", x, "bsh" + c, "brh" + c)


def _einsum_squeezed(a, sa: str, b, sb: str, out: str) -> torch.Tensor:
    """einsum with the size-1 (broadcast) axes of each operand left out, so that a matrix the
    same for every channel or batch row is never expanded to them (torch.einsum would copy it
    to a bmm batch); the result gets them back as size-1 axes."""
    def squeeze(t, sub):
        keep = [i for i, n in enumerate(t.shape) if n != 1]
        return t.reshape([t.shape[i] for i in keep]), "".join(sub[i] for i in keep)
    (a2, sa2), (b2, sb2) = squeeze(a, sa), squeeze(b, sb)
    out2 = "".join(ch for ch in out if ch in sa2 or ch in sb2)
    y = torch.einsum(f"{sa2},{sb2}->{out2}", a2, b2)
    sizes = {ch: n for t, sub in ((a2, sa2), (b2, sb2)) for ch, n in zip(sub, t.shape)}
    return y.reshape([sizes.get(ch, 1) for ch in out])


def attention_mask(Tq: int, Tk: int, q0: int, k0: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """[Tq, Tk] booleans: query i (position q0 + i) may read key j (position k0 + j). Keys at
    negative positions are the zero padding of a window cache. None: every key, no mask."""
    qp = torch.arange(Tq, device=device).unsqueeze(1) + q0
    kp = torch.arange(Tk, device=device).unsqueeze(0) + k0
    ok = _allowed(qp, kp, causal, window)
    return None if bool(ok.all()) else ok


def _allowed(qp, kp, causal: bool, window: int | None):
    """Query position qp may read key position kp (tensors that broadcast)."""
    ok = kp >= 0
    if causal:
        ok = ok & (kp <= qp)
        if window is not None:
            ok = ok & (qp - kp < window)
    elif window is not None:
        ok = ok & ((qp - kp).abs() < window)
    return ok


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention    # lazy: 7 ms, only on CUDA
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, q0, k0, causal, window):
    """flex_attention with a block mask (CUDA): blocks with no allowed entry are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask     # lazy: 7 ms, only on CUDA

    def mask_mod(b, h, i, j):
        return _allowed(i + q0, j + k0, causal, window)

    bm = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    return _compiled_flex()(q, k, v, block_mask=bm, scale=1.0)


_FLEX_FAILED: list[str] = []


def attention(q, k, v, *, causal: bool, window: int | None, q0: int = 0, k0: int = 0, method: str = "torch"):
    """o[:, i] = sum_j softmax_j(q_i . k_j) v_j over the keys the mask allows (no scale added).

    q [B, Tq, H, E], k [B, Tk, H, E], v [B, Tk, H, Ev]; query i is at position q0 + i, key j at
    k0 + j. CPU: scaled_dot_product_attention (is_causal for a plain causal square, else the mask
    as booleans); CUDA: flex_attention with a block mask where the mask is not plain causal;
    method "reference": the masked softmax written out."""
    Tq, Tk = q.shape[1], k.shape[1]
    mask = attention_mask(Tq, Tk, q0, k0, causal, window, q.device)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))         # [B, H, T, E]
    if method == "reference":
        s = torch.einsum("bhie,bhje->bhij", qh, kh)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("bhij,bhje->bhie", torch.softmax(s, -1), vh).transpose(1, 2)
    plain_causal = causal and window is None and q0 == k0 and Tq == Tk
    if q.device.type == "cuda" and mask is not None and not plain_causal and not _FLEX_FAILED:
        try:
            return _flex(qh, kh, vh, q0, k0, causal, window).transpose(1, 2)
        except Exception as err:            # an op we cannot test here: fall back, say so once
            _FLEX_FAILED.append(repr(err))
            warnings.warn(f"mixc: flex_attention failed ({err!r}); using scaled_dot_product_attention with a "
                          "boolean mask", stacklevel=2)
    F = torch.nn.functional
    if plain_causal:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=1.0)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0)
    return o.transpose(1, 2)

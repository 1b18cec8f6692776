"""The torch primitives the units' torch forms share (mixc/classes/*.py, the sections `torch
form` and `context parallel`): per-pair and per-chunk log decays, the intra-chunk products of
a decay over no axis, a scalar, the key or the value axis (the objects torch_decay returns),
and the per-head matmul. The units import this module only inside their torch methods
(base.torch_form): derive imports the units, and `mixc check` / `explain` must not pay
torch's import (~4 s).

Two layouts: one chunk [B, c, H, *] (the chunk-at-a-time loop, runtime/torch_chunk.py:
loop_pair_logs, loop_chunk_logs) and groups of chunks [B' H, N, C, *] (the batched form,
runtime/torch_chunk.py, torch_forward_batched: the rest). Both take every decay factor from per-pair sums of the
log decay, never from differences of cumulative sums (a decay of 0 resets; dg stays exact for
neighbours at strong decay)."""
from __future__ import annotations

import math
import threading

import torch


# ---- one chunk [B, c, H, *] (runtime/torch_chunk.py) ----
def loop_pair_logs(g, prev):
    """[B, i, j, H, *]: the log decay from token j to the query row i, the sum of g_s over
    j < s <= i (s <= i - 1 for a readout of S_{i-1}) where j is at or before that row, -inf
    elsewhere. Summed per pair, not as a difference b_i - b_j of cumulative sums: a log
    decay of -inf (a decay of 0, a state reset) gives -inf - -inf = NaN in the difference but
    -inf in the pair's own sum; and at strong decay (b of -1000 over a chunk) the difference
    rounds to ulp(b), 1e-4 relative in exp(g) for neighbours, while the pair's sum is exact
    for neighbours. Its autograd is a reverse cumsum of the per-pair terms, each well scaled,
    so dg does not cancel (the q dq - k dk identity subtracts the diagonal's O(1) terms)."""
    c = g.shape[1]
    ar = torch.arange(c, device=g.device)
    shape = (1, c, c) + (1,) * (g.dim() - 2)
    after = (ar[:, None] > ar[None, :]).view(shape)                          # [s, j]: s after j
    seg = torch.where(after, g.unsqueeze(2), torch.zeros((), dtype=g.dtype, device=g.device)).cumsum(1)
    if prev:                                  # row i takes the sum up to s = i - 1
        seg = torch.cat([torch.zeros_like(seg[:, :1]), seg[:, :-1]], 1)
    causal = (ar[:, None] - int(prev) >= ar[None, :]).view(shape)
    return seg.masked_fill(~causal, float("-inf"))


def loop_chunk_logs(g):
    """(b: the cumulative log decay, b at the chunk's last token, b_{i-1}, the suffix sums
    sum_{s > j} g_s, g). The suffix sum is the log weight of key j in S_C, summed from the
    chunk's end (bl - b_j would be NaN after a reset and round at strong decay)."""
    b = g.cumsum(1)
    sfx = g.flip(1).cumsum(1).flip(1)
    sfx = torch.cat([sfx[:, 1:], torch.zeros_like(sfx[:, :1])], 1)
    return b, b[:, -1], torch.cat([torch.zeros_like(b[:, :1]), b[:, :-1]], 1), sfx, g


def causal(c, prev, device):
    """[c, c]: query row i sees key j <= i (j < i with prev)."""
    return torch.ones(c, c, dtype=torch.bool, device=device).tril(-1 if prev else 0)


# ---- groups of chunks [B' H, N, C, *] (runtime/torch_chunk.py, torch_forward_batched) ----
# the forward runs in groups of chunks whose [C, max(C, dims)] tensors hold about this many
# elements (1 MB in float32; the key class's [C, C, dim] products split further): fresh tensors
# past glibc's mmap threshold cost page faults at every op, more than the op's own work, and a
# group's tensors stay in cache from the inputs to the readouts (at B = 1, H = 4, d = 64: 2^18
# ran simple_gla's forward in 0.98-1.15x fla's naive time, 2^20 1.2-1.4x, 2^16 1.15-1.4x)
GROUP_ELEMENTS = 1 << 18


def pair_logs(g, prev, axis, masked=True):
    """[.., i, j] (scalar g [.., C]: axis -1) or [.., i, j, f] (g [.., C, f]: axis -2): the log
    decay from token j to the query row i, summed per pair over j < s <= i (s <= i - 1 for a
    readout of S_{i-1}), -inf where j is after that row (masked=False: 0, an empty sum, for a
    caller that masks its product after). Summed per pair, never as a difference
    of cumulative sums: a log decay of -inf (a reset) stays -inf (not NaN), and at strong decay
    a neighbour's factor is exp(g) exactly (the difference would round to ulp(b))."""
    C = g.shape[axis]
    tail = () if axis == -1 else (1,)
    if prev:                 # row i takes the sum up to s = i - 1: g shifted by one token, s > j + 1
        g = torch.cat([torch.zeros_like(g.narrow(axis, 0, 1)), g.narrow(axis, 0, C - 1)], axis)
    after, above, _ = _pair_masks(C, prev, g.dtype, g.device)
    # in place on the fresh [C, C] tensor (autograd-safe: none of these saves its input)
    seg = torch.where(after.view((C, C) + tail), g.unsqueeze(axis),
                      torch.zeros((), dtype=g.dtype, device=g.device)).cumsum_(axis - 1)
    # -inf where j is after the row, by adding a [C, C] of 0 / -inf (seg is an empty sum, 0,
    # there: never NaN); a broadcast masked_fill_ is ~10x slower
    return seg.add_(above.view((C, C) + tail)) if masked else seg


def pair_factors(g, prev, axis):
    """exp(pair_logs(g, prev, axis)), bit for bit: exp of the unmasked sums (an empty sum where
    j is after the row: a factor of 1) times the causal [C, C] mask of 0 / 1, never exp(-inf):
    torch's CPU exp leaves its vector path for -inf (and for results below the smallest normal
    float), 3-8x slower per element, and half of a causal [C, C] is masked. In place but under
    autograd (exp_ saves its result)."""
    C = g.shape[axis]
    w = pair_logs(g, prev, axis, masked=False).exp_()
    inplace = not (g.requires_grad and torch.is_grad_enabled())
    if axis == -1:
        return w.tril_(-int(prev)) if inplace else w.tril(-int(prev))
    keep = _pair_masks(C, prev, g.dtype, g.device)[2].view(C, C, 1)
    return w.mul_(keep) if inplace else w * keep


_MASKS: dict = {}


def _pair_masks(C, prev, dtype, device):
    """pair_logs' [C, C] constants: s after j (bool), 0 / -inf (-inf where j is after the row)
    and its factor 1 / 0 (pair_factors). Kept per (C, prev, dtype, device) outside
    torch.compile: built afresh they were six small ops per call, twice per group in
    scalar_factors."""
    key = (C, prev, dtype, device)
    if key in _MASKS and not torch.compiler.is_compiling():
        return _MASKS[key]
    ar = torch.arange(C, device=device)
    after = ar[:, None] > ar[None, :] + int(prev)                        # [s, j]: s after j
    above = torch.zeros((C, C), dtype=dtype, device=device).masked_fill_(
        ar[:, None] - int(prev) < ar[None, :], float("-inf"))
    keep = (ar[:, None] - int(prev) >= ar[None, :]).to(dtype)
    if not torch.compiler.is_compiling():
        _MASKS[key] = (after, above, keep)
    return after, above, keep


def groups(N, per_chunk, elements=None):
    """Slices of the N chunks, each group's tensors of about `elements` (GROUP_ELEMENTS)."""
    step = max(1, (elements or GROUP_ELEMENTS) // max(per_chunk, 1))
    return [slice(n, min(n + step, N)) for n in range(0, N, step)]


# ---- a group's intermediates in buffers kept across calls (no autograd graph, CPU) ----
# Fresh each call, a group's ~1 MB intermediates come from pages glibc handed back to the
# OS when the last call freed them (it trims its heap top past twice the mmap threshold):
# a page fault per 4 KB written, a fifth of simple_gla's forward at T = 1K.
ARENA_ELEMENTS = 1 << 19        # a larger request is allocated afresh (and not kept)
ARENA_TOTAL = 1 << 22           # elements one arena keeps at most (16 MB in float32)
ARENA_MIN = 1 << 16             # the smallest buffer: small calls of growing T do not regrow it
_ARENAS = threading.local()


class Arena:
    """The intermediates of one group of chunks: the group's i-th request (take) is a view of
    the i-th buffer, kept across calls (one arena per thread, dtype and inference mode; a
    buffer grows to the largest request seen, within ARENA_ELEMENTS and ARENA_TOTAL, so it
    does not grow with the shapes seen). A take is valid until the next reset (the next
    group, or the next call): nothing taken may be returned or carried past its group."""

    def __init__(self, dtype):
        self.dtype, self.bufs, self.n, self.busy = dtype, [], 0, False

    def reset(self):
        self.n = 0

    def take(self, shape, like):
        """An uninitialized [shape] tensor (like's dtype), distinct from every other take since
        the last reset."""
        shape = tuple(shape)
        numel = math.prod(shape)
        i = self.n
        if numel > ARENA_ELEMENTS or like.dtype != self.dtype:
            return like.new_empty(shape)
        if i == len(self.bufs):
            self.bufs.append(None)
        buf = self.bufs[i]
        if buf is None or buf.numel() < numel:
            kept = sum(b.numel() for b in self.bufs if b is not None) - (buf.numel() if buf is not None else 0)
            if kept + numel > ARENA_TOTAL:
                return like.new_empty(shape)
            self.bufs[i] = None             # freed first: its pages may serve the larger one
            buf = self.bufs[i] = torch.empty(max(numel, min(ARENA_MIN, ARENA_TOTAL - kept)), dtype=self.dtype)
        self.n = i + 1
        return buf[:numel].view(shape)

    def owns(self, t):
        """Whether t's storage is one of the arena's buffers."""
        p = t.untyped_storage().data_ptr()
        return any(b is not None and b.untyped_storage().data_ptr() == p for b in self.bufs)


def arena(like):
    """This thread's arena for like's dtype, reset and marked busy (release_arena after the
    call); None where none serves: not on the CPU, under torch.compile, or one already in use
    on this thread (a call inside a call). The caller takes from it only without an autograd
    graph: a take is overwritten by the next call, so autograd must save none."""
    if like.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    arenas = _ARENAS.__dict__.setdefault("by_key", {})
    # inference tensors cannot be written outside inference mode: one arena per mode
    key = (like.dtype, torch.is_inference_mode_enabled())
    a = arenas.get(key)
    if a is None:
        a = arenas[key] = Arena(like.dtype)
    if a.busy:
        return None
    a.busy = True
    a.reset()
    return a


def release_arena(a):
    if a is not None:
        a.busy = False


def free_arenas():
    """Drop this thread's arenas (their buffers are freed when no take is left alive)."""
    _ARENAS.__dict__.pop("by_key", None)


def causal_product(X, Y, prev):
    """[BH, N, C(i), C(j)]: X Y^T, causal (strictly below the diagonal with prev): the
    products without a decay."""
    A = X @ Y.transpose(-1, -2)
    # in place on the matmul's fresh output (its backward keeps X and Y, not A); tril_ writes
    # zeros (NaN above the diagonal too), ~10x faster than masked_fill_ with a broadcast mask
    return A.tril_(-int(prev))


def key_decay_product(X, Y, g, prev):
    """[BH, N, C(i), C(j)]: sum_k X_ik Y_jk exp(the pair's log decay on k), causal (strictly
    below the diagonal with prev), for a log decay per key g [BH, N, C, K]."""
    BH, N, C, F = X.shape
    # the sub-chunk factors need log decays <= 0, a host read: under torch.compile the pair sums
    if C % SUB == 0 and C > SUB and not torch.compiler.is_compiling() and bool((g.detach() <= 0).all()):
        return key_product(X, Y, g, prev)
    out = []
    for s in groups(N, BH * C * C * F):
        w = pair_factors(g[:, s], prev, -2)                                  # [BH, n, i, j, K]
        out.append(((X[:, s].unsqueeze(-2) * w) * Y[:, s].unsqueeze(-3)).sum(-1))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


SUB = 8             # the key class's sub-chunk: pairs within one are summed per pair and key


def key_product(X, Y, g, prev):
    """key_decay_product on sub-chunks of SUB tokens (C a multiple of SUB):
    per pair and key (pair_logs) only inside a sub-chunk; across sub-chunks one matmul of
    factored rows, X_i exp(the log decay from its sub-chunk's start to i) against Y_j exp(the
    log decay from j to that start). Each factor is a sum over tokens, never a difference (a
    reset's -inf stays -inf; each factor is at most 1 for log decays <= 0, the only ones the
    caller sends), so every product equals the pair's own factor to rounding. In groups of
    chunks: a tensor past glibc's mmap threshold costs page faults at every op."""
    BH, N, C, F = X.shape
    out = []
    for s in groups(N, BH * C * 2 * C // SUB * F):
        out.append(_key_product(X[:, s], Y[:, s], g[:, s], prev))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _key_product(X, Y, g, prev):
    BH, N, C, F = X.shape
    n, c = C // SUB, SUB
    gs = g.reshape(BH, N, n, c, F)
    b = gs.cumsum(3)                                                        # within each sub-chunk
    bq = torch.cat([torch.zeros_like(b[:, :, :, :1]), b[:, :, :, :-1]], 3) if prev else b
    sfx = torch.cat([gs.flip(3).cumsum(3).flip(3)[:, :, :, 1:], torch.zeros_like(gs[:, :, :, :1])], 3)
    gap = pair_factors(b[:, :, :, -1], True, -2)         # [BH, N, I, J, F]: the sub-chunks between, J < I
    # Y_j exp(from j to its sub-chunk's end) exp(the sub-chunks between): the [I, J, c, F]
    # tensor in one pass (a product of two factors <= 1, each of a sum over tokens), not three
    Ys = (Y.reshape(BH, N, n, c, F) * sfx.exp()).unsqueeze(2) * gap.unsqueeze(4)             # [.., I, J, c, F]
    Xs = X.reshape(BH, N, n, c, F) * bq.exp()
    A = (Xs @ Ys.reshape(BH, N, n, C, F).transpose(-1, -2)).reshape(BH, N, n, c, n, c)
    # inside a sub-chunk per pair and key, unmasked (j after the row: an empty sum, a finite
    # factor of 1), the [c, c] sums made causal after: one pass over [.., c, c, F] less
    w = pair_logs(gs, prev, -2, masked=False).exp_()                         # [BH, N, n, i, j, F]
    diag = ((X.reshape(BH, N, n, c, 1, F) * w) * Y.reshape(BH, N, n, 1, c, F)).sum(-1).tril_(-int(prev))
    eye = torch.eye(n, dtype=X.dtype, device=X.device).view(n, 1, n, 1)
    return (A + diag.unsqueeze(4) * eye).reshape(BH, N, C, C)


def scalar_factors(g, prev, arena=None):
    """exp(pair_logs(g, prev, -1)) [BH, N, C, C] for a scalar log decay g [BH, N, C], on
    sub-chunks of SUB as key_product: per pair inside a sub-chunk; across sub-chunks the product
    exp(the log decay from its sub-chunk's start to i) exp(the sub-chunks between) exp(from j
    to its sub-chunk's end), each factor a sum over tokens (a reset's -inf gives 0, never NaN:
    every factor is at most 1 for log decays <= 0, the only ones taken here). arena: where
    the [C, C] factors and their block-diagonal go (an Arena, or None: fresh tensors)."""
    BH, N, C = g.shape
    if C % SUB or C <= SUB or torch.compiler.is_compiling() or not bool((g <= 0).all()):
        return pair_factors(g, prev, -1)
    m, c = C // SUB, SUB
    gs = g.reshape(BH, N, m, c)
    b = gs.cumsum(-1)                                                       # within each sub-chunk
    bq = torch.cat([torch.zeros_like(b[..., :1]), b[..., :-1]], -1) if prev else b
    sfx = torch.cat([gs.flip(-1).cumsum(-1).flip(-1)[..., 1:], torch.zeros_like(gs[..., :1])], -1)
    gap = pair_factors(b[..., -1], True, -1)               # [BH, N, I, J]: the sub-chunks between, J < I
    rows = bq.exp().unsqueeze(-1) * gap.unsqueeze(-2)                       # [BH, N, I, i, J]
    # D[I, i, J, j] = rows[I, i, J] exp(sfx[J, j]) as rows @ E, E [m, m c] block-diagonal
    # (E[J, J c + j] = exp(sfx[J, j])): each entry one product and m - 1 exact zeros, so equal
    # to the broadcast product, which was 3x slower (a size-1 last dim) and an eighth of the
    # forward of simple_gla at T = 1K
    E = g.new_zeros(BH * N, m, m, c) if arena is None else arena.take((BH * N, m, m, c), g).zero_()
    E.diagonal(dim1=1, dim2=2).copy_(sfx.exp().reshape(BH * N, m, c).transpose(1, 2))
    D = torch.bmm(rows.reshape(BH * N, C, m), E.reshape(BH * N, m, C),
                  out=None if arena is None else arena.take((BH * N, C, C), g)).view(BH, N, m, c, m, c)
    D.diagonal(dim1=2, dim2=4).copy_(pair_factors(gs, prev, -1).permute(0, 1, 3, 4, 2))
    return D.reshape(BH, N, C, C)


# the row and column factors' range: |log| <= ROW_COL_BOUND about each chunk's middle, so that
# u, v in [e^-40, e^40] (no overflow, no subnormal) and u_i v_j of j after i at most e^80,
# finite or inf in a product that tril_ then overwrites with 0
ROW_COL_BOUND = 40.0
SPLIT = 2.0 ** 14           # hi = (g + SPLIT) - SPLIT: g on a grid of 2^-10 (float32)


def row_col_factors(g):
    """(u, u of the row before, v, R) with u_i v_j = exp(the log decay from token j to i) for a
    scalar log decay g [BH, N, C] (j <= i; u of the row before for a readout of S_{i-1}), u, v
    [BH, N, C], and R [BH, N, 1] with u_i R = exp(b_i), b the cumulative log decay in the
    chunk; or None where g is out of ROW_COL_BOUND (a strong decay, a reset's -inf, NaN), of
    another dtype than float32/64, or under torch.compile (a host read).

    As the kernels' compensated sums (scalar.py's pair_logs): g = hi + lo with hi on a grid,
    whose cumulative sums bh are exact (and their differences), lo's bl of size below C
    2^-10. u_i = exp(bh_i - r) exp(bl_i) and v = 1 / u (r = bh at the chunk's middle, on the
    grid): each exp of an exact exponent or of a small one, so u_i v_j is the pair's factor to
    a few ulp (never to ulp(b), as exp(b_i) exp(-b_j) would be)."""
    if g.dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return None
    C = g.shape[-1]
    hi = (g + SPLIT) - SPLIT
    lo = g - hi                                                 # exact (Sterbenz)
    z = torch.zeros_like(g[..., :1])
    bh = torch.cat([z, hi], -1).cumsum_(-1)                     # [.., C + 1]: from before the chunk
    r = bh[..., C // 2:C // 2 + 1]
    bh = bh - r                                                 # exact: both on the grid
    if not float(bh.abs().amax()) <= ROW_COL_BOUND:             # NaN and inf fail too
        return None
    ex = bh.exp_().mul_(torch.cat([z, lo], -1).cumsum_(-1).exp_())
    u = ex[..., 1:]
    return u, ex[..., :-1], u.reciprocal(), r.exp()


def value_mix(A, V, g, prev):
    """sum_j A_ij exp(the pair's log decay on v) V_jv: the value-diagonal class's intra part."""
    BH, N, C, F = V.shape
    out = []
    for s in groups(N, BH * C * C * F):
        w = pair_factors(g[:, s], prev, -2)                                  # [BH, n, i, j, V]
        out.append((A[:, s].unsqueeze(-1) * w * V[:, s].unsqueeze(-3)).sum(-2))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def chunk_logs(g, axis):
    """(b, b at the chunk's last token, b_{i-1}, the suffix sums sum_{s > j} g_s) along axis
    (the chunk's tokens). The suffix sum, the log weight of key j in S_C, is summed from the
    chunk's end (bl - b_j would be NaN after a reset and round at strong decay)."""
    b = g.cumsum(axis)
    z = torch.zeros_like(g.narrow(axis, 0, 1))
    C = g.shape[axis]
    sfx = torch.cat([g.flip(axis).cumsum(axis).flip(axis).narrow(axis, 1, C - 1), z], axis)
    return b, b.select(axis, -1), torch.cat([z, b.narrow(axis, 0, C - 1)], axis), sfx


def scale_rows(X, f, fast, arena=None):
    """X * f (f broadcast to X's shape). fast: into a fresh contiguous tensor (the arena's,
    when given): X * f on the chunk layout's strided views keeps their strides, 2.5x slower
    (torch.broadcast_shapes is python, ~0.4 ms a call: X's shape is the product's)."""
    if not fast:
        return X * f
    return torch.mul(X, f, out=arena.take(X.shape, X) if arena is not None else X.new_empty(X.shape))


# the most leading indices mm loops over (one matmul each) before it takes matmul's copy
MM_LOOP = 16


def mm(X, Y, acc=None, fast=False, out=None):
    """X @ Y over [BH, n, a, b] @ [BH, n, b, c] (plus acc). fast (no autograd graph): per
    leading index on the views as they are, into acc in place (without acc into out, when
    given: a slice of the whole output). The chunk layout's views of
    [B, T, H, d] have no single stride over [BH, n], so matmul copies them whole; one bmm per
    head reads them with the row stride H d instead."""
    if fast:
        # one bmm where [BH, n] is one stride in all three (a single chunk, a single head, the
        # arena's contiguous tensors): a call and three views per head fewer
        Xb, Yb = _batched(X), _batched(Y)
        if Xb is not None and Yb is not None:
            if acc is not None:
                accb = _batched(acc)
                if accb is not None:
                    accb.baddbmm_(Xb, Yb)
                    return acc
            else:
                res = out if out is not None else torch.empty(X.shape[:-1] + Y.shape[-1:], dtype=X.dtype,
                                                              device=X.device)
                resb = _batched(res)
                if resb is not None and resb.is_contiguous():
                    torch.bmm(Xb, Yb, out=resb)
                    return res
    if not fast or X.shape[0] > MM_LOOP:
        P = X @ Y
        return P if acc is None else P.add_(acc)        # in place on the fresh product (autograd-safe)
    if acc is None:
        acc = out if out is not None else torch.empty(X.shape[:-1] + Y.shape[-1:], dtype=X.dtype, device=X.device)
        for h in range(X.shape[0]):            # bmm, not matmul: no expand / reshape per call
            torch.bmm(X[h], Y[h], out=acc[h])
        return acc
    for h in range(X.shape[0]):
        acc[h].baddbmm_(X[h], Y[h])
    return acc


def _batched(t):
    """t [BH, n, a, b] viewed as [BH n, a, b], or None where BH and n have no single stride."""
    BH, n = t.shape[:2]
    if n == 1 or BH == 1 or t.stride(0) == n * t.stride(1):
        return t.view((BH * n,) + t.shape[2:])
    return None


# ---- the decays of the batched form (a unit's torch_decay) ----
class NoDecay:
    """A state's decay over a group of chunks, for the products of the batched form: here none
    (a prefix sum, or a log decay of constant 0). g [BH, N, C(, F)] in the chunk layout, its
    chunk logs; fast: no autograd graph is recorded (fresh intermediates are updated in
    place, mm's per-head matmuls)."""

    axis = None

    def __init__(self, g, fast=False):
        self.g, self.fast = g, fast
        self.logs = None
        # fast: where a unit's readout may write its readouts [BH, n, C, VF] (a slice of the
        # whole output, torch_forward_batched sets it per readout; None: a fresh tensor)
        self.out = None
        # fast on the CPU: the group's Arena (torch_forward_batched sets it), for the intermediates
        # that die with the group (the products, the scaled rows)
        self.arena = None

    def take(self, shape, like):
        """An uninitialized tensor from the group's arena, or None without one (a fresh one)."""
        return self.arena.take(shape, like) if self.arena is not None else None

    def readout_rows(self, Q, prev):
        """Q times exp(b) (b_{i-1} with prev) where a decay keeps that tensor anyway, else None."""
        return None

    def product(self, X, Y, prev):
        """[BH, N, C(i), C(j)]: sum_k X_ik Y_jk exp(the pair's log decay), causal."""
        if self.fast:
            out = self.take(X.shape[:-1] + Y.shape[-2:-1], X)
            return mm(X, Y.transpose(-1, -2), fast=True, out=out).tril_(-int(prev))
        return causal_product(X, Y, prev)

    def on_keys(self, X, which):
        """X [BH, N, C, K] times exp(the chunk log `which`: chunk_logs' 0 = b, 2 = b_{i-1}, 3 = the
        suffix sums), where the decay acts on the keys."""
        return X

    def last(self):
        """exp(b at the chunk's end), shaped to multiply S [BH, N, KF, VF] (None: no decay)."""
        return None


class ScalarDecay(NoDecay):
    """A log decay per head and token, g [BH, N, C]. Without autograd, where g is in their range,
    from row and column factors (row_col_factors: the products, the factors on the keys and of
    the walk, no [C, C] factors); else from the chunk logs, the pair factors built once per prev
    and shared by every product."""

    axis = -1

    def __init__(self, g, fast=False):
        super().__init__(g, fast)
        self._rc = row_col_factors(g) if fast else None
        self.logs = chunk_logs(g, self.axis) if self._rc is None else None
        self._pairs = {}
        self._scaled_rows = []      # (X, which factor, X's rows times it) (_scaled)

    def _scaled(self, X, key):
        """X times the factor `key` names ("b", "b_prev": exp(b_i), exp(b_{i-1}); "-b": exp(-b_j))
        as one contiguous arena tensor, made once per (X, key) in the group."""
        got = next((s for x, k, s in self._scaled_rows if x is X and k == key), None)
        if got is None:
            u, uq, v, R = self._rc
            f = v / R if key == "-b" else (uq if key == "b_prev" else u) * R
            got = scale_rows(X, f.unsqueeze(-1), True, self.arena)
            self._scaled_rows.append((X, key, got))
        return got

    def readout_rows(self, Q, prev):
        """Q times exp(b) (b_{i-1} with prev), the rows the product reads too; None without the
        row and column factors (the caller scales Q S)."""
        return self._scaled(Q, "b_prev" if prev else "b") if self._rc is not None else None

    def product(self, X, Y, prev):
        if self._rc is not None:
            # A_ij = (X_i exp(b_i)) . (Y_j exp(-b_j)) for j <= i (u_i R . v_j / R): two scaled
            # copies of [C, dim] rows instead of the [C, C] factors (their exp and product); X's
            # is the one the readout's Q S reads. Within ROW_COL_BOUND both stay finite, and a
            # product of j after i (at most e^80 |x| |y|, inf past that) is overwritten by tril_
            Xs, Ys = self._scaled(X, "b_prev" if prev else "b"), self._scaled(Y, "-b")
            out = self.take(X.shape[:-1] + Y.shape[-2:-1], X)
            return mm(Xs, Ys.transpose(-1, -2), fast=True, out=out).tril_(-int(prev))
        if prev not in self._pairs:
            # factored on sub-chunks without autograd (one pass, not four); the backward
            # keeps the per-pair sums' gradients
            self._pairs[prev] = (scalar_factors(self.g, prev, self.arena) if self.fast
                                 else pair_factors(self.g, prev, -1))
        A = mm(X, Y.transpose(-1, -2), fast=self.fast, out=self.take(X.shape[:-1] + Y.shape[-2:-1], X))
        return A.mul_(self._pairs[prev]) if self.fast else A * self._pairs[prev]

    def key_factor(self, which):
        """[BH, N, C]: exp(the chunk log `which`: chunk_logs' 0 = b, 2 = b_{i-1}, 3 = the suffix
        sums)."""
        if self._rc is None:
            return self.logs[which].exp()
        u, uq, v, R = self._rc
        if which == 3:                                      # exp(b_C - b_j) = u_C v_j
            return v * u[..., -1:]
        return (u if which == 0 else uq) * R

    def on_keys(self, X, which):
        if self._rc is not None and which in (0, 2):        # the products' rows: one copy
            return self._scaled(X, "b" if which == 0 else "b_prev")
        return scale_rows(X, self.key_factor(which).unsqueeze(-1), self.fast, self.arena)

    def last(self):
        if self._rc is None:
            return self.logs[1].exp()[..., None, None]
        return (self._rc[0][..., -1:] * self._rc[3])[..., None]


class KeyDecay(NoDecay):
    """A log decay per key, g [BH, N, C, K]."""

    axis = -2

    def __init__(self, g, fast=False):
        super().__init__(g, fast)
        self.logs = chunk_logs(g, self.axis)

    def product(self, X, Y, prev):
        return key_decay_product(X, Y, self.g, prev)

    def on_keys(self, X, which):
        return scale_rows(X, self.logs[which].exp(), self.fast, self.arena)

    def last(self):
        return self.logs[1].exp().unsqueeze(-1)


class ValueDecay(NoDecay):
    """A log decay per value channel, g [BH, N, C, V]: the products over the keys have none
    (the value-diagonal unit applies it on the values, value_mix)."""

    axis = -2

    def __init__(self, g, fast=False):
        super().__init__(g, fast)
        self.logs = chunk_logs(g, self.axis)

    def product(self, X, Y, prev):
        return causal_product(X, Y, prev)

    def on_values(self, V, which):
        """V [BH, N, C, VF] times exp(the chunk log `which`)."""
        return V * self.logs[which].exp()

    def last(self):
        return self.logs[1].exp().unsqueeze(-2)


# by a unit's decay_axis (TORCH_STATES' "decay"); "element" has no batched form
DECAYS = {None: NoDecay, "scalar": ScalarDecay, "key": KeyDecay, "value": ValueDecay}

"""The torch backend's chunked form over groups of chunks: every intra-chunk product is one
batched matmul over [B*H, n chunks, C, dim] (views of the inputs, one layout change out), and
only the walk of the state from chunk to chunk is a python loop, of one to three fused ops
per chunk (addcmul, baddbmm). Each group goes from the inputs to its readouts before the next
(the state carried between), so its tensors stay small; without an autograd graph (`fast`)
the group's fresh intermediates are updated in place, the matmuls run per head on the
views (no layout copies) and the walk writes into one buffer. The per-chunk loop in
torch_chunk.py did ~166 small ops per chunk on the [B, c, H, dim] layout (einsums that copy),
2-3x fla's naive chunked reference.

The numerics are torch_chunk.py's: decay factors from per-pair sums of the log decay (a decay
of 0 resets; dg exact for neighbours at strong decay), key-side rows holding inf/NaN zeroed
before the matmuls and the readouts from them on NaN. The stabilized (max-tracking) and
elementwise classes stay on torch_chunk.py's loop (`batched_supported`).

Sequences of cu_seqlens are gathered into chunks padded with zeros (a key and value of 0 and a
log decay of 0 leave the state as it is), so one walk serves them all, resetting at each
sequence's first chunk."""
from __future__ import annotations

import torch

# the forward runs in groups of chunks whose [C, max(C, dims)] tensors hold about this many
# elements (1 MB in float32; the key class's [C, C, dim] products split further): fresh tensors
# past glibc's mmap threshold cost page faults at every op, more than the op's own work, and a
# group's tensors stay in cache from the inputs to the readouts (at B = 1, H = 4, d = 64: 2^18
# ran simple_gla's forward in 0.98-1.15x fla's naive time, 2^20 1.2-1.4x, 2^16 1.15-1.4x)
GROUP_ELEMENTS = 1 << 18
# under autograd the forward's groups are larger (fewer graph nodes; linear_attn's forward +
# backward at T = 16K: 0.96x fla's at 2^20, 1.2x at 2^18)
GRAD_GROUP_ELEMENTS = 1 << 20


def batched_supported(mod) -> bool:
    return not mod.TORCH_STABILIZED and all(st["class"] != "elementwise" for st in mod.TORCH_STATES.values())


class Layout:
    """Tokens [B, T, H, *] <-> chunks [B' * H, N, C, *] (B' = 1 with cu_seqlens)."""

    fast = False            # no autograd graph is recorded (torch_forward_batched sets it)

    def __init__(self, B, T, H, C, cu_seqlens, device):
        self.B, self.T, self.H, self.C = B, T, H, C
        if cu_seqlens is None:
            self.N = -(-T // C)
            self.Bp, self.idx = B, None
            self.first, self.seq = [n == 0 for n in range(self.N)], [0] * self.N
            self.last = {0: self.N - 1} if self.N else {}
            return
        self.Bp = 1
        cu = cu_seqlens.tolist()
        starts, first, seq, last = [], [], [], {}
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            for c0 in range(s, e, C):
                first.append(c0 == s)
                seq.append(i)
                starts.append(c0)
            if e > s:
                last[i] = len(starts) - 1
        self.N, self.first, self.seq, self.last = len(starts), first, seq, last
        ends = torch.tensor([cu[i + 1] for i in seq], dtype=torch.long, device=device)
        pos = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(C, device=device)
        self.valid = (pos < ends[:, None]).reshape(-1)                      # [N * C]
        self.idx = torch.where(self.valid, pos.reshape(-1), 0)
        # token t's place in the padded chunks
        self.back = torch.nonzero(self.valid).reshape(-1)

    def chunks(self, x, s=None):
        """[B, T, H, *f] -> [B' H, n, C, *f] for the chunks s (all without; contiguous,
        zero-padded): one copy of a group's tokens, not of the whole sequence."""
        if x is None:
            return None
        B, H, C = self.B, self.H, self.C
        n0, n1 = (0, self.N) if s is None else (s.start, s.stop)
        n, f = n1 - n0, x.shape[3:]
        if self.idx is None:
            x = x[:, n0 * C:n1 * C]
            if x.shape[1] != n * C:
                x = torch.cat([x, x.new_zeros((B, n * C - x.shape[1]) + x.shape[2:])], 1)
            x = x.reshape((B, n, C, H) + f)
        else:
            valid = self.valid[n0 * C:n1 * C]
            x = x[0].index_select(0, self.idx[n0 * C:n1 * C])
            x = torch.where(valid.view((-1,) + (1,) * (x.dim() - 1)), x, torch.zeros((), dtype=x.dtype,
                                                                                    device=x.device))
            x = x.reshape((1, n, C, H) + f)
        return x.permute((0, 3, 1, 2) + tuple(range(4, 4 + len(f)))).reshape((self.Bp * H, n, C) + f)

    def tokens(self, parts, f):
        """The chunk groups [B' H, n, C, *f] in order -> [B, T, H, *f]: the layout change and the
        concatenation are one copy."""
        ys = [y.reshape((self.Bp, self.H, -1) + tuple(f)).transpose(1, 2) for y in parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        return y[:, :self.T] if self.idx is None else y.index_select(1, self.back)


def pair_logs(g, prev, axis):
    """[.., i, j] (scalar g [.., C]: axis -1) or [.., i, j, f] (g [.., C, f]: axis -2): the log
    decay from token j to the query row i, summed per pair over j < s <= i (s <= i - 1 for a
    readout of S_{i-1}), -inf where j is after that row. Summed per pair, never as a difference
    of cumulative sums: a log decay of -inf (a reset) stays -inf (not NaN), and at strong decay
    a neighbour's factor is exp(g) exactly (the difference would round to ulp(b))."""
    C = g.shape[axis]
    ar = torch.arange(C, device=g.device)
    tail = () if axis == -1 else (1,)
    if prev:                 # row i takes the sum up to s = i - 1: g shifted by one token, s > j + 1
        g = torch.cat([torch.zeros_like(g.narrow(axis, 0, 1)), g.narrow(axis, 0, C - 1)], axis)
    after = (ar[:, None] > ar[None, :] + int(prev)).view((C, C) + tail)     # [s, j]: s after j
    # in place on the fresh [C, C] tensor (autograd-safe: none of these saves its input)
    seg = torch.where(after, g.unsqueeze(axis), torch.zeros((), dtype=g.dtype, device=g.device)).cumsum_(axis - 1)
    causal = (ar[:, None] - int(prev) >= ar[None, :]).view((C, C) + tail)
    return seg.masked_fill_(~causal, float("-inf"))


def _groups(N, per_chunk, elements=None):
    step = max(1, (elements or GROUP_ELEMENTS) // max(per_chunk, 1))
    return [slice(n, min(n + step, N)) for n in range(0, N, step)]


def decay_product(X, Y, g, kind, prev):
    """[BH, N, C(i), C(j)]: sum_k X_ik Y_jk exp(the pair's log decay on k), causal (strictly
    below the diagonal with prev). kind: prefix (no decay), scalar (g [BH, N, C]) or key
    (g [BH, N, C, K])."""
    if kind in ("prefix", "scalar"):
        A = X @ Y.transpose(-1, -2)
        if kind == "scalar":
            return A * pair_logs(g, prev, -1).exp_()
        C = A.shape[-1]
        # in place on the matmul's fresh output (its backward keeps X and Y, not A)
        return A.masked_fill_(torch.ones(C, C, dtype=torch.bool, device=A.device).tril(-int(prev)).logical_not(), 0.0)
    BH, N, C, F = X.shape
    # the sub-chunk factors need log decays <= 0, a host read: under torch.compile the pair sums
    if C % SUB == 0 and C > SUB and not torch.compiler.is_compiling() and bool((g.detach() <= 0).all()):
        return key_product(X, Y, g, prev)
    out = []
    for s in _groups(N, BH * C * C * F):
        w = pair_logs(g[:, s], prev, -2).exp_()                               # [BH, n, i, j, K]
        out.append(((X[:, s].unsqueeze(-2) * w) * Y[:, s].unsqueeze(-3)).sum(-1))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


SUB = 8             # the key class's sub-chunk: pairs within one are summed per pair and key


def key_product(X, Y, g, prev):
    """decay_product for a per-key decay, on sub-chunks of SUB tokens (C a multiple of SUB):
    per pair and key (pair_logs) only inside a sub-chunk; across sub-chunks one matmul of
    factored rows, X_i exp(the log decay from its sub-chunk's start to i) against Y_j exp(the
    log decay from j to that start). Each factor is a sum over tokens, never a difference (a
    reset's -inf stays -inf; each factor is at most 1 for log decays <= 0, the only ones the
    caller sends), so every product equals the pair's own factor to rounding. In groups of
    chunks: a tensor past glibc's mmap threshold costs page faults at every op."""
    BH, N, C, F = X.shape
    out = []
    for s in _groups(N, BH * C * 2 * C // SUB * F):
        out.append(_key_product(X[:, s], Y[:, s], g[:, s], prev))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _key_product(X, Y, g, prev):
    BH, N, C, F = X.shape
    n, c = C // SUB, SUB
    gs = g.reshape(BH, N, n, c, F)
    b = gs.cumsum(3)                                                        # within each sub-chunk
    bq = torch.cat([torch.zeros_like(b[:, :, :, :1]), b[:, :, :, :-1]], 3) if prev else b
    sfx = torch.cat([gs.flip(3).cumsum(3).flip(3)[:, :, :, 1:], torch.zeros_like(gs[:, :, :, :1])], 3)
    gap = pair_logs(b[:, :, :, -1], True, -2)            # [BH, N, I, J, F]: the sub-chunks between, J < I
    Ys = Y.reshape(BH, N, 1, n, c, F) * (sfx.unsqueeze(2) + gap.unsqueeze(4)).exp()             # [.., I, J, c, F]
    Xs = X.reshape(BH, N, n, c, F) * bq.exp()
    A = (Xs @ Ys.reshape(BH, N, n, C, F).transpose(-1, -2)).reshape(BH, N, n, c, n, c)
    w = pair_logs(gs, prev, -2).exp_()                                       # [BH, N, n, i, j, F]
    diag = ((X.reshape(BH, N, n, c, 1, F) * w) * Y.reshape(BH, N, n, 1, c, F)).sum(-1)
    eye = torch.eye(n, dtype=X.dtype, device=X.device).view(n, 1, n, 1)
    return (A + diag.unsqueeze(4) * eye).reshape(BH, N, C, C)


def scalar_factors(g, prev):
    """exp(pair_logs(g, prev, -1)) [BH, N, C, C] for a scalar log decay g [BH, N, C], on
    sub-chunks of SUB as key_product: per pair inside a sub-chunk; across sub-chunks the product
    exp(the log decay from its sub-chunk's start to i) exp(the sub-chunks between) exp(from j
    to its sub-chunk's end), each factor a sum over tokens (a reset's -inf gives 0, never NaN:
    every factor is at most 1 for log decays <= 0, the only ones taken here)."""
    BH, N, C = g.shape
    if C % SUB or C <= SUB or torch.compiler.is_compiling() or not bool((g <= 0).all()):
        return pair_logs(g, prev, -1).exp_()
    m, c = C // SUB, SUB
    gs = g.reshape(BH, N, m, c)
    b = gs.cumsum(-1)                                                       # within each sub-chunk
    bq = torch.cat([torch.zeros_like(b[..., :1]), b[..., :-1]], -1) if prev else b
    sfx = torch.cat([gs.flip(-1).cumsum(-1).flip(-1)[..., 1:], torch.zeros_like(gs[..., :1])], -1)
    gap = pair_logs(b[..., -1], True, -1).exp_()           # [BH, N, I, J]: the sub-chunks between, J < I
    rows = bq.exp().unsqueeze(-1) * gap.unsqueeze(-2)                       # [BH, N, I, i, J]
    D = rows.unsqueeze(-1) * sfx.exp().view(BH, N, 1, 1, m, c)              # [BH, N, I, i, J, j]
    D.diagonal(dim1=2, dim2=4).copy_(pair_logs(gs, prev, -1).exp_().permute(0, 1, 3, 4, 2))
    return D.reshape(BH, N, C, C)


def _value_mix(A, V, g, prev):
    """sum_j A_ij exp(the pair's log decay on v) V_jv: the value-diagonal class's intra part."""
    BH, N, C, F = V.shape
    out = []
    for s in _groups(N, BH * C * C * F):
        w = pair_logs(g[:, s], prev, -2).exp_()                               # [BH, n, i, j, V]
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


def nonfinite_rows(*xs):
    """[BH, N, C]: the tokens whose key-side values hold an inf or a NaN (None: none do). One
    sum per tensor first (isfinite over every element costs four passes): a finite sum means
    no inf or NaN; only an overflowing or non-finite one takes the per-row test."""
    xs = [x for x in xs if x is not None]
    # under torch.compile a host read is a graph break (fullgraph fails): always the row test
    tracing = torch.compiler.is_compiling()
    if not tracing and bool(torch.isfinite(torch.stack([x.detach().sum() for x in xs])).all()):
        return None
    bad = None
    for x in xs:
        if x is not None:
            nf = ~torch.isfinite(x).all(-1)
            bad = nf if bad is None else bad | nf
    return bad if bad is not None and (tracing or bool(bad.any())) else None


# the most leading indices _mm loops over (one matmul each) before it takes matmul's copy
MM_LOOP = 16


def _mm(X, Y, acc=None, fast=False):
    """X @ Y over [BH, n, a, b] @ [BH, n, b, c] (plus acc). fast (no autograd graph): per
    leading index on the views as they are, into acc in place. The chunk layout's views of
    [B, T, H, d] have no single stride over [BH, n], so matmul copies them whole; one bmm per
    head reads them with the row stride H d instead."""
    if not fast or X.shape[0] > MM_LOOP:
        P = X @ Y
        return P if acc is None else P.add_(acc)        # in place on the fresh product (autograd-safe)
    if acc is None:
        acc = torch.empty(X.shape[:-1] + Y.shape[-1:], dtype=X.dtype, device=X.device)
        for h in range(X.shape[0]):
            torch.matmul(X[h], Y[h], out=acc[h])
        return acc
    for h in range(X.shape[0]):
        acc[h].baddbmm_(X[h], Y[h])
    return acc


class _Decay:
    """One state's decay over the chunks: its kind for the products (prefix, scalar, key,
    value), g in the chunk layout, its chunk logs, and the scalar pair factors, built once per
    prev and shared by every product. fast: no autograd graph is recorded (fresh
    intermediates are updated in place, _mm's per-head matmuls)."""

    def __init__(self, cls, g, fast=False):
        self.kind = {"rank1": "scalar", "rank1-key": "key"}.get(cls, cls) if g is not None else "prefix"
        self.g, self.fast = g, fast
        self.axis = -1 if self.kind == "scalar" else -2
        self.logs = chunk_logs(g, self.axis) if g is not None else None
        self._pairs = {}

    def product(self, X, Y, prev):
        if self.kind == "scalar":
            if prev not in self._pairs:
                # factored on sub-chunks without autograd (one pass, not four); the backward
                # keeps the per-pair sums' gradients
                self._pairs[prev] = (scalar_factors(self.g, prev) if self.fast
                                     else pair_logs(self.g, prev, -1).exp_())
            A = _mm(X, Y.transpose(-1, -2), fast=self.fast)
            return A.mul_(self._pairs[prev]) if self.fast else A * self._pairs[prev]
        if self.kind == "prefix" and self.fast:
            C = X.shape[-2]
            return _mm(X, Y.transpose(-1, -2), fast=True).masked_fill_(
                torch.ones(C, C, dtype=torch.bool, device=X.device).tril(-int(prev)).logical_not(), 0.0)
        return decay_product(X, Y, self.g, "key" if self.kind == "key" else "prefix", prev)

    def on_keys(self, X, which):
        """X [BH, N, C, K] times exp(the chunk log `which`) (scalar or per key)."""
        if self.g is None:
            return X
        w = self.logs[which].exp()
        return X * (w.unsqueeze(-1) if self.kind == "scalar" else w)

    def last(self):
        """exp(b at the chunk's end), shaped to multiply S [BH, N, KF, VF]."""
        bl = self.logs[1].exp()
        return {"scalar": lambda: bl[..., None, None], "key": lambda: bl.unsqueeze(-1),
                "value": lambda: bl.unsqueeze(-2)}[self.kind]()


def _walk(lay, s, KV, a, S, init, finals, rank1=None):
    """The walk over the chunks s: the state at each one's start [BH, n, KF, VF] (and, rank-1,
    the U [BH, n, C, VF]) and the state after the last, from S after the chunks before (None
    at the first); each sequence's final state goes to finals {seq: [BH, KF, VF]}. Per chunk
    S <- a S + KV (rank-1: U = W0 + Wm S, S <- a S + KV + Lw^T U), resetting to init(seq) at a
    sequence's first chunk."""
    n0, n1 = s.start, s.stop
    if a is None and rank1 is None and lay.idx is None:            # a prefix sum: one cumsum
        S0 = init(0) if n0 == 0 else S
        run = KV.cumsum(1).add_(S0.unsqueeze(1))
        S = run[:, -1]
        if lay.last.get(0) == n1 - 1:
            finals[0] = S
        return torch.cat([S0.unsqueeze(1), run[:, :-1]], 1), None, S
    if lay.fast:
        return _walk_into(lay, s, KV, a, S, init, finals, rank1)
    starts, us = [], []
    KV = KV.unbind(1)                         # one op for all the chunks' views, not a slice per chunk
    a = a.expand(KV[0].shape[:1] + (n1 - n0,) + a.shape[2:]).unbind(1) if a is not None else None
    if rank1 is not None:
        rank1 = tuple(t.unbind(1) for t in rank1)
    for n in range(n0, n1):
        i = n - n0
        if lay.first[n]:
            S = init(lay.seq[n])
        starts.append(S)
        if rank1 is not None:
            W0, Wm, LwT = rank1
            U = torch.baddbmm(W0[i], Wm[i], S)
            us.append(U)
            S = torch.baddbmm(KV[i] + S if a is None else torch.addcmul(KV[i], a[i], S), LwT[i], U)
        else:
            S = KV[i] + S if a is None else torch.addcmul(KV[i], a[i], S)
        if lay.last.get(lay.seq[n]) == n:
            finals[lay.seq[n]] = S
    return torch.stack(starts, 1), (torch.stack(us, 1) if us else None), S


def _walk_into(lay, s, KV, a, S, init, finals, rank1):
    """_walk without autograd: each state written once into one buffer [n + 1, BH, KF, VF] (the
    walk's own outputs, not a stack of them after; chunk-major, so that each is contiguous for
    the matmuls that write it); views unbound once, as in _walk."""
    n0, n1 = s.start, s.stop
    buf = KV.new_empty((n1 - n0 + 1,) + KV.shape[:1] + KV.shape[2:])
    bufs, KVs = buf.unbind(0), KV.unbind(1)
    a = a.expand(KV.shape[:2] + a.shape[2:]).unbind(1) if a is not None else None
    if rank1 is not None:
        us = rank1[0].new_empty((n1 - n0,) + rank1[0].shape[:1] + rank1[0].shape[2:3] + KV.shape[3:])
        W0, Wm, LwT = (t.unbind(1) for t in rank1)
        U = us.unbind(0)
    if not lay.first[n0]:
        bufs[0].copy_(S)
    for n in range(n0, n1):
        i = n - n0
        if lay.first[n]:
            bufs[i].copy_(init(lay.seq[n]))
        if rank1 is not None:
            torch.baddbmm(W0[i], Wm[i], bufs[i], out=U[i])
            base = KVs[i] + bufs[i] if a is None else torch.addcmul(KVs[i], a[i], bufs[i])
            torch.baddbmm(base, LwT[i], U[i], out=bufs[i + 1])
        elif a is None:
            torch.add(KVs[i], bufs[i], out=bufs[i + 1])
        else:
            torch.addcmul(KVs[i], a[i], bufs[i], out=bufs[i + 1])
        if lay.last.get(lay.seq[n]) == n:           # a copy: the next sequence's reset takes this slot
            finals[lay.seq[n]] = bufs[i + 1].clone()
    return buf[:-1].transpose(0, 1), (us.transpose(0, 1) if rank1 is not None else None), bufs[-1]


def _readout_part(dec, terms, K, V, L, S_starts, U, prev):
    """The readouts of a group of chunks [BH, n, C, VF]: the state at each chunk's start plus the
    chunk's own tokens, summed over the readout's terms (query, scale)."""
    total = 0
    for Q, sc in terms:
        if dec.kind == "value":
            val = (Q @ S_starts) * dec.logs[2 if prev else 0].exp() + _value_mix(
                decay_product(Q, K, None, "prefix", prev), V, dec.g, prev)
        else:
            f = dec.fast
            val = _mm(dec.on_keys(Q, 2 if prev else 0), S_starts, fast=f)
            val = _mm(dec.product(Q, K, prev), V, val, fast=f)
            if U is not None:
                val = _mm(dec.product(Q, L, prev), U, val, fast=f)
        if sc is not None:
            val = val.mul_(sc) if dec.fast else val * sc
        total = val if isinstance(total, int) else (total.add_(val) if dec.fast else total + val)
    return total


def torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                          output_final_state=False, C=64):
    """torch_chunk.torch_forward for the specs batched_supported admits: (o [B, T, H, *out dims],
    final states {name: [N, H, *dims]} or None). In groups of chunks, each taken from the
    inputs to the readouts before the next (the state carried between): whole-sequence
    intermediates were fresh tensors past glibc's mmap threshold, page faults at every op, and
    made the forward 1.2-2.5x fla's naive per-chunk loop at T = 4K-16K."""
    STATES, READOUTS = mod.TORCH_STATES, mod.TORCH_READOUTS
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    pc["g"] = {name: _decay_or_none(g) for name, g in pc["g"].items()}
    lay = Layout(B, T, H, C, cu_seqlens, device)
    # no autograd graph: fresh intermediates may be updated in place (the backward needs none)
    lay.fast = not torch.is_grad_enabled() or not any(
        t.requires_grad for t in list(x.values()) + list(p.values()) + list((initial_state or {}).values()))
    BH = lay.Bp * H
    dims = {name: (pc["K"][name].shape[-1], pc["V"][name].shape[-1]) for name in STATES}

    def init(name, i):
        return _initial(initial_state, name, STATES[name], i, cu_seqlens, BH, *dims[name], dtype, device)
    carry = {name: None for name in STATES}
    finals = {name: {} for name in STATES}
    parts = {rname: [] for rname in READOUTS}
    width = max([C] + [d for kv in dims.values() for d in kv])
    for s in _groups(lay.N, BH * C * width, None if lay.fast else GRAD_GROUP_ELEMENTS):
        walked = {}
        for name, st in STATES.items():
            walked[name], carry[name] = _state_group(lay, s, st["class"], pc, name, carry[name],
                                                     lambda i, name=name: init(name, i), finals[name])
        for rname, rd in READOUTS.items():
            K, V, L, dec, S_starts, U, bad = walked[rd["state"]]
            terms = [(lay.chunks(Q, s), lay.chunks(sc, s)) for Q, sc in pc["Q"][rname]]
            total = _readout_part(dec, terms, K, V, L, S_starts, U, rd["prev"])
            if bad is not None:
                seen = bad.cumsum(-1) - (bad.to(torch.long) if rd["prev"] else 0)      # bad tokens up to the row
                total = total.masked_fill((seen > 0).unsqueeze(-1), float("nan"))
            parts[rname].append(total)
    r = {}
    for rname, rd in READOUTS.items():
        vf = dims[rd["state"]][1]
        val = lay.tokens(parts[rname], (vf,)) if parts[rname] else torch.zeros(B, T, H, vf, dtype=dtype,
                                                                             device=device)
        vd = STATES[rd["state"]]["vd"]
        r[rname] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, None)
    if not output_final_state:
        return o, None
    final = {}
    n_seq = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    for name, st in STATES.items():
        kf, vf = dims[name]
        # an empty sequence keeps its initial state
        S = [finals[name][i] if i in finals[name] else init(name, i) for i in range(n_seq)]
        S = torch.cat([s.reshape(lay.Bp, H, kf, vf) for s in S], 0)
        S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
        final[name] = S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]])
    return o, final


def _decay_or_none(g):
    """g, or None for a constant log decay of 0 (the delta rule's: a 0-d zero expanded), whose
    pair factors would all be 1: the products skip them."""
    if g is None or g.requires_grad or any(st != 0 for st in g.stride()) or not g.numel():
        return g
    return None if float(g.reshape(-1)[0]) == 0.0 else g


def _state_group(lay, s, cls, pc, name, S, init, finals):
    """One state over the chunks s: ((K, V, L, its _Decay, the states at the chunks' starts, the
    rank-1 U, the tokens holding inf/NaN or None), the state after them)."""
    K, V = lay.chunks(pc["K"][name], s), lay.chunks(pc["V"][name], s)
    L, R = lay.chunks(pc["L"].get(name), s), lay.chunks(pc["R"].get(name), s)
    vf = V.shape[-1]
    # causality under non-finite input: a token's key-side rows holding inf or NaN are zeroed
    # before the matmuls; the readouts from it on and the states after are NaN
    bad = nonfinite_rows(K, V, L, R)
    if bad is not None:
        K, V, L, R = (t.masked_fill(bad.unsqueeze(-1), 0.0) if t is not None else None for t in (K, V, L, R))
    dec = _Decay(cls, lay.chunks(pc["g"][name], s), lay.fast)
    rank1 = None
    if cls.startswith("rank1"):
        # the WY/UT form (torch_chunk._rank1_setup): (I - A_rl) U = R^ S0 + A_rk V, solved once
        # for the group's chunks as U = W0 + Wm S0, so the walk is two matmuls per chunk
        # (unitriangular: the solve takes the diagonal as 1, so -A_rl serves for I - A_rl)
        A_rl, A_rk = dec.product(R, L, True), dec.product(R, K, True)
        A = A_rl.neg_() if lay.fast else -A_rl
        rhs = torch.cat([_mm(A_rk, V, fast=lay.fast), dec.on_keys(R, 2)], -1)
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        rank1 = (sol[..., :vf], sol[..., vf:], dec.on_keys(L, 3).transpose(-1, -2))
    if dec.kind == "value":
        KV = K.transpose(-1, -2) @ (V * dec.logs[3].exp())
    else:
        KV = _mm((dec.on_keys(K, 3) if dec.g is not None else K).transpose(-1, -2), V, fast=lay.fast)
    if bad is not None:
        KV = KV.masked_fill(bad.any(-1)[..., None, None], float("nan"))
    a = dec.last() if dec.g is not None else None
    S_starts, U, S = _walk(lay, s, KV, a, S, init, finals, rank1)
    return (K, V, L, dec, S_starts, U, bad), S


def _initial(initial_state, name, st, i, cu_seqlens, BH, kf, vf, dtype, device):
    """Sequence i's initial state [BH, KF, VF] (B' = 1 with cu_seqlens), zeros without one."""
    if initial_state is None:
        return torch.zeros(BH, kf, vf, dtype=dtype, device=device)
    s0 = initial_state[name].to(dtype)
    s0 = s0 if cu_seqlens is None else s0[i:i + 1]
    s0 = s0.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]])
    return s0.reshape(BH, kf, vf)

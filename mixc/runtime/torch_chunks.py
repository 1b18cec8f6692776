"""The torch backend's chunked form over all chunks at once: every intra-chunk product is one
batched matmul over [B*H, N chunks, C, dim] (contiguous, one layout change in and one out),
and only the walk of the state from chunk to chunk is a python loop, of one to three fused
ops per chunk (addcmul, baddbmm). The per-chunk loop in torch_chunk.py did ~166 small ops per
chunk on the [B, c, H, dim] layout (einsums that copy), 2-3x fla's naive chunked reference.

The numerics are torch_chunk.py's: decay factors from per-pair sums of the log decay (a decay
of 0 resets; dg exact for neighbours at strong decay), key-side rows holding inf/NaN zeroed
before the matmuls and the readouts from them on NaN. The stabilized (max-tracking) and
elementwise classes stay on torch_chunk.py's loop (`batched_supported`).

Sequences of cu_seqlens are gathered into chunks padded with zeros (a key and value of 0 and a
log decay of 0 leave the state as it is), so one walk serves them all, resetting at each
sequence's first chunk."""
from __future__ import annotations

import torch

# the per-pair decay tensors of the key and value classes ([C, C, dim] per chunk) are built for
# about this many elements at a time (4 MB in float32), a group of chunks each: past glibc's
# mmap threshold every fresh tensor costs page faults, more than the op's own work
GROUP_ELEMENTS = 1 << 20


def batched_supported(mod) -> bool:
    return not mod.TORCH_STABILIZED and all(st["class"] != "elementwise" for st in mod.TORCH_STATES.values())


class Layout:
    """Tokens [B, T, H, *] <-> chunks [B' * H, N, C, *] (B' = 1 with cu_seqlens)."""

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

    def chunks(self, x):
        """[B, T, H, *f] -> [B' H, N, C, *f] (contiguous, zero-padded)."""
        if x is None:
            return None
        B, H, N, C = self.B, self.H, self.N, self.C
        f = x.shape[3:]
        if self.idx is None:
            if N * C != self.T:
                x = torch.cat([x, x.new_zeros((B, N * C - self.T) + x.shape[2:])], 1)
            x = x.reshape((B, N, C, H) + f)
        else:
            x = x[0].index_select(0, self.idx)
            x = torch.where(self.valid.view((-1,) + (1,) * (x.dim() - 1)), x, torch.zeros((), dtype=x.dtype,
                                                                                         device=x.device))
            x = x.reshape((1, N, C, H) + f)
        return x.permute((0, 3, 1, 2) + tuple(range(4, 4 + len(f)))).reshape((self.Bp * H, N, C) + f)

    def tokens(self, y):
        """[B' H, N, C, f] -> [B, T, H, f]."""
        f = y.shape[3:]
        y = y.reshape((self.Bp, self.H, self.N * self.C) + f).transpose(1, 2)
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
    after = (ar[:, None] > ar[None, :]).view((C, C) + tail)                 # [s, j]: s after j
    seg = torch.where(after, g.unsqueeze(axis), torch.zeros((), dtype=g.dtype, device=g.device)).cumsum(axis - 1)
    if prev:                                  # row i takes the sum up to s = i - 1
        seg = torch.cat([torch.zeros_like(seg.narrow(axis - 1, 0, 1)), seg.narrow(axis - 1, 0, C - 1)], axis - 1)
    causal = (ar[:, None] - int(prev) >= ar[None, :]).view((C, C) + tail)
    return seg.masked_fill(~causal, float("-inf"))


def _groups(N, per_chunk):
    step = max(1, GROUP_ELEMENTS // max(per_chunk, 1))
    return [slice(n, min(n + step, N)) for n in range(0, N, step)]


def decay_product(X, Y, g, kind, prev):
    """[BH, N, C(i), C(j)]: sum_k X_ik Y_jk exp(the pair's log decay on k), causal (strictly
    below the diagonal with prev). kind: prefix (no decay), scalar (g [BH, N, C]) or key
    (g [BH, N, C, K])."""
    if kind in ("prefix", "scalar"):
        A = X @ Y.transpose(-1, -2)
        if kind == "scalar":
            return A * pair_logs(g, prev, -1).exp()
        C = A.shape[-1]
        return A.masked_fill(torch.ones(C, C, dtype=torch.bool, device=A.device).tril(-int(prev)).logical_not(), 0.0)
    BH, N, C, F = X.shape
    if C % SUB == 0 and C > SUB and bool((g.detach() <= 0).all()):
        return key_product(X, Y, g, prev)
    out = []
    for s in _groups(N, BH * C * C * F):
        w = pair_logs(g[:, s], prev, -2).exp()                               # [BH, n, i, j, K]
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
    w = pair_logs(gs, prev, -2).exp()                                       # [BH, N, n, i, j, F]
    diag = ((X.reshape(BH, N, n, c, 1, F) * w) * Y.reshape(BH, N, n, 1, c, F)).sum(-1)
    eye = torch.eye(n, dtype=X.dtype, device=X.device).view(n, 1, n, 1)
    return (A + diag.unsqueeze(4) * eye).reshape(BH, N, C, C)


def _value_mix(A, V, g, prev):
    """sum_j A_ij exp(the pair's log decay on v) V_jv: the value-diagonal class's intra part."""
    BH, N, C, F = V.shape
    out = []
    for s in _groups(N, BH * C * C * F):
        w = pair_logs(g[:, s], prev, -2).exp()                               # [BH, n, i, j, V]
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
    if bool(torch.isfinite(torch.stack([x.detach().sum() for x in xs])).all()):
        return None
    bad = None
    for x in xs:
        if x is not None:
            nf = ~torch.isfinite(x).all(-1)
            bad = nf if bad is None else bad | nf
    return bad if bad is not None and bool(bad.any()) else None


class _Decay:
    """One state's decay over the chunks: its kind for the products (prefix, scalar, key,
    value), g in the chunk layout, its chunk logs, and the scalar pair factors, built once per
    prev and shared by every product."""

    def __init__(self, cls, g):
        self.kind = {"rank1": "scalar", "rank1-key": "key"}.get(cls, cls)
        self.g = g
        self.axis = -1 if self.kind == "scalar" else -2
        self.logs = chunk_logs(g, self.axis) if g is not None else None
        self._pairs = {}

    def product(self, X, Y, prev):
        if self.kind == "scalar":
            if prev not in self._pairs:
                self._pairs[prev] = pair_logs(self.g, prev, -1).exp()
            return (X @ Y.transpose(-1, -2)) * self._pairs[prev]
        return decay_product(X, Y, self.g, "key" if self.kind == "key" else "prefix", prev)

    def on_keys(self, X, which):
        """X [BH, N, C, K] times exp(the chunk log `which`) (scalar or per key)."""
        w = self.logs[which].exp()
        return X * (w.unsqueeze(-1) if self.kind == "scalar" else w)

    def last(self):
        """exp(b at the chunk's end), shaped to multiply S [BH, N, KF, VF]."""
        bl = self.logs[1].exp()
        return {"scalar": lambda: bl[..., None, None], "key": lambda: bl.unsqueeze(-1),
                "value": lambda: bl.unsqueeze(-2)}[self.kind]()


def _walk(lay, KV, a, init, rank1=None):
    """The state at every chunk's start [BH, N, KF, VF] (and, rank-1, the U [BH, N, C, VF]),
    and each sequence's final state {seq: [BH, KF, VF]}: S <- a S + KV per chunk (rank-1:
    U = W0 + Wm S, S <- a S + KV + Lw^T U), resetting to init(seq) at a sequence's first chunk."""
    N = lay.N
    if a is None and rank1 is None and lay.idx is None and N:        # a prefix sum: one cumsum
        run = init(0).unsqueeze(1) + KV.cumsum(1)
        return torch.cat([init(0).unsqueeze(1), run[:, :-1]], 1), None, {0: run[:, -1]}
    starts, us, finals, S = [], [], {}, None
    KV = KV.unbind(1)                         # one op for all the chunks' views, not a slice per chunk
    a = a.expand(KV[0].shape[:1] + (N,) + a.shape[2:]).unbind(1) if a is not None else None
    if rank1 is not None:
        rank1 = tuple(t.unbind(1) for t in rank1)
    for n in range(N):
        if lay.first[n]:
            S = init(lay.seq[n])
        starts.append(S)
        if rank1 is not None:
            W0, Wm, LwT = rank1
            U = torch.baddbmm(W0[n], Wm[n], S)
            us.append(U)
            S = torch.baddbmm(torch.addcmul(KV[n], a[n], S), LwT[n], U)
        else:
            S = KV[n] + S if a is None else torch.addcmul(KV[n], a[n], S)
        if lay.last.get(lay.seq[n]) == n:
            finals[lay.seq[n]] = S
    if not N:
        S0 = init(0)
        return S0.new_zeros((S0.shape[0], 0) + S0.shape[1:]), None, finals
    return torch.stack(starts, 1), (torch.stack(us, 1) if us else None), finals


def _readout_part(dec, terms, K, V, L, S_starts, U, prev):
    """The readouts of a group of chunks [BH, n, C, VF]: the state at each chunk's start plus the
    chunk's own tokens, summed over the readout's terms (query, scale)."""
    total = 0
    for Q, sc in terms:
        if dec.g is None:
            val = Q @ S_starts + dec.product(Q, K, prev) @ V
        elif dec.kind == "value":
            val = (Q @ S_starts) * dec.logs[2 if prev else 0].exp() + _value_mix(
                decay_product(Q, K, None, "prefix", prev), V, dec.g, prev)
        else:
            val = dec.on_keys(Q, 2 if prev else 0) @ S_starts + dec.product(Q, K, prev) @ V
            if U is not None:
                val = val + dec.product(Q, L, prev) @ U
        total = total + (val * sc if sc is not None else val)
    return total


def torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                          output_final_state=False, C=64):
    """torch_chunk.torch_forward for the specs batched_supported admits: (o [B, T, H, *out dims],
    final states {name: [N, H, *dims]} or None)."""
    STATES, READOUTS = mod.TORCH_STATES, mod.TORCH_READOUTS
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    lay = Layout(B, T, H, C, cu_seqlens, device)
    nan = float("nan")
    walked, finals = {}, {}
    for name, st in STATES.items():
        K, V = lay.chunks(pc["K"][name]), lay.chunks(pc["V"][name])
        L, R = lay.chunks(pc["L"].get(name)), lay.chunks(pc["R"].get(name))
        kf, vf = K.shape[-1], V.shape[-1]
        # causality under non-finite input: a token's key-side rows holding inf or NaN are
        # zeroed before the matmuls; the readouts from it on and the states after are NaN
        bad = nonfinite_rows(K, V, L, R)
        if bad is not None:
            K, V, L, R = (t.masked_fill(bad.unsqueeze(-1), 0.0) if t is not None else None for t in (K, V, L, R))
        dec = _Decay(st["class"], lay.chunks(pc["g"][name]))

        def init(i, name=name, st=st, kf=kf, vf=vf):
            return _initial(initial_state, name, st, i, cu_seqlens, lay.Bp * H, kf, vf, dtype, device)
        rank1 = None
        if st["class"].startswith("rank1"):
            # the WY/UT form (torch_chunk._rank1_setup): (I - A_rl) U = R^ S0 + A_rk V, solved
            # once for all chunks as U = W0 + Wm S0, so the walk is two matmuls per chunk
            A_rl, A_rk = dec.product(R, L, True), dec.product(R, K, True)
            eye = torch.eye(lay.C, dtype=dtype, device=device)
            rhs = torch.cat([A_rk @ V, dec.on_keys(R, 2)], -1)
            sol = torch.linalg.solve_triangular(eye - A_rl, rhs, upper=False, unitriangular=True)
            rank1 = (sol[..., :vf], sol[..., vf:], dec.on_keys(L, 3).transpose(-1, -2))
        if dec.kind == "value":
            KV = K.transpose(-1, -2) @ (V * dec.logs[3].exp())
        else:
            KV = (dec.on_keys(K, 3) if dec.g is not None else K).transpose(-1, -2) @ V
        if bad is not None:
            KV = KV.masked_fill(bad.any(-1)[..., None, None], nan)
        a = dec.last() if dec.g is not None else None
        S_starts, U, fin = _walk(lay, KV, a, init, rank1)
        walked[name] = (K, V, L, dec, S_starts, U, bad)
        finals[name] = fin
    r = {}
    for rname, rd in READOUTS.items():
        K, V, L, dec, S_starts, U, bad = walked[rd["state"]]
        prev, total = rd["prev"], 0
        terms = [(lay.chunks(Q), lay.chunks(sc)) for Q, sc in pc["Q"][rname]]
        BH, N, C = K.shape[:3]
        parts = []
        # in groups of chunks: the [C, C] products of all chunks at once would be tensors past
        # glibc's mmap threshold (64 MB at T = 16K), each op paying page faults
        for s in _groups(N, BH * C * max(C, K.shape[-1], V.shape[-1])):
            d = _Decay(STATES[rd["state"]]["class"], dec.g[:, s]) if dec.g is not None else dec
            parts.append(_readout_part(d, [(Q[:, s], sc[:, s] if sc is not None else None) for Q, sc in terms],
                                       K[:, s], V[:, s], L[:, s] if L is not None else None, S_starts[:, s],
                                       U[:, s] if U is not None else None, prev))
        total = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        if bad is not None:
            seen = bad.cumsum(-1) - (bad.to(torch.long) if prev else 0)      # bad tokens up to the row
            total = total.masked_fill((seen > 0).unsqueeze(-1), nan)
        val = lay.tokens(total)
        vd = STATES[rd["state"]]["vd"]
        r[rname] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, None)
    if not output_final_state:
        return o, None
    final = {}
    n_seq = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    for name, st in STATES.items():
        kf, vf = pc["K"][name].shape[-1], pc["V"][name].shape[-1]
        S = [finals[name].get(i) for i in range(n_seq)]
        for i, s in enumerate(S):                        # an empty sequence keeps its initial state
            if s is None:
                S[i] = _initial(initial_state, name, st, i, cu_seqlens, lay.Bp * H, kf, vf, dtype, device)
        S = torch.cat([s.reshape(lay.Bp, H, kf, vf) for s in S], 0)
        S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
        final[name] = S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]])
    return o, final


def _initial(initial_state, name, st, i, cu_seqlens, BH, kf, vf, dtype, device):
    """Sequence i's initial state [BH, KF, VF] (B' = 1 with cu_seqlens), zeros without one."""
    if initial_state is None:
        return torch.zeros(BH, kf, vf, dtype=dtype, device=device)
    s0 = initial_state[name].to(dtype)
    s0 = s0 if cu_seqlens is None else s0[i:i + 1]
    s0 = s0.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]])
    return s0.reshape(BH, kf, vf)

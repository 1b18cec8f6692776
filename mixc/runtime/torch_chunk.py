"""The torch backend's chunked form, for CPU tensors without Triton's interpreter: the same
algorithm as the chunked Triton kernel (codegen/chunk.py) in plain torch, autograd giving the
backward. The spec's expressions come from the generated module (codegen/torch_module.py,
templates/torch_chunk.py.j2: torch_pieces, torch_combine and the tables of states and
readouts); the chunk loop below is the same for every spec."""
from __future__ import annotations

import torch

from ..derive.plan import Plan
from .cache import load_module
from .signature import Bound, option_values
from .torch_chunks import batched_supported, torch_forward_batched


# the torch backend's default chunk: 64 for every class (the kernels' C, 16 for a per-key decay,
# is a GPU register budget; here the key class works on sub-chunks inside the chunk, and a
# longer chunk means fewer steps of the sequential walk)
TORCH_CHUNK = 64


def torch_chunked(plan: Plan, bound: Bound, *, output_final_state: bool, dtype: torch.dtype, C: int | None = None):
    """(o [B, T, H, *out dims] in dtype, final states {name: [N, H, *dims]} or None)."""
    C = C or TORCH_CHUNK
    mod = load_module(plan)
    x = {n: t.to(dtype) for n, t in bound.inputs.items()}
    p = {n: t.to(dtype) for n, t in bound.params.items()}
    opt = option_values(plan.ir, bound)
    init = dict(bound.initial_state) if bound.initial_state is not None else None
    return torch_forward(mod, x, p, opt, dict(bound.sizes), bound.B, bound.T, bound.H, initial_state=init,
                         cu_seqlens=bound.cu_seqlens, output_final_state=output_final_state, C=C)


def _pair_logs(g, prev):
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


def _chunk_logs(g):
    """(b: the cumulative log decay, b at the chunk's last token, b_{i-1}, the suffix sums
    sum_{s > j} g_s, g). The suffix sum is the log weight of key j in S_C, summed from the
    chunk's end (bl - b_j would be NaN after a reset and round at strong decay)."""
    b = g.cumsum(1)
    sfx = g.flip(1).cumsum(1).flip(1)
    sfx = torch.cat([sfx[:, 1:], torch.zeros_like(sfx[:, :1])], 1)
    return b, b[:, -1], torch.cat([torch.zeros_like(b[:, :1]), b[:, :-1]], 1), sfx, g


def _readout(kind, Q, K, V, S, bb, prev, logs):
    """[B, c, H, VF]: the readouts of one chunk's tokens (S: the state at the chunk start)."""
    c = Q.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool, device=Q.device).tril(-1 if prev else 0)
    if kind == "prefix":
        A = torch.einsum("bihk,bjhk->bhij", Q, K).masked_fill(~causal, 0.0)
        return torch.einsum("bihk,bhkv->bihv", Q, S) + torch.einsum("bhij,bjhv->bihv", A, V)
    b, _, b_excl, _, g = bb
    bq = b_excl if prev else b
    if kind == "scalar":                                                     # g: [B, c, H]
        diff, b0 = _pair_logs(g, prev), bq                                    # [B, i, j, H]
        if logs is not None:        # stabilized: m off each query row, the gate on the keys
            mrow, gi, M0, _ = logs
            diff, b0 = diff - mrow.unsqueeze(2) + gi.unsqueeze(1), bq + M0.unsqueeze(1) - mrow
        A = torch.einsum("bihk,bjhk->bhij", Q, K) * torch.exp(diff.permute(0, 3, 1, 2))
        return (torch.einsum("bihk,bhkv->bihv", Q * b0.exp().unsqueeze(-1), S)
                + torch.einsum("bhij,bjhv->bihv", A, V))
    if kind == "elementwise":                                                # g: [B, c, H, K, V]
        w = torch.exp(_pair_logs(g, prev))
        return (torch.einsum("bthk,bhkv,bthkv->bthv", Q, S, bq.exp())
                + torch.einsum("bthk,bjhk,bjhv,btjhkv->bthv", Q, K, V, w))
    if kind == "key":                                                        # g: [B, c, H, K]
        w = torch.exp(_pair_logs(g, prev))                                    # [B, i, j, H, K]
        A = torch.einsum("bihk,bjhk,bijhk->bhij", Q, K, w)
        return torch.einsum("bihk,bhkv->bihv", Q * bq.exp(), S) + torch.einsum("bhij,bjhv->bihv", A, V)
    A = torch.einsum("bihk,bjhk->bhij", Q, K).masked_fill(~causal, 0.0)      # value: g [B, c, H, V]
    w = torch.exp(_pair_logs(g, prev))
    return torch.einsum("bihk,bhkv->bihv", Q, S) * bq.exp() + torch.einsum("bhij,bijhv,bjhv->bihv", A, w, V)


def _rank1_setup(kind, L, R, K, V, S, bb):
    """The WY/UT form of a chunk of S_t = D_t S_{t-1} + l_t (r_t . S_{t-1}) + k_t v_t^T (D_t =
    exp(g_t), a scalar or per key). With b the cumulative log decay in the chunk, the state
    divided by the decay, X_t = exp(-b_t) S_t, gains l~_t u_t^T + k~_t v_t^T per token, where
    u_t = r~_t . X_{t-1}; over the chunk the u solve one unit lower-triangular system:

        (I - A_rl) U = R^ S0 + A_rk V,   A_xy[j, i] = sum_k x_jk y_ik exp(b_{j-1,k} - b_ik), i < j

    with R^ = R * exp(b_{j-1}) (each exp(b_{j-1} - b_i) summed per pair: _pair_logs).
    Returns (U [B, c, H, VF], the chunk's logs per key: _chunk_logs)."""
    if kind == "rank1":                     # a scalar decay: the same on every key
        bb = tuple(x.unsqueeze(-1).expand(x.shape + K.shape[-1:]) for x in bb)
    c = K.shape[1]
    E = torch.exp(_pair_logs(bb[4], True))                                  # [B, j, i, H, K]
    A_rl = torch.einsum("bjhk,bihk,bjihk->bhji", R, L, E)
    A_rk = torch.einsum("bjhk,bihk,bjihk->bhji", R, K, E)
    Y = torch.einsum("bjhk,bhkv->bhjv", R * bb[2].exp(), S) + torch.einsum("bhji,bihv->bhjv", A_rk, V)
    eye = torch.eye(c, dtype=K.dtype, device=K.device)
    U = torch.linalg.solve_triangular(eye - A_rl, Y, upper=False, unitriangular=True)
    return U.permute(0, 2, 1, 3), bb


def _rank1_readout(Q, L, K, V, S, U, bb, prev):
    """q . S_t (or S_{t-1}) for the chunk's rows: X_0 = S0 and the l~ u, k~ v terms so far."""
    bq = bb[2] if prev else bb[0]
    w = torch.exp(_pair_logs(bb[4], prev))
    A_ql = torch.einsum("bthk,bjhk,btjhk->bhtj", Q, L, w)
    A_qk = torch.einsum("bthk,bjhk,btjhk->bhtj", Q, K, w)
    return (torch.einsum("bthk,bhkv->bthv", Q * bq.exp(), S) + torch.einsum("bhtj,bjhv->bthv", A_ql, U)
            + torch.einsum("bhtj,bjhv->bthv", A_qk, V))


def _rank1_advance(L, K, V, S, U, bb):
    """S_C = exp(b_C) S0 + (L * exp(b_C - b))^T U + (K * exp(b_C - b))^T V."""
    bl, w = bb[1], torch.exp(bb[3])
    return (bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", L * w, U)
            + torch.einsum("bjhk,bjhv->bhkv", K * w, V))


def _advance(kind, K, V, S, bb, logs):
    """The state at the chunk's end."""
    if kind == "prefix":
        return S + torch.einsum("bjhk,bjhv->bhkv", K, V)
    _, bl, _, sfx, _ = bb
    if kind == "scalar":
        if logs is not None:
            _, gi, M0, mnew = logs
            w = torch.exp(sfx + gi - mnew.unsqueeze(1))
            return torch.exp(bl + M0 - mnew)[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)
        w = torch.exp(sfx)                                                    # [B, c, H]
        return bl.exp()[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)
    w = torch.exp(sfx)
    if kind == "elementwise":                                                # [B, c, H, K, V]
        return bl.exp() * S + torch.einsum("bjhk,bjhv,bjhkv->bhkv", K, V, w)
    if kind == "key":                                                        # [B, c, H, K]
        return bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", K * w, V)
    return S * bl.exp().unsqueeze(-2) + torch.einsum("bjhk,bjhv->bhkv", K, V * w)


def _nonfinite_rows(*xs):
    """[B, c, H]: the tokens whose key-side values (key, value, the rank-1 vectors) hold an inf
    or a NaN. They are zeroed before any matmul (0 * inf would be NaN in every row the matmul
    mixes them into, earlier tokens included) and their rows on are set to NaN instead."""
    bad = None
    for x in xs:
        if x is not None:
            nf = ~torch.isfinite(x).flatten(3).all(-1)
            bad = nf if bad is None else bad | nf
    return bad


def torch_forward(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None, output_final_state=False,
                  C=64):
    """(o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None) of the generated
    module `mod`: inputs x [B, T, H, *dims] and params p [H, *dims] in the compute dtype,
    options opt (numbers). All chunks at once (torch_chunks.py) where the spec allows, else
    the loop over chunks below (the stabilized and elementwise classes)."""
    if batched_supported(mod):
        return torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens, output_final_state=output_final_state, C=C)
    return torch_forward_loop(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              output_final_state=output_final_state, C=C)


def torch_forward_loop(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                       output_final_state=False, C=64):
    """torch_forward, one chunk at a time (for every class)."""
    TORCH_STATES, TORCH_READOUTS, TORCH_STABILIZED = mod.TORCH_STATES, mod.TORCH_READOUTS, mod.TORCH_STABILIZED
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    segments = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    rows = slice(None) if cu_seqlens is None else slice(0, 1)
    Bs = B if cu_seqlens is None else 1
    # Every per-token piece is split once into the chunks of every sequence (cu_seqlens runs
    # from 0 to T): slicing each chunk out on its own costs, in the backward, a zero-filled
    # full-length gradient per chunk (O(T^2 / C): the superlinear growth `mixc bench` showed
    # past T = 4096); the backward of one split concatenates once.
    lengths = [min(C, end - c0) for start, end in segments for c0 in range(start, end, C)]

    def split(t):
        return None if t is None else t[rows].split(lengths, 1)
    ch = {k: {n: split(t) for n, t in pc[k].items()} for k in ("K", "V", "g", "L", "R")}
    ch_q = {r: [(split(Q), split(sc)) for Q, sc in terms] for r, terms in pc["Q"].items()}
    ch_gate = split(pc["gate"])
    ci = -1                                   # the running chunk index over all sequences
    readout_vals = {r: [] for r in TORCH_READOUTS}
    finals = {s: [] for s in TORCH_STATES}
    m_rows = []
    for i_seq, (start, end) in enumerate(segments):
        states = {}
        for name, st in TORCH_STATES.items():
            kf, vf = pc["K"][name].shape[-1], pc["V"][name].shape[-1]
            if initial_state is not None:
                s0 = initial_state[name].to(dtype)
                s0 = s0 if cu_seqlens is None else s0[i_seq:i_seq + 1]
                s0 = s0.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]]).reshape(
                    s0.shape[0], H, kf, vf)
            else:
                s0 = torch.zeros(Bs, H, kf, vf, dtype=dtype, device=device)
            states[name] = s0
        M = torch.zeros(Bs, H, dtype=dtype, device=device)        # the stabilizer's m_0 = 0
        outs = {r: [] for r in TORCH_READOUTS}
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)
            ci += 1
            K_, V_, L_, R_ = ({n: v[ci] for n, v in ch[k].items() if v is not None} for k in ("K", "V", "L", "R"))
            # causality under non-finite input: the key-side rows of a token holding inf or NaN
            # are zeroed before the matmuls, and the readouts from that token on are NaN
            gi = ch_gate[ci] if TORCH_STABILIZED else None
            gate_bad = ~torch.isfinite(gi) if gi is not None else None
            bad = {}
            for name in TORCH_STATES:
                bad[name] = _nonfinite_rows(K_[name], V_[name], L_.get(name), R_.get(name))
                if name in TORCH_STABILIZED:
                    bad[name] = bad[name] | gate_bad
                for part in (K_, V_, L_, R_):
                    if name in part:
                        part[name] = part[name].masked_fill(bad[name].unsqueeze(-1), 0.0)
            if gi is not None:
                gi = gi.masked_fill(gate_bad, 0.0)
            chunk_b = {}
            for name in TORCH_STATES:
                if ch["g"][name] is not None:
                    chunk_b[name] = _chunk_logs(ch["g"][name][ci])
            logs = None
            if TORCH_STABILIZED:
                b, bl, _, sfx, g = chunk_b[TORCH_STABILIZED[0]]
                L = _pair_logs(g, False) + gi.unsqueeze(1)                       # [B, i, j, H]
                # m is a scale the gradients hold constant
                mrow = torch.maximum(L.amax(2), b + M.unsqueeze(1)).detach()
                mnew = torch.maximum(bl + M, (sfx + gi).amax(1)).detach()
                logs = (mrow, gi, M, mnew)
                m_rows.append(mrow)
            wy = {}
            for name, st in TORCH_STATES.items():
                if st["class"].startswith("rank1"):
                    wy[name] = _rank1_setup(st["class"], L_[name], R_[name], K_[name], V_[name], states[name],
                                            chunk_b[name])
            for r, rd in TORCH_READOUTS.items():
                s = rd["state"]
                total = 0
                for Q, sc in ch_q[r]:
                    if s in wy:
                        val = _rank1_readout(Q[ci], L_[s], K_[s], V_[s], states[s], *wy[s], rd["prev"])
                    else:
                        val = _readout(TORCH_STATES[s]["class"], Q[ci], K_[s], V_[s], states[s], chunk_b.get(s),
                                       rd["prev"], logs if s in TORCH_STABILIZED else None)
                    total = total + (val * sc[ci] if sc is not None else val)
                seen = bad[s].cumsum(1) - (bad[s].to(torch.long) if rd["prev"] else 0)      # bad tokens up to the row
                outs[r].append(total.masked_fill((seen > 0).unsqueeze(-1), float("nan")))
            for name, st in TORCH_STATES.items():
                if name in wy:
                    states[name] = _rank1_advance(L_[name], K_[name], V_[name], states[name], wy[name][0],
                                                  wy[name][1])
                    continue
                states[name] = _advance(st["class"], K_[name], V_[name], states[name], chunk_b.get(name),
                                        logs if name in TORCH_STABILIZED else None)
            for name in TORCH_STATES:
                states[name] = states[name].masked_fill(bad[name].any(1)[:, :, None, None], float("nan"))
            if logs is not None:
                M = logs[3]
        for r, rd in TORCH_READOUTS.items():
            vf = pc["V"][rd["state"]].shape[-1]
            readout_vals[r].append(torch.cat(outs[r], 1) if outs[r] else
                                   torch.zeros(Bs, 0, H, vf, dtype=dtype, device=device))
        for name, st in TORCH_STATES.items():
            S = states[name]
            if name in TORCH_STABILIZED:        # the spec's state: S~ exp(m)
                S = S * torch.exp(M)[:, :, None, None]
            S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
            finals[name].append(S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]]))
    r = {}
    for name, rd in TORCH_READOUTS.items():
        val = torch.cat(readout_vals[name], 1)
        vd = TORCH_STATES[rd["state"]]["vd"]
        r[name] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    m = (torch.cat(m_rows, 1) if m_rows else torch.zeros(B, 0, H, dtype=dtype, device=device)) \
        if TORCH_STABILIZED else None
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, m)
    final = {k: torch.cat(v, 0) for k, v in finals.items()} if output_final_state else None
    return o, final

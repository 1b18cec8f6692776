"""The chunked Triton kernels of a 2x2 block-affine system (class "block-affine system",
classes/block_affine.py; Titans' memory with momentum): mode "chunk".

Notation (docs/design-notes.md, "Coupled states are one block-affine system" and "The chunked
kernels of a block-affine system"): two states X0, X1 [K, V] per head in the order where the
2x2 gates are lower triangular; per token t

    X0_t = a_t X0_{t-1}                 + u0_t r_t^T + k0_t v0_t^T
    X1_t = c_t X0_{t-1} + d_t X1_{t-1}  + u1_t r_t^T + k1_t v1_t^T,    r_t = X*_{t-1}^T w_t

(X* = X_READ), one readout o_t = X_QS,t^T q_t (X_QS,t-1 with PREV). The kernels take these
per-token pieces (log a, c, log d [N, H]; w, u0, u1, k0, k1, q [N, H, K]; v0, v1 [N, H, V]: the
generated module's torch_pieces computes them from the spec's inputs, and autograd carries
their gradients back to the inputs: runtime/system_chunk.py) and work in chunks of C tokens with
the 2x2 products P[m, n] = D_m ... D_{n+1} of the gates (every entry a product of gates, never
an inverse), held as [C, C] matrices over the chunk's rows i, j:

    Pin_ab[i, j] = P[i+1, j+1]_ab (j <= i),  Pex_ab[i, j] = P[i, j+1]_ab (j < i)
    p0in_ab[i] = P[i+1, 0]_ab,  p0ex_ab[i] = P[i, 0]_ab,  last_ab[j] = P[C, j+1]_ab,  pl_ab = P[C, 0]_ab
    P00 = exp(A_m - A_n), P11 = exp(G_m - G_n) (A, G cumulative log a, log d), P10 = P11 (c P00)

(a padded row past the sequence's end has a = d = 1 and zero pieces: the identity, so the
chunk's last row is its last token's). Per chunk, R = (r_t) solves (I - M) R = rhs with M
strictly lower triangular (the predictions), then the outputs and the states at the chunk's end
are [C, C] products with R and the values.

Kernels, one per stage: system_chunk_fwd (one program per (sequence, head, block of V) walks the
sequence's chunks in order, both states in registers; stores the outputs, each chunk's start
states (the backward's checkpoints) and the final states) and system_chunk_bwd (the same
programs walk the chunks in reverse from the checkpoints, dL/dX0 and dL/dX1 in registers: the
adjoint of each chunk step, derived in docs/design-notes.md). Gradients of what lacks the V dim
(gates, w, u, k, q) are one partial per V block, summed by the host."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(x, y, DOT: tl.constexpr):
    """A [M, K] x [K, N] matmul in fp32: exact fp32 products (0: the interpreter) or three TF32
    products on tensor cores (3: fp32's accuracy on a GPU)."""
    if DOT == 3:
        return tl.dot(x, y, input_precision="tf32x3")
    else:
        return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _unit_lower_inverse(M, offs, C: tl.constexpr):
    """(I - M)^-1 for a strictly lower-triangular M [C, C]: forward substitution on the
    identity, a row at a time (row j needs the rows above it, final already)."""
    X = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    for j in range(1, C):
        m = tl.sum(tl.where(offs[:, None] == j, M, 0.0), axis=0)                 # row j of M [C]
        X = tl.where(offs[:, None] == j, X + tl.sum(m[:, None] * X, axis=0)[None, :], X)
    return X


@triton.jit
def _gate_products(la, ld, c, offs, C: tl.constexpr, DOT: tl.constexpr):
    """The chunk's 2x2 gate products (module docstring) from log a, log d, c [C]."""
    inc = offs[:, None] >= offs[None, :]
    exc = offs[:, None] > offs[None, :]
    shift = offs[:, None] - 1 == offs[None, :]
    # a gate of 0 (log -inf) is a reset: counted apart (za, zd: resets at or before each row) and
    # 0 in the sums, a pair of boundaries with a reset between them weighs 0
    ra = la == float('-inf')
    rd = ld == float('-inf')
    A = tl.cumsum(tl.where(ra, 0.0, la), axis=0)                                  # [C]
    G = tl.cumsum(tl.where(rd, 0.0, ld), axis=0)
    za = tl.cumsum(tl.where(ra, 1.0, 0.0), axis=0)
    zd = tl.cumsum(tl.where(rd, 1.0, 0.0), axis=0)
    Ap = tl.sum(tl.where(shift, A[None, :], 0.0), axis=1)                         # A one row down: exact
    Gp = tl.sum(tl.where(shift, G[None, :], 0.0), axis=1)
    zap = tl.sum(tl.where(shift, za[None, :], 0.0), axis=1)
    zdp = tl.sum(tl.where(shift, zd[None, :], 0.0), axis=1)
    Al = tl.sum(tl.where(offs == C - 1, A, 0.0), axis=0)                          # the chunk's end
    Gl = tl.sum(tl.where(offs == C - 1, G, 0.0), axis=0)
    zal = tl.sum(tl.where(offs == C - 1, za, 0.0), axis=0)
    zdl = tl.sum(tl.where(offs == C - 1, zd, 0.0), axis=0)
    ia = inc & (za[:, None] == za[None, :])
    id = inc & (zd[:, None] == zd[None, :])
    ea = exc & (zap[:, None] == za[None, :])
    ed = exc & (zdp[:, None] == zd[None, :])
    Pin00 = tl.where(ia, tl.exp(tl.where(ia, A[:, None] - A[None, :], 0.0)), 0.0)       # [C, C]
    Pin11 = tl.where(id, tl.exp(tl.where(id, G[:, None] - G[None, :], 0.0)), 0.0)
    Pex00 = tl.where(ea, tl.exp(tl.where(ea, Ap[:, None] - A[None, :], 0.0)), 0.0)
    Pex11 = tl.where(ed, tl.exp(tl.where(ed, Gp[:, None] - G[None, :], 0.0)), 0.0)
    p0in00 = tl.where(za == 0, tl.exp(A), 0.0)                                    # [C]
    p0in11 = tl.where(zd == 0, tl.exp(G), 0.0)
    p0ex00 = tl.where(zap == 0, tl.exp(Ap), 0.0)
    p0ex11 = tl.where(zdp == 0, tl.exp(Gp), 0.0)
    last00 = tl.where(za == zal, tl.exp(Al - A), 0.0)
    last11 = tl.where(zd == zdl, tl.exp(Gl - G), 0.0)
    pl00 = tl.where(zal == 0, tl.exp(Al), 0.0)
    pl11 = tl.where(zdl == 0, tl.exp(Gl), 0.0)
    cP = c[:, None] * Pex00                                                       # c_r P00[r-1, n]
    cp = c * p0ex00
    Pin10 = _dot(Pin11, cP, DOT)
    Pex10 = _dot(Pex11, cP, DOT)
    p0in10 = tl.sum(Pin11 * cp[None, :], axis=1)
    p0ex10 = tl.sum(Pex11 * cp[None, :], axis=1)
    last10 = tl.sum(last11[:, None] * cP, axis=0)
    pl10 = tl.sum(last11 * cp, axis=0)
    return (Pin00, Pin11, Pin10, Pex00, Pex11, Pex10, p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10,
            last00, last11, last10, pl00, pl11, pl10, A, G, Ap, Gp, Al, Gl, cP, cp)


@triton.jit
def _read_rows(Pex00, Pex11, Pex10, p0ex00, p0ex11, p0ex10, READ: tl.constexpr):
    """The row of the (exclusive) products the rank-1 read meets, one definition for the forward
    and its adjoint: X* = X0 reads P00 (no P01); X* = X1 reads P10 and P11.
    Returns (E0, E1 [C, C], e0, e1 [C])."""
    if READ == 1:
        return Pex10, Pex11, p0ex10, p0ex11
    else:
        return Pex00, Pex00 * 0.0, p0ex00, p0ex00 * 0.0


@triton.jit
def _readout_rows(Pin00, Pin11, Pin10, Pex00, Pex11, Pex10, p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10,
                  QS: tl.constexpr, PREV: tl.constexpr):
    """The row of the products the readout of X_QS meets (at t: inclusive; at t-1 with PREV:
    exclusive), one definition for the forward and its adjoint. Returns (F0, F1 [C, C], f0, f1 [C])."""
    if QS == 1:
        if PREV:
            return Pex10, Pex11, p0ex10, p0ex11
        else:
            return Pin10, Pin11, p0in10, p0in11
    else:
        if PREV:
            return Pex00, Pex00 * 0.0, p0ex00, p0ex00 * 0.0
        else:
            return Pin00, Pin00 * 0.0, p0in00, p0in00 * 0.0


@triton.jit
def _nonfinite_rows(x):
    """[C] 1 where a row of x [C, N] holds inf or NaN (x - x is NaN there, 0 elsewhere)."""
    return tl.max(tl.where((x - x) != 0.0, 1, 0), axis=1)


@triton.jit
def _bad_rows(la, ld, c, W, U0, U1, K0, K1, V0, V1):
    """[C] 1 at a token whose key-side pieces (w, the lefts, the input terms, c) hold inf or NaN
    or whose log gate is NaN or +inf (-inf is a gate of 0: a reset), as the torch form's
    _finite_rows (runtime/torch_system.py): its pieces are zeroed before the chunk's matmuls (a
    masked 0 times a NaN would reach the earlier rows of the chunk), and the readouts from it on
    and the states at the chunk's end are NaN. A value's inf or NaN is seen by the program of its
    block of V (its columns only, as the recurrence spreads it)."""
    gates = tl.where(~(la < float('inf')) | ~(ld < float('inf')) | ((c - c) != 0.0), 1, 0)
    keys = tl.maximum(tl.maximum(_nonfinite_rows(W), _nonfinite_rows(U0)),
                      tl.maximum(_nonfinite_rows(U1), tl.maximum(_nonfinite_rows(K0), _nonfinite_rows(K1))))
    return tl.maximum(gates, tl.maximum(keys, tl.maximum(_nonfinite_rows(V0), _nonfinite_rows(V1))))


@triton.jit
def _zero_rows(bad, la, ld, c, W, U0, U1, K0, K1, V0, V1):
    """The pieces with a bad token's rows zeroed (_bad_rows), for the forward and its adjoint alike
    (the tests on the int rows, broadcast first: a broadcast i1 block cannot pass through shared
    memory on sm_90)."""
    return (tl.where(bad == 0, la, 0.0), tl.where(bad == 0, ld, 0.0), tl.where(bad == 0, c, 0.0),
            tl.where(bad[:, None] == 0, W, 0.0), tl.where(bad[:, None] == 0, U0, 0.0),
            tl.where(bad[:, None] == 0, U1, 0.0), tl.where(bad[:, None] == 0, K0, 0.0),
            tl.where(bad[:, None] == 0, K1, 0.0), tl.where(bad[:, None] == 0, V0, 0.0),
            tl.where(bad[:, None] == 0, V1, 0.0))


@triton.jit
def system_chunk_fwd(p_la, p_c, p_ld, p_w, p_u0, p_u1, p_k0, p_v0, p_k1, p_v1, p_q,
                     p_init0, p_init1, p_out, p_final0, p_final1, p_ck0, p_ck1, p_cu,
                     H, KF, VF,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ: tl.constexpr,
                     QS: tl.constexpr, PREV: tl.constexpr, USE_INIT: tl.constexpr, DOT: tl.constexpr):
    """The forward: one program per (sequence, head, block of V) walks the sequence's chunks.
    Reads the pieces (scalars [N, H], key-side [N, H, K], values [N, H, V]) and the initial
    states [S, H, K, V]; writes o [N, H, V], the states at every chunk's start (checkpoints
    [slots, H, K, V], sequence i's chunks from bos_i // C + i) and the final states."""
    i_n = tl.program_id(0) // H
    i_h = tl.program_id(0) % H
    i_v = tl.program_id(1)
    bos = tl.load(p_cu + i_n).to(tl.int64)
    eos = tl.load(p_cu + i_n + 1).to(tl.int64)
    offs = tl.arange(0, C)                                                        # the chunk's rows
    ok_k = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok_k < KF
    mv = ov < VF
    st = (i_n * H + i_h).to(tl.int64) * KF * VF + ok_k[:, None] * VF + ov[None, :]      # [K, V]
    ms = mk[:, None] & mv[None, :]
    X0 = tl.zeros([BK, BV], dtype=tl.float32)
    X1 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INIT:
        X0 = tl.load(p_init0 + st, mask=ms, other=0.0).to(tl.float32)
        X1 = tl.load(p_init1 + st, mask=ms, other=0.0).to(tl.float32)
    n_chunks = (eos - bos + C - 1) // C
    for ch in range(0, n_chunks):
        rows = bos + ch * C + offs                                                # token rows [C]
        mrow = rows < eos
        hr = rows * H + i_h                                                       # (token, head) rows
        slot = (bos // C + i_n + ch) * H + i_h
        ck = slot * KF * VF + ok_k[:, None] * VF + ov[None, :]
        tl.store(p_ck0 + ck, X0, mask=ms)                                         # this chunk's start states
        tl.store(p_ck1 + ck, X1, mask=ms)
        la = tl.load(p_la + hr, mask=mrow, other=0.0).to(tl.float32)              # [C]; padded rows: a = d = 1
        ld = tl.load(p_ld + hr, mask=mrow, other=0.0).to(tl.float32)
        c = tl.load(p_c + hr, mask=mrow, other=0.0).to(tl.float32)
        mck = mrow[:, None] & mk[None, :]
        mcv = mrow[:, None] & mv[None, :]
        kk = hr[:, None] * KF + ok_k[None, :]                                     # [C, K]
        vv = hr[:, None] * VF + ov[None, :]                                       # [C, V]
        W = tl.load(p_w + kk, mask=mck, other=0.0).to(tl.float32)
        U0 = tl.load(p_u0 + kk, mask=mck, other=0.0).to(tl.float32)
        U1 = tl.load(p_u1 + kk, mask=mck, other=0.0).to(tl.float32)
        K0 = tl.load(p_k0 + kk, mask=mck, other=0.0).to(tl.float32)
        K1 = tl.load(p_k1 + kk, mask=mck, other=0.0).to(tl.float32)
        Q = tl.load(p_q + kk, mask=mck, other=0.0).to(tl.float32)
        V0 = tl.load(p_v0 + vv, mask=mcv, other=0.0).to(tl.float32)
        V1 = tl.load(p_v1 + vv, mask=mcv, other=0.0).to(tl.float32)
        bad = _bad_rows(la, ld, c, W, U0, U1, K0, K1, V0, V1)                      # [C] (_bad_rows)
        la, ld, c, W, U0, U1, K0, K1, V0, V1 = _zero_rows(bad, la, ld, c, W, U0, U1, K0, K1, V0, V1)
        (Pin00, Pin11, Pin10, Pex00, Pex11, Pex10, p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10,
         last00, last11, last10, pl00, pl11, pl10, A, G, Ap, Gp, Al, Gl, cP, cp) = _gate_products(la, ld, c, offs, C, DOT)
        # the read row of the products: X* = X0 reads P00 (and no P01); X* = X1 reads P10, P11
        E0, E1, e0, e1 = _read_rows(Pex00, Pex11, Pex10, p0ex00, p0ex11, p0ex10, READ)
        # the predictions: (I - M) R = e0 (W X0) + e1 (W X1) + (E0 * W K0^T) V0 + (E1 * W K1^T) V1
        M = E0 * _dot(W, tl.trans(U0), DOT) + E1 * _dot(W, tl.trans(U1), DOT)           # [C, C]
        rhs = (e0[:, None] * _dot(W, X0, DOT) + e1[:, None] * _dot(W, X1, DOT)
               + _dot(E0 * _dot(W, tl.trans(K0), DOT), V0, DOT) + _dot(E1 * _dot(W, tl.trans(K1), DOT), V1, DOT))
        R = _dot(_unit_lower_inverse(M, offs, C), rhs, DOT)                              # [C, V]
        # the readout of X_QS (at t, or t-1 with PREV): its row of the products
        F0, F1, f0, f1 = _readout_rows(Pin00, Pin11, Pin10, Pex00, Pex11, Pex10,
                                       p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10, QS, PREV)
        o = (f0[:, None] * _dot(Q, X0, DOT) + f1[:, None] * _dot(Q, X1, DOT)
             + _dot(F0 * _dot(Q, tl.trans(U0), DOT) + F1 * _dot(Q, tl.trans(U1), DOT), R, DOT)
             + _dot(F0 * _dot(Q, tl.trans(K0), DOT), V0, DOT) + _dot(F1 * _dot(Q, tl.trans(K1), DOT), V1, DOT))
        seen = tl.cumsum(bad, axis=0)                                             # bad tokens up to each readout
        if PREV:
            seen = seen - bad
        tl.store(p_out + vv, tl.where(seen[:, None] > 0, float('nan'), o), mask=mcv)
        # the states at the chunk's end: X_i = sum_l pl_il X_l + U_l^T (last_il R) + K_l^T (last_il V_l)
        Xn0 = pl00 * X0 + _dot(tl.trans(U0), last00[:, None] * R, DOT) + _dot(tl.trans(K0), last00[:, None] * V0, DOT)
        X1 = (pl10 * X0 + pl11 * X1
              + _dot(tl.trans(U0), last10[:, None] * R, DOT) + _dot(tl.trans(K0), last10[:, None] * V0, DOT)
              + _dot(tl.trans(U1), last11[:, None] * R, DOT) + _dot(tl.trans(K1), last11[:, None] * V1, DOT))
        X0 = tl.where(tl.max(bad, axis=0) > 0, float('nan'), Xn0)
        X1 = tl.where(tl.max(bad, axis=0) > 0, float('nan'), X1)
    tl.store(p_final0 + st, X0, mask=ms)
    tl.store(p_final1 + st, X1, mask=ms)


@triton.jit
def _rowsum(x):
    return tl.sum(x, axis=1)


@triton.jit
def _colsum(x):
    return tl.sum(x, axis=0)


@triton.jit
def _log_gate_grad(dPin, Pin, dPex, Pex, dp0in, p0in, dp0ex, p0ex, dlast, last, dpl, pl, offs, C: tl.constexpr):
    """dL/d(log gate) [C] of one diagonal family (P00 from log a, or P11 from log d) from the
    gradients of its products: each is exp of a difference of cumulative sums X (X_p: one row
    down, X_l: the chunk's end), so dX_i collects row sums minus column sums of dP * P, and the
    log gate's gradient is dX's suffix sum."""
    Tin = dPin * Pin
    Tex = dPex * Pex
    dX = _rowsum(Tin) - _colsum(Tin) - _colsum(Tex) + dp0in * p0in - dlast * last
    dXp = _rowsum(Tex) + dp0ex * p0ex                                             # d X_{i-1}
    dXl = tl.sum(dlast * last, axis=0) + dpl * pl
    dX = dX + tl.sum(tl.where(offs[:, None] + 1 == offs[None, :], dXp[None, :], 0.0), axis=1)
    dX = dX + tl.where(offs == C - 1, dXl, 0.0)
    return tl.sum(tl.where(offs[None, :] >= offs[:, None], dX[None, :], 0.0), axis=1)


@triton.jit
def system_chunk_bwd(p_la, p_c, p_ld, p_w, p_u0, p_u1, p_k0, p_v0, p_k1, p_v1, p_q,
                     p_ck0, p_ck1, p_do, p_dfinal0, p_dfinal1, p_cu,
                     p_dla, p_dc, p_dld, p_dw, p_du0, p_du1, p_dk0, p_dv0, p_dk1, p_dv1, p_dq,
                     p_dinit0, p_dinit1,
                     H, KF, VF, NTOK,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ: tl.constexpr,
                     QS: tl.constexpr, PREV: tl.constexpr, USE_DFINAL: tl.constexpr, DOT: tl.constexpr):
    """The backward: the forward's programs walk the chunks last to first with dL/dX0, dL/dX1
    at the chunk's end in registers; each chunk recomputes its forward from its checkpoints
    and applies the adjoint of its step (docs/design-notes.md). Writes the pieces' gradients
    (those without V: one partial per V block, [blocks, N, H, *]), the values' and the
    initial states'."""
    i_n = tl.program_id(0) // H
    i_h = tl.program_id(0) % H
    i_v = tl.program_id(1)
    bos = tl.load(p_cu + i_n).to(tl.int64)
    eos = tl.load(p_cu + i_n + 1).to(tl.int64)
    offs = tl.arange(0, C)
    exc = offs[:, None] > offs[None, :]
    ok_k = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok_k < KF
    mv = ov < VF
    st = (i_n * H + i_h).to(tl.int64) * KF * VF + ok_k[:, None] * VF + ov[None, :]
    ms = mk[:, None] & mv[None, :]
    Z0 = tl.zeros([BK, BV], dtype=tl.float32)                                     # dL/dX0, dL/dX1 at the chunk's end
    Z1 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DFINAL:
        Z0 = tl.load(p_dfinal0 + st, mask=ms, other=0.0).to(tl.float32)
        Z1 = tl.load(p_dfinal1 + st, mask=ms, other=0.0).to(tl.float32)
    n_chunks = (eos - bos + C - 1) // C
    for cc in range(0, n_chunks):
        ch = n_chunks - 1 - cc
        rows = bos + ch * C + offs
        mrow = rows < eos
        hr = rows * H + i_h
        part = i_v.to(tl.int64) * NTOK * H + hr                                   # this V block's partial rows
        slot = (bos // C + i_n + ch) * H + i_h
        ck = slot * KF * VF + ok_k[:, None] * VF + ov[None, :]
        X0 = tl.load(p_ck0 + ck, mask=ms, other=0.0).to(tl.float32)              # the chunk's start states
        X1 = tl.load(p_ck1 + ck, mask=ms, other=0.0).to(tl.float32)
        la = tl.load(p_la + hr, mask=mrow, other=0.0).to(tl.float32)
        ld = tl.load(p_ld + hr, mask=mrow, other=0.0).to(tl.float32)
        c = tl.load(p_c + hr, mask=mrow, other=0.0).to(tl.float32)
        mck = mrow[:, None] & mk[None, :]
        mcv = mrow[:, None] & mv[None, :]
        kk = hr[:, None] * KF + ok_k[None, :]
        vv = hr[:, None] * VF + ov[None, :]
        W = tl.load(p_w + kk, mask=mck, other=0.0).to(tl.float32)
        U0 = tl.load(p_u0 + kk, mask=mck, other=0.0).to(tl.float32)
        U1 = tl.load(p_u1 + kk, mask=mck, other=0.0).to(tl.float32)
        K0 = tl.load(p_k0 + kk, mask=mck, other=0.0).to(tl.float32)
        K1 = tl.load(p_k1 + kk, mask=mck, other=0.0).to(tl.float32)
        Q = tl.load(p_q + kk, mask=mck, other=0.0).to(tl.float32)
        V0 = tl.load(p_v0 + vv, mask=mcv, other=0.0).to(tl.float32)
        V1 = tl.load(p_v1 + vv, mask=mcv, other=0.0).to(tl.float32)
        bad = _bad_rows(la, ld, c, W, U0, U1, K0, K1, V0, V1)                      # [C] (_bad_rows)
        la, ld, c, W, U0, U1, K0, K1, V0, V1 = _zero_rows(bad, la, ld, c, W, U0, U1, K0, K1, V0, V1)
        # the forward's NaN rows and NaN end states were filled, not computed: no gradient flows back
        # through them (as through the torch form's masked_fill); dO's rows masked in its load (a
        # select of [C, V] on i1 fails sm_90's compile: an i1 block in shared memory)
        seen = tl.cumsum(bad, axis=0)
        if PREV:
            seen = seen - bad
        dO = tl.load(p_do + vv, mask=mcv & (seen[:, None] == 0), other=0.0).to(tl.float32)
        Z0 = tl.where(tl.max(bad, axis=0) > 0, 0.0, Z0)
        Z1 = tl.where(tl.max(bad, axis=0) > 0, 0.0, Z1)
        # ---- the chunk's forward again (system_chunk_fwd) ----
        (Pin00, Pin11, Pin10, Pex00, Pex11, Pex10, p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10,
         last00, last11, last10, pl00, pl11, pl10, A, G, Ap, Gp, Al, Gl, cP, cp) = _gate_products(la, ld, c, offs, C, DOT)
        E0, E1, e0, e1 = _read_rows(Pex00, Pex11, Pex10, p0ex00, p0ex11, p0ex10, READ)
        F0, F1, f0, f1 = _readout_rows(Pin00, Pin11, Pin10, Pex00, Pex11, Pex10,
                                       p0in00, p0in11, p0in10, p0ex00, p0ex11, p0ex10, QS, PREV)
        WU0 = _dot(W, tl.trans(U0), DOT)                                          # [C, C]
        WU1 = _dot(W, tl.trans(U1), DOT)
        WK0 = _dot(W, tl.trans(K0), DOT)
        WK1 = _dot(W, tl.trans(K1), DOT)
        WX0 = _dot(W, X0, DOT)                                                    # [C, V]
        WX1 = _dot(W, X1, DOT)
        N0 = E0 * WK0
        N1 = E1 * WK1
        Minv = _unit_lower_inverse(E0 * WU0 + E1 * WU1, offs, C)
        R = _dot(Minv, e0[:, None] * WX0 + e1[:, None] * WX1 + _dot(N0, V0, DOT) + _dot(N1, V1, DOT), DOT)
        # ---- the adjoint of the advance: X0' = pl00 X0 + U0^T (last00 R) + K0^T (last00 V0),
        # X1' = pl10 X0 + pl11 X1 + U0^T (last10 R) + K0^T (last10 V0) + U1^T (last11 R) + K1^T (last11 V1)
        dpl00 = tl.sum(tl.sum(Z0 * X0, axis=1), axis=0)
        dpl10 = tl.sum(tl.sum(Z1 * X0, axis=1), axis=0)
        dpl11 = tl.sum(tl.sum(Z1 * X1, axis=1), axis=0)
        dX0 = pl00 * Z0 + pl10 * Z1                                               # dL/d the start states [K, V]
        dX1 = pl11 * Z1
        UZ00 = _dot(U0, Z0, DOT)                                                  # [C, V]
        KZ00 = _dot(K0, Z0, DOT)
        UZ10 = _dot(U0, Z1, DOT)
        KZ10 = _dot(K0, Z1, DOT)
        UZ11 = _dot(U1, Z1, DOT)
        KZ11 = _dot(K1, Z1, DOT)
        dU0 = _dot(last00[:, None] * R, tl.trans(Z0), DOT) + _dot(last10[:, None] * R, tl.trans(Z1), DOT)    # [C, K]
        dK0 = _dot(last00[:, None] * V0, tl.trans(Z0), DOT) + _dot(last10[:, None] * V0, tl.trans(Z1), DOT)
        dU1 = _dot(last11[:, None] * R, tl.trans(Z1), DOT)
        dK1 = _dot(last11[:, None] * V1, tl.trans(Z1), DOT)
        dR = last00[:, None] * UZ00 + last10[:, None] * UZ10 + last11[:, None] * UZ11
        dV0 = last00[:, None] * KZ00 + last10[:, None] * KZ10
        dV1 = last11[:, None] * KZ11
        dlast00 = _rowsum(UZ00 * R + KZ00 * V0)
        dlast10 = _rowsum(UZ10 * R + KZ10 * V0)
        dlast11 = _rowsum(UZ11 * R + KZ11 * V1)
        # ---- the adjoint of the readout: o = f0 (Q X0) + f1 (Q X1) + (F0 * Q U0^T + F1 * Q U1^T) R
        # + (F0 * Q K0^T) V0 + (F1 * Q K1^T) V1
        QU0 = _dot(Q, tl.trans(U0), DOT)
        QU1 = _dot(Q, tl.trans(U1), DOT)
        QK0 = _dot(Q, tl.trans(K0), DOT)
        QK1 = _dot(Q, tl.trans(K1), DOT)
        dQ = f0[:, None] * _dot(dO, tl.trans(X0), DOT) + f1[:, None] * _dot(dO, tl.trans(X1), DOT)
        dX0 += _dot(tl.trans(Q), f0[:, None] * dO, DOT)
        dX1 += _dot(tl.trans(Q), f1[:, None] * dO, DOT)
        df0 = _rowsum(dO * _dot(Q, X0, DOT))
        df1 = _rowsum(dO * _dot(Q, X1, DOT))
        dOR = _dot(dO, tl.trans(R), DOT)                                          # [C, C]
        dOV0 = _dot(dO, tl.trans(V0), DOT)
        dOV1 = _dot(dO, tl.trans(V1), DOT)
        dR += _dot(tl.trans(F0 * QU0 + F1 * QU1), dO, DOT)
        dV0 += _dot(tl.trans(F0 * QK0), dO, DOT)
        dV1 += _dot(tl.trans(F1 * QK1), dO, DOT)
        dF0 = dOR * QU0 + dOV0 * QK0
        dF1 = dOR * QU1 + dOV1 * QK1
        dQU0 = dOR * F0
        dQU1 = dOR * F1
        dQK0 = dOV0 * F0
        dQK1 = dOV1 * F1
        dQ += _dot(dQU0, U0, DOT) + _dot(dQU1, U1, DOT) + _dot(dQK0, K0, DOT) + _dot(dQK1, K1, DOT)
        dU0 += _dot(tl.trans(dQU0), Q, DOT)
        dU1 += _dot(tl.trans(dQU1), Q, DOT)
        dK0 += _dot(tl.trans(dQK0), Q, DOT)
        dK1 += _dot(tl.trans(dQK1), Q, DOT)
        # ---- the adjoint of the solve: R = (I - M)^-1 rhs, rhs = e0 (W X0) + e1 (W X1) + N0 V0 + N1 V1,
        # M = E0 * W U0^T + E1 * W U1^T, N_l = E_l * W K_l^T
        dRhs = _dot(tl.trans(Minv), dR, DOT)                                      # [C, V]
        dM = tl.where(exc, _dot(dRhs, tl.trans(R), DOT), 0.0)                     # [C, C]
        de0 = _rowsum(dRhs * WX0)
        de1 = _rowsum(dRhs * WX1)
        dW = e0[:, None] * _dot(dRhs, tl.trans(X0), DOT) + e1[:, None] * _dot(dRhs, tl.trans(X1), DOT)
        dX0 += _dot(tl.trans(W), e0[:, None] * dRhs, DOT)
        dX1 += _dot(tl.trans(W), e1[:, None] * dRhs, DOT)
        dN0 = _dot(dRhs, tl.trans(V0), DOT)
        dN1 = _dot(dRhs, tl.trans(V1), DOT)
        dV0 += _dot(tl.trans(N0), dRhs, DOT)
        dV1 += _dot(tl.trans(N1), dRhs, DOT)
        dE0 = dN0 * WK0 + dM * WU0
        dE1 = dN1 * WK1 + dM * WU1
        dWK0 = dN0 * E0
        dWK1 = dN1 * E1
        dWU0 = dM * E0
        dWU1 = dM * E1
        dW += _dot(dWK0, K0, DOT) + _dot(dWK1, K1, DOT) + _dot(dWU0, U0, DOT) + _dot(dWU1, U1, DOT)
        dK0 += _dot(tl.trans(dWK0), W, DOT)
        dK1 += _dot(tl.trans(dWK1), W, DOT)
        dU0 += _dot(tl.trans(dWU0), W, DOT)
        dU1 += _dot(tl.trans(dWU1), W, DOT)
        # ---- back to the products: the read row's (E, e), the readout's (F, f), the advance's (last, pl)
        zC = Pex00 * 0.0
        zv = p0ex00 * 0.0
        dPin00 = zC
        dPin11 = zC
        dPin10 = zC
        dPex00 = zC
        dPex11 = zC
        dPex10 = zC
        dp0in00 = zv
        dp0in11 = zv
        dp0in10 = zv
        dp0ex00 = zv
        dp0ex11 = zv
        dp0ex10 = zv
        if READ == 1:
            dPex10 += dE0
            dPex11 += dE1
            dp0ex10 += de0
            dp0ex11 += de1
        else:
            dPex00 += dE0
            dp0ex00 += de0
        if QS == 1:
            if PREV:
                dPex10 += dF0
                dPex11 += dF1
                dp0ex10 += df0
                dp0ex11 += df1
            else:
                dPin10 += dF0
                dPin11 += dF1
                dp0in10 += df0
                dp0in11 += df1
        else:
            if PREV:
                dPex00 += dF0
                dp0ex00 += df0
            else:
                dPin00 += dF0
                dp0in00 += df0
        # P10 = P11 (c P00): Pin10 = Pin11 cP, Pex10 = Pex11 cP, p0in10 = Pin11 cp, p0ex10 = Pex11 cp,
        # last10 = last11 cP, pl10 = last11 . cp (cP = c * Pex00, cp = c * p0ex00)
        dcP = (_dot(tl.trans(Pin11), dPin10, DOT) + _dot(tl.trans(Pex11), dPex10, DOT)
               + last11[:, None] * dlast10[None, :])
        dcp = _colsum(Pin11 * dp0in10[:, None]) + _colsum(Pex11 * dp0ex10[:, None]) + dpl10 * last11
        dPin11 += _dot(dPin10, tl.trans(cP), DOT) + dp0in10[:, None] * cp[None, :]
        dPex11 += _dot(dPex10, tl.trans(cP), DOT) + dp0ex10[:, None] * cp[None, :]
        dlast11 += _rowsum(cP * dlast10[None, :]) + dpl10 * cp
        dc = _rowsum(dcP * Pex00) + dcp * p0ex00
        dPex00 += c[:, None] * dcP
        dp0ex00 += c * dcp
        dla = _log_gate_grad(dPin00, Pin00, dPex00, Pex00, dp0in00, p0in00, dp0ex00, p0ex00, dlast00, last00,
                             dpl00, pl00, offs, C)
        dld = _log_gate_grad(dPin11, Pin11, dPex11, Pex11, dp0in11, p0in11, dp0ex11, p0ex11, dlast11, last11,
                             dpl11, pl11, offs, C)
        # ---- stores: this chunk's rows; the start states' gradients carry to the chunk before
        tl.store(p_dla + part, dla, mask=mrow)
        tl.store(p_dld + part, dld, mask=mrow)
        tl.store(p_dc + part, dc, mask=mrow)
        pk = part[:, None] * KF + ok_k[None, :]
        tl.store(p_dw + pk, dW, mask=mck)
        tl.store(p_du0 + pk, dU0, mask=mck)
        tl.store(p_du1 + pk, dU1, mask=mck)
        tl.store(p_dk0 + pk, dK0, mask=mck)
        tl.store(p_dk1 + pk, dK1, mask=mck)
        tl.store(p_dq + pk, dQ, mask=mck)
        tl.store(p_dv0 + vv, dV0, mask=mcv)
        tl.store(p_dv1 + vv, dV1, mask=mcv)
        Z0 = dX0
        Z1 = dX1
    tl.store(p_dinit0 + st, Z0, mask=ms)
    tl.store(p_dinit1 + st, Z1, mask=ms)

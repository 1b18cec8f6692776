"""The block-affine system: states whose updates read one another, with a token's transition
linear in all of them (derive/coupled.py): the stacked state X_t = A_t X_{t-1} + B_t in blocks.
Every state of a system takes this class. The recurrent and step forms run any system (the
updates as written, their backward the adjoint of the same code). The torch backend's chunked
form (torch_system_chunk below; runtime/torch_system.py runs it) serves a 2x2 system with
scalar gates per head and one rank-1 read (Titans' memory with momentum: derive/system_chunk.py
says which): the rank-1 class's UT solve with each exp(b_t - b_s) an entry of a 2x2 product
(docs/design-notes.md, "Coupled states are one block-affine system"). Mode "chunk" runs the
same form as Triton kernels over the torch pieces (runtime/system_kernels.py, system_chunk.py;
derive/system_chunk.py kernel_unsupported says where they serve)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class BlockAffine(TransitionClass):
    name = "block-affine system"
    hardness = 7

    def claims(self, u: UpdateShape) -> bool:
        return False            # given by the plan to the states of a system, never by an update's shape alone

    torch_batched = False                  # runtime/torch_system.py runs the system's chunks, not torch_chunk's loops

    def explain_chunk(self, st, s) -> list[str]:
        return ["the state is one of a block-affine system (states that read one another): the system's chunked "
                "form below (its kernels: runtime/system_kernels.py), the recurrent and step forms"]

    # ---- torch form (runtime/torch_system.py) ----
    def torch_system_chunk(self, logs, W, U, inputs, X0, read, queries):
        """One chunk of the 2x2 system X_i,t = sum_j D_t[i, j] X_j,t-1 + u_i,t r_t^T + sum_m kin_im,t vin_im,t^T,
        r_t = X_read,t-1^T w_t, D_t = [[a, 0], [c, d]] (design-notes: the chunked form of a system).

        logs (log a, c, log d) [B, n, H] (c None: 0); W [B, n, H, KF] (None: no projection); U
        the lefts, one per state, [B, n, H, KF] or None; inputs: (state index l, kin [B, n, H,
        KF], vin [B, n, H, VF]) per outer product of the input terms; X0 the pair of states at
        the chunk's start [B, H, KF, VF]; read: the index of the state the projection reads;
        queries: (state index, prev, Q [B, n, H, KF]) per readout term. Returns (the q . X of
        each query [B, n, H, VF], the pair of states at the chunk's end)."""
        torch, ops = torch_form()
        log_a, c, log_d = logs
        n = log_a.shape[1]
        P = _pair_products(torch, ops, log_a, c, log_d)             # P[i][l] [B, H, n+1, n+1] (None: 0)
        tr = lambda x: None if x is None else x.transpose(1, 2)     # noqa: E731  [B, H, n, F]
        W, Ut = tr(W), [tr(u) for u in U]
        ins = [(l, tr(k), tr(v)) for l, k, v in inputs]
        R = None if W is None else _predictions(torch, P, W, Ut, ins, X0, read)

        def terms(E, l, Y):
            """sum_s E[t, s] ((y_t . u_l,s) r_s + sum_m (y_t . kin_lm,s) vin_lm,s) for the rows Y [B, H, n, KF]."""
            out = (E * (Y @ Ut[l].transpose(-1, -2))) @ R if Ut[l] is not None else 0
            for m, k, v in ins:
                if m == l:
                    out = out + (E * (Y @ k.transpose(-1, -2))) @ v
            return out
        outs = []
        for i, prev, Q in queries:          # q_t . X_i,t (X_i,t-1 with prev)
            Q = tr(Q)
            rows = slice(0, n) if prev else slice(1, n + 1)          # P[t-1, .] or P[t, .]
            val = 0
            for l in (0, 1):
                if P[i][l] is not None:
                    val = val + P[i][l][..., rows, 0, None] * (Q @ X0[l]) + terms(P[i][l][..., rows, 1:], l, Q)
            outs.append(val.transpose(1, 2))
        ends = []
        for i in (0, 1):                    # X_i,C = sum_l P[C, 0][i, l] X_l,0 + the rows weighted by P[C, s][i, l]
            X = 0
            for l in (0, 1):
                E = P[i][l]
                if E is None:
                    continue
                X = X + E[..., n, 0, None, None] * X0[l]
                w = E[..., n, 1:, None]                             # P[C, s]: token s to the chunk's end
                if Ut[l] is not None:
                    X = X + (Ut[l] * w).transpose(-1, -2) @ R
                for m, k, v in ins:
                    if m == l:
                        X = X + (k * w).transpose(-1, -2) @ v
            ends.append(X)
        return outs, tuple(ends)


def _predictions(torch, P, W, Ut, ins, X0, read):
    """R [B, H, n, VF]: the chunk's r_t = w_t . X_read,t-1, the unit lower-triangular system
    (I - M) R = sum_j p_j (W X_j,0) + sum_lm N_lm Vin_lm with M[t, s] = sum_l P[t-1, s][read, l]
    (w_t . u_l,s), N_lm[t, s] = P[t-1, s][read, l] (w_t . kin_lm,s), p_j[t] = P[t-1, 0][read, j]."""
    n = W.shape[-2]
    M, rhs = 0, 0
    for l in (0, 1):
        E = P[read][l]
        if E is None:
            continue
        rhs = rhs + E[..., :n, 0, None] * (W @ X0[l])
        E = E[..., :n, 1:]                                           # P[t-1, s], s < t: strictly lower
        if Ut[l] is not None:
            M = M + E * (W @ Ut[l].transpose(-1, -2))
        for m, k, v in ins:
            if m == l:
                rhs = rhs + (E * (W @ k.transpose(-1, -2))) @ v
    if not torch.is_tensor(M):              # no left: r is read, never fed back
        return rhs
    eye = torch.eye(n, dtype=W.dtype, device=W.device)
    return torch.linalg.solve_triangular(eye - M, rhs, upper=False, unitriangular=True)


def _pair_products(torch, ops, log_a, c, log_d):
    """The 2x2 products P[m, n] = D_m ... D_{n+1} over a chunk's boundaries m, n = 0..C (m: after
    token m), D = [[a, 0], [c, d]] per token: [[P00, None], [P10, P11]], each [B, H, C+1, C+1],
    0 where n > m. The diagonal entries are exp of per-pair sums of log a, log d (never a
    difference of cumulative sums: ops.loop_pair_logs); P10[m, n] = sum_{n < r <= m} exp(G_m -
    G_r) c_r exp(A_{r-1} - A_n) = P11[m, r] c_r P00[r-1, n], one product of two masked
    [C+1, C+1] matrices, every factor a product of gates (bounded: no inverse is formed)."""
    def pairs(g):                          # [B, n, H] -> [B, H, n+1, n+1]
        g = torch.cat([torch.zeros_like(g[:, :1]), g], 1)           # boundary 0: the chunk's start
        return torch.exp(ops.loop_pair_logs(g, False)).permute(0, 3, 1, 2)
    P00, P11 = pairs(log_a), pairs(log_d)
    if c is None:
        return [[P00, None], [None, P11]]
    F = torch.cat([torch.zeros_like(P11[..., :1]), P11[..., 1:]], -1)          # [m, r], r >= 1
    Hm = torch.cat([torch.zeros_like(P00[..., :1, :]), P00[..., :-1, :]], -2)  # [r, n] = P00[r-1, n]
    cc = torch.cat([torch.zeros_like(c[:, :1]), c], 1).transpose(1, 2)         # [B, H, n+1]: c_r
    return [[P00, None], [F @ (cc[..., None] * Hm), P11]]


UNIT = BlockAffine()

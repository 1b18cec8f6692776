"""The scalar decay: S_t = a_t S_{t-1} + B_t with one a_t per head and token (RetNet,
Mamba-2, simple GLA, gated delta rule's decay part)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class ScalarDecay(TransitionClass):
    name = "scalar decay"
    stabilizer_keeps_decay = True
    hardness = 1
    parallel_form = "chunk"
    torch_chunked = True
    diagonal_segments = True
    conv_form = True
    stabilizable = True
    # the output kernel (the outputs) in the walk's tile blocks (64), as every other class. Blocks of 32
    # spilled nothing where 64 spilled 128 B (Mamba-2's [C, 64] skip-term operand, sm_90, K = V =
    # 128), but on the first GPU run (H200, Triton 3.6, 2026-12-04) every scalar-decay op at
    # K = V = 128 in that launch (retention at three shapes; simple_gla) ended in "an illegal
    # memory access", while gla and linear_attn, the output kernel in blocks of 64 at the same shape, ran;
    # the interpreter's bounds checker finds every access in bounds (tests/runtime/
    # test_kernel_bounds.py). Unproven either way until bench/gpubench/p2_fault.py runs on a GPU
    # (its "p2-tile-64" variant is this setting); a fault costs more than a spill.
    output_tile = None

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and not u.decay_dims

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk",
                f"O   = (Q * exp(b)) {S}0 + [ (Q K^T)_ij exp(b_i - b_j), i >= j ] V",
                f"{S}_C = exp(b_C) * {S}0 + (K * exp(b_C - b))^T V",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py), built as kernel IR ----
    # The scalar decay's chunk (RetNet, Mamba-2, simple GLA; the stabilizer's group of states):
    # S_t = a_t S_{t-1} + k_t v_t^T with one a_t per token. Notation (codegen/chunk_stage.py): k,
    # the stage's builder; rows i are the chunk's C tokens, j the same rows as keys; Q, K [i, K]
    # and V [i, V] are the chunk's query, key and value matrices; s = s_<S>, the state S0 at the
    # chunk's start [K, V], d = d_<S> = dL/dS_C; b = _b_<S> is the cumulative log decay in the
    # chunk, a [C] vector; ok masks the pairs (i, j) with a reset between them. The log weights
    # are named by ChunkCode (scalar_logs, and the builder's scalar_advance_logs; the stabilizer
    # subtracts its m there): bq at the query rows, bk at the keys, b0 of S0 at each row; bs of
    # S0 in S_C, kw of each key in S_C. prev: the readout reads S_{t-1} (token i sees keys j < i,
    # else j <= i).
    #
    #     R   = (Q * exp(b0)) S0 + [(Q K^T)_ij exp(bq_i - bk_j), i >= j] V
    #     S_C = exp(bs) S0 + (K * exp(kw))^T V
    compensated_sum = True          # pair_logs: b_i - b_j as (hi_i - hi_j) + (lo_i - lo_j)

    @staticmethod
    def pair_logs(k, bq, bk):
        """The log weight b_i - b_j of the pairs (query row i, key j) [i, j]: bq and bk are
        blocks, or (hi, lo) pairs of a compensated sum (ChunkCode.compensated): exact hi
        differences, then lo's."""
        if not isinstance(bq, tuple):
            return bq - k.at_keys(bk)
        return (bq[0] - k.at_keys(bk[0])) + (bq[1] - k.at_keys(bk[1]))

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        k = code.builder(st)
        pre, bq, bk, b0, ok = k.scalar_logs(prev)
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        A = k.let("_A", k.dot(Q, k.trans(k.at_keys(K)))
                  * k.exp(k.where(k.causal(prev) & ok, self.pair_logs(k, bq, bk), -k.INF)), "i", "j")
        k.let(R, k.dot(Q * k.exp(b0), s) + k.dot(A, k.at_keys(V)), "i", "V")
        return pre + k.lines()

    def chunk_advance(self, code, st, parts) -> list[str]:
        k = code.builder(st)
        bs, kw = k.scalar_advance_logs()
        K, V, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state()
        k.let(s, k.exp(bs) * s + k.dot(k.trans(K * k.exp(kw)), V), "K", "V")
        return k.lines()

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        """dR = dL/dR [i, V]: assigns dQ and this term's dK, dV, dS0, db (db: the keys' side;
        _dbq, the query rows' side, goes into db after this: ChunkBackward.query_side). The pair
        of a row with the token it reads last (j = i, or i - 1 with prev) spans no log decay: its
        +E and -E cancel in math, not in fp32, so it is dropped, except when stabilized, where
        the gate's gradient di needs every pair."""
        dK, dV, dS0, db = code.grad_names(G, "t", with_db=True)
        k = code.builder(st)
        pre, bq, bk, b0, ok = k.scalar_logs(prev)
        di = self._di(code, st, G)
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        dR = k.block(dR, "i", "V")
        D = k.let("_D", k.exp(k.where(k.causal(prev) & ok, self.pair_logs(k, bq, bk), -k.INF)), "i", "j")
        A = k.let("_A", k.dot(Q, k.trans(k.at_keys(K))) * D, "i", "j")
        dA = k.let("_dA", k.dot(dR, k.trans(k.at_keys(V))), "i", "j")
        dP = k.let("_dP", dA * D, "i", "j")
        if di is not None:
            E = k.let("_E", dA * A, "i", "j")
        else:
            E = k.let("_E", k.where(k.row_i - int(prev) > k.key_j, dA * A, 0.0), "i", "j")
        eb = k.let("_eb", k.exp(b0), "i")
        Gq = k.let("_Gq", k.dot(dR, k.trans(s)), "i", "K")
        k.let(dQ, k.dot(dP, k.at_keys(K)) + Gq * eb, "i", "K")
        k.let(dK, k.at_rows(k.dot(k.trans(dP), Q)), "i", "K")
        k.let(dV, k.at_rows(k.dot(k.trans(A), dR)), "i", "V")
        k.let(dS0, k.dot(k.trans(Q * eb), dR), "K", "V")
        k.let("_dbq", k.sum(E, "j") + k.sum(Gq * Q, "K") * eb, "i")
        db_ = k.let(db, -k.at_rows(k.sum(E, "i")), "i")
        if di is not None:
            # exp(bq_i - b_j + i_j): the gate's exponent i weighs like -b_j
            k.let(di, -db_, "i")
        return pre + k.lines() + code.query_side(st, db, prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        """Given d = dL/dS_C; _dbl_<S>: the gradient of b at the chunk's last token. That token's
        key weight exp(b_C - b_last) = 1 spans no log decay (its -F into db and +F into _dbl
        cancel in math, not in fp32): dropped from both, except when stabilized (di needs it)."""
        dK, dV, dS0, db = code.grad_names(G, "u", with_db=True)
        k = code.builder(st)
        bs, kw = k.scalar_advance_logs()
        di = self._di(code, st, G)
        K, V, d, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state_grad(), k.state()
        w = k.let("_w", k.exp(kw), "i")
        k.let(dS0, k.exp(bs) * d, "K", "V")
        k.let(dV, k.dot(K * w, d), "i", "V")
        dKw = k.let("_dKw", k.dot(V, k.trans(d)), "i", "K")
        k.let(dK, dKw * w, "i", "K")
        F = k.let("_F", k.sum(dKw * K, "K") * w, "i")
        Fb = k.let("_Fb", F if di is not None else k.where(k.offs.eq(k.n_valid - 1), 0.0, F), "i")
        k.let(db, -Fb, "i")
        k.let(f"_dbl_{st.name}", k.sum(Fb, "i") + k.sum(s * d) * k.exp(bs))            # a scalar
        if di is not None:
            k.let(di, F, "i")
        return k.lines()

    @staticmethod
    def _di(code, st, G) -> str | None:
        """A stabilized state's part of the gate exponent's gradient (None: not stabilized)."""
        if not code.stabilized(st):
            return None
        G["di"].append(code.fresh("di"))
        return G["di"][-1]

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "scalar"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H]
        bq = b_excl if prev else b
        diff, b0 = ops.loop_pair_logs(g, prev), bq                                # [B, i, j, H]
        if logs is not None:        # stabilized: m off each query row, the gate on the keys
            mrow, gi, M0, _ = logs
            diff, b0 = diff - mrow.unsqueeze(2) + gi.unsqueeze(1), bq + M0.unsqueeze(1) - mrow
        A = torch.einsum("bihk,bjhk->bhij", Q, K) * torch.exp(diff.permute(0, 3, 1, 2))
        return (torch.einsum("bihk,bhkv->bihv", Q * b0.exp().unsqueeze(-1), S)
                + torch.einsum("bhij,bjhv->bihv", A, V))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        if logs is not None:
            _, gi, M0, mnew = logs
            w = torch.exp(sfx + gi - mnew.unsqueeze(1))
            return torch.exp(bl + M0 - mnew)[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)
        w = torch.exp(sfx)                                                        # [B, c, H]
        return bl.exp()[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)

    def torch_chunks_update(self, dec, K, V):
        """base's (K exp(b_C - b))^T V, into the group's arena without autograd (the walk reads it)."""
        _, ops = torch_form()
        Kw = dec.on_keys(K, 3).transpose(-1, -2)
        return ops.mm(Kw, V, fast=dec.fast, out=dec.take(Kw.shape[:-1] + V.shape[-1:], V))

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        """The batched readout (base's), with exp(b) scaling the rows of Q S rather than Q: Q
        is a strided view of the input and Q * exp(b) a fresh copy of it, while Q S is fresh
        and contiguous, scaled in place without autograd; or, where the decay keeps Q * exp(b)
        for its product anyway (dec.readout_rows: the row and column factors), that copy."""
        _, ops = torch_form()
        Qe = dec.readout_rows(Q, prev)
        val = ops.mm(Q if Qe is None else Qe, S_starts, fast=dec.fast, out=dec.out)
        if Qe is None and dec.axis is not None:         # None: a log decay of constant 0
            e = dec.key_factor(2 if prev else 0).unsqueeze(-1)
            val = val.mul_(e) if dec.fast else val * e
        return ops.mm(dec.product(Q, K, prev), V, val, fast=dec.fast)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi[:, :, None, None] * S                # phi [n, H]


UNIT = ScalarDecay()

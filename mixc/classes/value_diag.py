"""The value-diagonal decay: S_t = S_{t-1} diag(a_t) + B_t with a_t over the value dims
(HGRN's h[D], read as is, decays per value channel)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class ValueDiagonal(TransitionClass):
    name = "value-diagonal decay"
    hardness = 2
    parallel_form = "chunk"
    torch_chunked = True
    token_loop_prefill = True       # mode torch prefills by the token loop (runtime/torch_step.py)
    conv_form = True

    def claims(self, u: UpdateShape) -> bool:
        return (not u.projections and set(u.decay_dims) <= set(u.value_dims)
                and (set(u.decay_dims) != set(u.state_dims) or not u.key_dims))

    def chunk_size(self, st) -> int:
        # the intra-chunk term is a [C, C, V] block: 16 keeps it in registers
        return 16

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} over {', '.join(st.decay_dims)} inside the chunk",
                f"O   = (Q {S}0) * exp(b) + [ (Q K^T) masked i >= j, times exp(b_i - b_j) per value channel ] V",
                f"{S}_C = {S}0 * exp(b_C) + K^T (V * exp(b_C - b))"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py), built as kernel IR ----
    # The value-diagonal decay's chunk (HGRN's h[D]): S_t = S_{t-1} diag(a_t) + k_t v_t^T with
    # a_t over the value dims. Notation (codegen/chunk_stage.py): k, the stage's builder; rows i
    # are the chunk's C tokens, j the same rows as keys; Q, K [i, K] and V [i, V] are the chunk's
    # query, key and value matrices; s = s_<S>, the state S0 at the chunk's start [K, V], d =
    # d_<S> = dL/dS_C; b = _b_<S> [i, V] is the cumulative log decay in the chunk, per value
    # channel; ok masks the pairs (i, j) with a reset between them. From
    # ChunkCode.cumulative_decay: bl0 = _bl0_<S> [V], the log weight of S0 in S_C; kw = _kw_<S>
    # [i, V], each token's log weight in S_C. From ChunkCode.query_decay: bq, b at the query rows
    # (b_{i-1} with prev), and bq0, their weight from the chunk's start. prev: the readout reads
    # S_{t-1} (token i sees keys j < i, else j <= i). The decay weighs the values: Q K^T stays
    # one matmul, the decay a [C, C, VF] block on V.
    #
    #     R   = (Q S0) * exp(bq0) + [sum_j (Q K^T)_ij v_jd exp(bq_id - b_jd), i >= j]
    #     S_C = S0 * exp(bl0) + K^T (V * exp(kw))

    def _pair_weights(self, k, prev, bq, ok):
        """exp(bq_id - b_jd) of the pairs (i, j) a row reads, [i, j, V] (0 across a reset)."""
        b = k.block(f"_b_{k.st.name}", "i", "V")
        return k.exp(k.where(k.causal(prev) & ok, bq - k.at_keys(b), -k.INF))

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        k = code.builder(st)
        pre, bq, bq0, ok = k.query_logs(prev, "V")
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        A = k.let("_A", k.where(k.causal(prev), k.dot(Q, k.trans(k.at_keys(K))), 0.0), "i", "j")
        k.let(R, k.dot(Q, s) * k.exp(bq0) + k.sum(A * k.at_keys(V) * self._pair_weights(k, prev, bq, ok), "j"),
              "i", "V")
        return pre + k.lines()

    def chunk_advance(self, code, st, parts) -> list[str]:
        k = code.builder(st)
        n = st.name
        K, V, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state()
        bl0, kw = k.block(f"_bl0_{n}", "V"), k.block(f"_kw_{n}", "i", "V")
        k.let(s, s * k.exp(bl0) + k.dot(k.trans(K), V * k.exp(kw)), "K", "V")
        return k.lines()

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        """dR = dL/dR [i, V]: assigns dQ and this term's dK, dV, dS0, db (db: the keys' side;
        _dbq, the query rows' side, goes into db after this: ChunkBackward.query_side). The pair
        of a row with the token it reads last (j = i, or i - 1 with prev) spans no log decay: its
        +E and -E cancel in math, not in fp32, so it is dropped from both."""
        dK, dV, dS0, db = code.grad_names(G, "t", with_db=True)
        k = code.builder(st)
        pre, bq, bq0, ok = k.query_logs(prev, "V")
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        dR, Vj = k.block(dR, "i", "V"), k.at_keys(V)
        causal = k.causal(prev)
        P = k.let("_P", k.where(causal, k.dot(Q, k.trans(k.at_keys(K))), 0.0), "i", "j")
        W = k.let("_W", self._pair_weights(k, prev, bq, ok), "i", "j", "V")
        Y = k.let("_Y", dR * W, "i", "j", "V")
        E = k.let("_E", k.where(k.row_i - int(prev) > k.key_j, P * Y * Vj, 0.0), "i", "j", "V")
        dP = k.let("_dP", k.where(causal, k.sum(Y * Vj, "V"), 0.0), "i", "j")
        eb = k.let("_eb", k.exp(bq0), "i", "V")
        Z = k.let("_Z", k.dot(Q, s), "i", "V")
        dZ = k.let("_dZ", dR * eb, "i", "V")
        k.let(dQ, k.dot(dP, k.at_keys(K)) + k.dot(dZ, k.trans(s)), "i", "K")
        k.let(dK, k.at_rows(k.dot(k.trans(dP), Q)), "i", "K")
        k.let(dV, k.at_rows(k.sum(P * Y, "i")), "i", "V")
        k.let(dS0, k.dot(k.trans(Q), dZ), "K", "V")
        k.let("_dbq", k.sum(E, "j") + dR * Z * eb, "i", "V")
        k.let(db, -k.at_rows(k.sum(E, "i")), "i", "V")
        return pre + k.lines() + code.query_side(st, db, prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        """Given d = dL/dS_C; _dbl_<S>: the gradient of b at the chunk's last token. That token's
        weight exp(b_C - b_last) = 1 spans no log decay (its -F into db and +F into _dbl cancel
        in math, not in fp32): dropped from both."""
        dK, dV, dS0, db = code.grad_names(G, "u", with_db=True)
        k = code.builder(st)
        n = st.name
        K, V, d, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state_grad(), k.state()
        bl0, kw = k.block(f"_bl0_{n}", "V"), k.block(f"_kw_{n}", "i", "V")
        w = k.let("_w", k.exp(kw), "i", "V")
        k.let(dS0, d * k.exp(bl0), "K", "V")
        k.let(dK, k.dot(V * w, k.trans(d)), "i", "K")
        dVw = k.let("_dVw", k.dot(K, d), "i", "V")
        k.let(dV, dVw * w, "i", "V")
        F = k.let("_F", k.where(k.offs.eq(k.n_valid - 1), 0.0, dVw * V * w), "i", "V")
        k.let(db, -F, "i", "V")
        k.let(f"_dbl_{n}", k.sum(F, "i") + k.sum(s * d, "K") * k.exp(bl0), "V")
        return k.lines()

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "value"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H, V]
        bq = b_excl if prev else b
        A = torch.einsum("bihk,bjhk->bhij", Q, K).masked_fill(~ops.causal(Q.shape[1], prev, Q.device), 0.0)
        w = torch.exp(ops.loop_pair_logs(g, prev))
        return torch.einsum("bihk,bhkv->bihv", Q, S) * bq.exp() + torch.einsum("bhij,bijhv,bjhv->bihv", A, w, V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        w = torch.exp(sfx)
        return S * bl.exp().unsqueeze(-2) + torch.einsum("bjhk,bjhv->bhkv", K, V * w)

    # the batched form: the decay acts on the values (dec: a torch_ops.ValueDecay, or a
    # NoDecay for a log decay of constant 0, which takes the keys' path)
    def torch_chunks_update(self, dec, K, V):
        if dec.g is None:
            return super().torch_chunks_update(dec, K, V)
        return K.transpose(-1, -2) @ dec.on_values(V, 3)

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        if dec.g is None:
            return super().torch_chunks_readout(dec, Q, K, V, L, S_starts, U, prev)
        _, ops = torch_form()
        return dec.on_values(Q @ S_starts, 2 if prev else 0) + ops.value_mix(dec.product(Q, K, prev), V, dec.g, prev)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi.unsqueeze(-2) * S                    # phi [n, H, VF]


UNIT = ValueDiagonal()

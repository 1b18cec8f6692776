"""The key-diagonal decay: S_t = diag(a_t) S_{t-1} + B_t with a_t over the key dims (GLA,
RWKV-6, HGRN-2, KDA's decay part)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class KeyDiagonal(TransitionClass):
    name = "key-diagonal decay"
    hardness = 3
    parallel_form = "chunk"
    torch_chunked = True
    diagonal_segments = True
    conv_form = True
    compensated_sum = True          # the pair log weights: (hi_i - hi_j) + (lo_i - lo_j)
    # the sub-chunk loops that make A (16 diagonal steps of [C, K] exps) run once per chunk in
    # the intra kernel, not once per tile block in the output kernel, whose registers they took (sm_90, K = V = 128:
    # gla's output kernel spilled 32 B, rwkv6's 148 B with them; bench/README.md)
    stages_intra = True
    # at C = 64 a key block holds its [C, KB] keys, queries, decays (hi, lo, resets) and, in the
    # backward, dq's and dk's terms and the sub-chunk loops' exps: sm_90 (K = V = 128, bf16, 8
    # warps) spills at KB = 64 / 32 / 16: backward tiles kernel gla 1200 / 136 / 0 B (fla's whole
    # backward 420), rwkv6 1752 / 432 / 56 (fla 972); forward intra kernel rwkv6 32 / 0 / 0, the output kernel
    # walking four chunks rwkv6 224 / 24 / 0, gla 0 / 0 / 0. The cost: each key block of the
    # backward reads dO and V again in its tile loop (from L2: the HBM bytes are the same), and
    # the walk's static blocks are eight copies of the block's statements
    key_block = 16
    # the output kernel walking R chunks at C = 64 spilled 464 B (gla), 992 (rwkv6) with its state whole
    walks_key_blocks = True

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and set(u.decay_dims) <= set(u.key_dims)

    def chunk_size(self, st) -> int:
        # the intra-chunk term runs on sub-chunks of 16 (the stages below), so any C is a matter of
        # registers. C = 64, as fla's: wgmma on sm_90 (C = 32 is below its 64 rows: mma.sync),
        # half C = 32's sequential steps in the walk. It fits with the key dim in blocks
        # of key_block (codegen/key_split.py, key_walk.py): sm_90 at K = V = 128 (bf16, 8 warps)
        # spills nothing forward (gla, rwkv6; whole in K: the intra kernel 456 and 856 B, the output kernel walking
        # four chunks 464 and 992), backward gla 0 B, rwkv6 524 (its walk 468; fla 420 and 972);
        # bytes per token-head gla forward 3344 (C = 32: 3216), forward + backward 9408 (11328)
        # (bench/results/static-sm90, traffic-sm90). The tuner also times 32 and 16 on the GPU.
        return 64

    def chunk_candidates(self, C: int) -> list[int]:
        return [C] + [c for c in (64, 32, 16) if c != C]

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk "
                f"(a vector over {', '.join(st.decay_dims)})",
                f"O   = (Q * exp(b)) {S}0 + [ sum_d q_id k_jd exp(b_id - b_jd), i >= j ] V",
                f"{S}_C = exp(b_C) * {S}0 + (K * exp(b_C - b))^T V",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive",
                "the intra-chunk term runs on sub-chunks of 16: a sub-block below the diagonal is one "
                "matmul through the b of the row before it (both factors <= 1), a diagonal sub-block "
                "elementwise in fp32"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py), built as kernel IR ----
    # The key-diagonal decay's chunk: S_t = diag(a_t) S_{t-1} + k_t v_t^T with a_t over the key
    # dims. Notation (codegen/chunk_stage.py): k, the stage's builder; rows i are the chunk's C
    # tokens, j the same rows as keys; Q, K [i, K] and V [i, V]; s = s_<S>, the state S0 at the
    # chunk's start [K, V], d = d_<S> = dL/dS_C; b [i, K] the cumulative log decay in the chunk,
    # per key, taken as its compensated hi + lo parts (bh = _bh_<S>, bc = _bc_<S>:
    # ChunkCode.compensated; every pair's log weight is (hi_i - hi_j) + (lo_i - lo_j), as the
    # scalar class's: at C = 64 and a log decay of -20 per token the plain sum's ulp put dg off by
    # 1.3e-5, now 2.8e-7); z [i, K] the resets at or before each token (a pair (i, j) is kept
    # where z_i = z_j). From ChunkCode.cumulative_decay: b0 = _b0_<S>, b where no reset precedes
    # (the weight of S0); bl0 = _bl0_<S> [K], the log weight of S0 in S_C; kw = _kw_<S> [i, K],
    # each key's log weight in S_C.
    #
    #     R   = (Q * exp(b0)) S0 + A V,   A_ij = sum_d q_id k_jd exp(b_id - b_jd)  (i >= j)
    #     S_C = exp(bl0) * S0 + (K * exp(kw))^T V
    #
    # A runs on sub-chunks of 16 (fla's secondary chunking), so C = 32 or 64 keeps tensor cores
    # and no [C, C, K] block is formed:
    # - a sub-block below the diagonal (query rows of sub-chunk I, keys before it) is one matmul
    #   through the reference r = b at the last row before I: (Q * exp(b - r)) (K * exp(r - b))^T,
    #   both factors <= 1 (b is non-increasing), so none overflows at any decay;
    # - a diagonal sub-block (both in sub-chunk I) spans at most 15 tokens of decay, which still
    #   overflows a factored exp at strong decays: it is elementwise in fp32, one key row of each
    #   sub-chunk at a time (16 steps of [C, K]: the exps fla's sub_intra kernel takes).
    # A readout of S_{t-1} (prev) is the same with the keys, values, b and z moved down one row
    # (row i holds token i - 1's; row 0 none: b = z = 0), gathered exactly: its pairs are (i, j)
    # with j <= i in the moved rows, its S0 weight exp(b0 of the moved rows). The blocks over the
    # key dim are shaped at run time (zeros_like, subchunk_sum: `like.shape`), as the key split
    # (codegen/key_split.py) reads them.

    @staticmethod
    def _logs(k):
        """bh, bc, z, b0 of the chunk's rows, [i, K] each."""
        n = k.st.name
        return tuple(k.block(f"_{x}_{n}", "i", "K") for x in ("bh", "bc", "z", "b0"))

    @staticmethod
    def _moved(k, K, V):
        """The rows moved down one for a readout of S_{t-1}: K, V, bh, bc, z and b0 of row i - 1."""
        bh, bc, z, _ = KeyDiagonal._logs(k)
        above = k.maximum(k.offs - 1, 0)
        mv = k.let("_kdmv", k.row_index(above, K), "i", "K")
        first = k.let("_kdfirst", k.offs.eq(0), "i")
        Kx = k.let("_Kx", k.where(first, 0.0, k.gather_rows(K, mv)), "i", "K")
        Vx = k.let("_Vx", k.where(first, 0.0, k.rows_at(V, above)), "i", "V")
        bxh = k.let("_bxh", k.where(first, 0.0, k.gather_rows(bh, mv)), "i", "K")
        bxc = k.let("_bxc", k.where(first, 0.0, k.gather_rows(bc, mv)), "i", "K")
        zx = k.let("_zx", k.where(first, 0.0, k.gather_rows(z, mv)), "i", "K")
        bx0 = k.let("_bx0", k.where(zx > 0, -k.INF, bxh + bxc), "i", "K")
        return Kx, Vx, bxh, bxc, zx, bx0

    @staticmethod
    def _moved_back(k, Y: str, X, *axes):
        """Y = X backed up one row: row j - 1 of Y is row j of X (the last row none)."""
        last = k.offs.eq(k.rows_block - 1)
        k.let(Y, k.where(last, 0.0, k.rows_at(X, k.minimum(k.offs + 1, k.rows_block - 1))), *axes)

    @staticmethod
    def _sub_block(k, I, bh, bc, z):
        """Sub-block I below the diagonal: the log factors of its query rows (lq) and keys (lk)."""
        ref = k.let("_ref", k.offs.eq(I * 16 - 1), "i")
        rh = k.let("_rh", k.sum(k.where(ref, bh, 0.0), "i"), "K")
        rc = k.let("_rc", k.sum(k.where(ref, bc, 0.0), "i"), "K")
        zr = k.let("_zr", k.sum(k.where(ref, z, 0.0), "i"), "K")
        lq = k.let("_lq", k.where((k.offs // 16).eq(I) & z.eq(zr), (bh - rh) + (bc - rc), -k.INF), "i", "K")
        lk = k.let("_lk", k.where((k.offs < I * 16) & z.eq(zr), (rh - bh) + (rc - bc), -k.INF), "i", "K")
        return lq, lk

    @staticmethod
    def _diagonal_step(k, jj, K, bh, bc, z):
        """Step jj of a diagonal sub-block: key row jj of each row's sub-chunk (kj) and the
        weights of the pairs (i, that row), j <= i (w); src, that row's index; row, the rows that are it."""
        src = k.let("_kdsrc", (k.offs // 16) * 16 + jj, "i")
        row = k.let("_kdrow", (k.offs % 16).eq(jj), "i")
        kj = k.let("_kdkj", k.subchunk_sum(k.where(row, K, 0.0), K), "i", "K")
        kbh = k.let("_kdbh", k.subchunk_sum(k.where(row, bh, 0.0), K), "i", "K")
        kbc = k.let("_kdbc", k.subchunk_sum(k.where(row, bc, 0.0), K), "i", "K")
        same = z.eq(k.subchunk_sum(k.where(row, z, 0.0), K))
        w = k.let("_kdw", k.exp(k.where(((k.offs % 16) >= jj) & same, (bh - kbh) + (bc - kbc), -k.INF)), "i", "K")
        return src, row, kj, w

    def _pairs(self, k, Q, K, bh, bc, z):
        """A [i, j]: the intra-chunk pairs (i, j), j <= i. Every term is added into A (a diagonal
        sub-block's entries are zero before their steps), so A sums over key blocks."""
        A = k.let("_A", k.zeros("i", "j"), "i", "j")
        with k.loop("_I", 1, k.rows_block // 16, static=True) as I:
            lq, lk = self._sub_block(k, I, bh, bc, z)
            k.acc(A, k.dot(Q * k.exp(lq), k.trans(k.at_keys(K * k.exp(lk)))))
        with k.loop("_jj", 0, 16) as jj:
            src, _, kj, w = self._diagonal_step(k, jj, K, bh, bc, z)
            k.acc(A, k.where(k.at_keys(k.offs).eq(src), k.sum(Q * kj * w, "K"), 0.0))
        return A

    def _staged_pairs(self, k, Q, K, bh, bc, z, slot):
        """A, staged (slot: its place among the chunk's intra-chunk matrices; None: computed,
        the backward's): the intra kernel computes it and stores it in the dtype the matmul with
        V takes it in (_mixc_dot: bf16 for bf16 inputs on a GPU), so the output kernel's staged
        variant reading it back gets the same bits the other variant computes; the walks compute
        it. The intra kernel zeroes only the keys that are not finite (ChunkCode.sanitize): a
        value row that is not finite in one tile block zeroes that block's V row in the output
        kernel, so its column of A meets zeros there either way."""
        stage = k.code.kernel_stage
        if slot is None or not (stage == "intra" or (stage == "output" and k.code.reads_staged)):
            return self._pairs(k, Q, K, bh, bc, z)
        p_intra = k.block("p_intra", dtype="ptr")
        pA = k.let("_pA", k.intra_address(slot), "i", "j")          # row i of the chunk's A
        mask = k.block("_mask__T", "i", dtype="i1")
        if stage == "output":
            return k.let("_A", k.load(pA, mask), "i", "j")
        A = self._pairs(k, Q, K, bh, bc, z)
        k.store(pA, k.cast_to_element(A, p_intra), mask)
        return A

    def chunk_readout(self, code, st, R, Q, K, V, prev):
        k = code.builder(st)
        slot = code.intra_slot()
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        if prev:
            K, V, bh, bc, z, b0 = self._moved(k, K, V)
        else:
            bh, bc, z, b0 = self._logs(k)
        A = self._staged_pairs(k, Q, K, bh, bc, z, slot)
        k.let(R, k.dot(Q * k.exp(b0), s) + k.dot(A, k.at_keys(V)), "i", "V")
        return k.lines()

    def chunk_advance(self, code, st, parts):
        k = code.builder(st)
        n = st.name
        K, V, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state()
        bl0, kw = k.block(f"_bl0_{n}", "K"), k.block(f"_kw_{n}", "i", "K")
        k.let(s, k.exp(bl0) * s + k.dot(k.trans(K * k.exp(kw)), V), "K", "V")
        return k.lines()

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G):
        """dR = dL/dR [i, V]: assigns dQ and this term's dK, dV, dS0 and db (the gradient of b,
        both sides). The sub-blocks below the diagonal give dQ and dK by matmuls through their
        factors, and b's gradient as Q * dQ - K * dK (their pairs all span a decay); a diagonal
        sub-block's steps add theirs, where the pair of a row with the token it reads last
        (j = i) spans no log decay: its +E and -E cancel in math, not in fp32 (O(1) against a
        db of exp(g) ~ 1e-9 at g = -20), so it is dropped from both. For prev the moved rows'
        gradients go back up a row."""
        dK, dV, dS0, db = code.grad_names(G, "t", with_db=True)
        k = code.builder(st)
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        dR = k.block(dR, "i", "V")
        if prev:
            Kx, Vx, bh, bc, zx, bx0 = self._moved(k, K, V)
        else:
            Kx, Vx, (bh, bc, zx, bx0) = K, V, self._logs(k)
        A = self._pairs(k, Q, Kx, bh, bc, zx)
        dA = k.let("_dA", k.dot(dR, k.trans(k.at_keys(Vx))), "i", "j")
        eb = k.let("_eb", k.exp(bx0), "i", "K")
        Gq = k.let("_Gq", k.dot(dR, k.trans(s)), "i", "K")
        dVx = k.let("_dVx", k.at_rows(k.dot(k.trans(A), dR)), "i", "V")
        k.let(dS0, k.dot(k.trans(Q * eb), dR), "K", "V")
        dQi = k.let("_dQi", k.zeros_like(Q), "i", "K")
        dKi = k.let("_dKi", k.zeros_like(Q), "i", "K")
        with k.loop("_I", 1, k.rows_block // 16, static=True) as I:
            lq, lk = self._sub_block(k, I, bh, bc, zx)
            fq = k.let("_fq", k.exp(lq), "i", "K")
            fk = k.let("_fk", k.exp(lk), "i", "K")
            k.acc(dQi, fq * k.dot(dA, k.at_keys(Kx * fk)))
            k.acc(dKi, fk * k.at_rows(k.dot(k.trans(dA), Q * fq)))
        dbx = k.let("_dbx", Q * dQi - Kx * dKi + Gq * Q * eb, "i", "K")
        with k.loop("_jj", 0, 16) as jj:
            src, row, kj, w = self._diagonal_step(k, jj, Kx, bh, bc, zx)
            X = k.let("_kdX", k.sum(k.where(k.at_keys(k.offs).eq(src), dA, 0.0), "j") * w, "i", "K")
            k.acc(dQi, X * kj)
            Y = k.let("_kdY", X * Q, "i", "K")
            E = k.let("_kdE", k.where((k.offs % 16) > jj, Y * kj, 0.0), "i", "K")
            # the key side: each sub-chunk's rows summed into its row jj
            k.acc(dKi, k.where(row, k.subchunk_sum(Y, dQi), 0.0))
            k.acc(dbx, E - k.where(row, k.subchunk_sum(E, dQi), 0.0))
        k.let(dQ, dQi + Gq * eb, "i", "K")
        if prev:
            self._moved_back(k, dK, dKi, "i", "K")
            self._moved_back(k, dV, dVx, "i", "V")
            self._moved_back(k, db, dbx, "i", "K")
        else:
            k.let(dK, dKi, "i", "K")
            k.let(dV, dVx, "i", "V")
            k.let(db, dbx, "i", "K")
        return k.lines()

    def chunk_advance_backward(self, code, st, parts, G):
        """Given d = dL/dS_C; _dbl_<S> [K]: the gradient of b at the chunk's last token. That
        token's key weight exp(b_C - b_last) = 1 spans no log decay (its -F into db and +F into
        _dbl cancel in math, not in fp32): dropped from both."""
        dK, dV, dS0, db = code.grad_names(G, "u", with_db=True)
        k = code.builder(st)
        n = st.name
        K, V, d, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state_grad(), k.state()
        bl0, kw = k.block(f"_bl0_{n}", "K"), k.block(f"_kw_{n}", "i", "K")
        w = k.let("_w", k.exp(kw), "i", "K")
        k.let(dS0, k.exp(bl0) * d, "K", "V")
        k.let(dV, k.dot(K * w, d), "i", "V")
        dKw = k.let("_dKw", k.dot(V, k.trans(d)), "i", "K")
        k.let(dK, dKw * w, "i", "K")
        F = k.let("_F", k.where(k.offs.eq(k.n_valid - 1), 0.0, dKw * K * w), "i", "K")
        k.let(db, -F, "i", "K")
        k.let(f"_dbl_{n}", k.sum(F, "i") + k.sum(s * d, "V") * k.exp(bl0), "K")
        return k.lines()

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "key"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H, K]
        bq = b_excl if prev else b
        w = torch.exp(ops.loop_pair_logs(g, prev))                                # [B, i, j, H, K]
        A = torch.einsum("bihk,bjhk,bijhk->bhij", Q, K, w)
        return torch.einsum("bihk,bhkv->bihv", Q * bq.exp(), S) + torch.einsum("bhij,bjhv->bihv", A, V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        w = torch.exp(sfx)                                                        # [B, c, H, K]
        return bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", K * w, V)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi.unsqueeze(-1) * S                    # phi [n, H, KF]


UNIT = KeyDiagonal()

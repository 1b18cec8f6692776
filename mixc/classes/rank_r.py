"""The rank-r correction: S_t = diag(a_t) S_{t-1} + sum_{i=1..r} l_{t,i} (r_{t,i} . S_{t-1}) + B_t,
r >= 2 projection terms, each over exactly the key dims, with the decay a_t a scalar or over
the key dims: rank1.py's claim with r terms (DeltaProduct with r Householder steps per token,
written nested or expanded; derive/affine.py distributes and merges the terms, so r is the
number of distinct projections r_i).

Its parallel form is the generalized UT transform on chunks: the C tokens' r terms give C*r
unknown rows u_{t,i} = r~_{t,i} . X_{t-1}, and X_{t-1} sums over the earlier tokens' terms, so the
rows solve one [C*r, C*r] unit lower triangular system, block triangular in tokens with [r, r]
blocks (a token's r terms all read S_{t-1}: its diagonal block is 0). The Triton chunked
kernels (the kernel stages below) keep that system as r x r blocks [C, C]; the
torch backend's chunked form (below) serves mode='torch'."""
from __future__ import annotations

from ..dsl.unparse import expr_text
from .base import TransitionClass, UpdateShape, projection_shard_apply, projection_shard_map, torch_form


class RankR(TransitionClass):
    name = "rank-r correction"
    hardness = 5.5                          # between rank-1 (5) and general linear (6)
    parallel_form = "chunk"                 # the generalized UT transform (the kernel stages below)
    torch_chunked = True                    # the torch form below serves mode='torch'
    term_axes = True                        # L, R [.., r, KF]; K, V [.., m, *]: B_t = sum_m k_m v_m^T
    # r corrections per token amplify a rounded chunk-start state: gated_delta_product's bf16
    # checkpoints cost its gradients 2.3e-2 against 1.3e-2 with fp32 ones (bench/gpu_check
    # --dry-run, 2026-12-04), past the 2e-2 bound; fp32 checkpoints, bf16 matmuls as before
    half_checkpoints = False

    def claims(self, u: UpdateShape) -> bool:
        key = set(u.key_dims)
        return (len(u.projections) >= 2 and set(u.decay_dims) <= key
                and all(set(t.over) == key and set(t.proj_dims) <= key
                        and (t.scale_dims is None or set(t.scale_dims) <= key) for t in u.projections))

    def explain_chunk(self, st, s) -> list[str]:
        S, r = st.name, len(st.rank1)
        per_key = f" (a vector over {', '.join(st.decay_dims)})" if st.decay_dims else ""
        terms = "; ".join(f"l_{i + 1} = {s(t.left)}, r_{i + 1} = {s(t.right)}" for i, t in enumerate(st.rank1))
        pieces = st.ir_pieces.inputs if st.ir_pieces is not None else ()
        inputs = ("; ".join(f"k_{i + 1} = {expr_text(k)}, v_{i + 1} = {expr_text(v)}" for i, (k, v) in enumerate(pieces))
                  if pieces else "it is not a sum of outer products: the torch chunked form cannot take it")
        return [f"transition: {S}_t = a_t {S}_{{t-1}} + sum_{{i=1..{r}}} l_i,t (r_i,t . {S}_{{t-1}}) + B_t, "
                f"rank r = {r}: a = {s(st.decay)}{per_key}; {terms}",
                f"the chunked form is the generalized UT transform: X_t = exp(-b_t) {S}_t, the C*r rows "
                f"u_(t,i) = r~_t,i . X_{{t-1}} of a chunk solve one [C*{r}, C*{r}] unit lower triangular "
                f"system (I - A) U = R^ {S}0 + A_rk V, block triangular in tokens with [{r}, {r}] blocks "
                f"A_(t,i),(s,j) = r~_t,i . l~_s,j for s < t (a token's terms all read {S}_{{t-1}})",
                f"B_t = sum_m k_m v_m^T, m = {len(pieces)} outer products (K, V rows with an m axis): {inputs}",
                f"the chunked kernels solve it as {r} x {r} blocks [C, C] (token rows), by forward substitution "
                f"over the C tokens ({r} rows each); O = (Q * exp(b)) {S}0 + sum_i [A_ql_i]_(t >= s) U_i + "
                f"sum_m [A_qk_m]_(t >= s) V_m, {S}_C = exp(b_C) {S}0 + sum_i (L_i * exp(b_C - b))^T U_i + "
                "sum_m (K_m * exp(b_C - b))^T V_m; the torch backend runs this chunked form (mode='torch')"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py), built as kernel IR ----
    # The generalized UT transform (DeltaProduct with r Householder steps per token):
    # S_t = diag(a_t) S_{t-1} + sum_{i<r} l_(t,i) (r_(t,i) . S_{t-1}) + B_t, B_t = sum_{m<M}
    # k_(t,m) v_(t,m)^T, a_t a scalar or over the key dims. Notation as rank1.py's stages, with
    # lists: Ls, Rs the r terms' left and right matrices [i, K]; Ks, Vs the M input terms' key and
    # value matrices [i, K], [i, V]; U_<S>_i [i, V] the rows u_(t,i) of term i. The C*r unknown
    # rows u_(t,i) = r~_(t,i) . X_{t-1} (X_t = exp(-b_t) S_t) solve one [C*r, C*r] unit lower
    # triangular system, kept here as r x r blocks [C, C] (token rows, term blocks), each strictly
    # lower triangular in tokens (a token's r terms all read S_{t-1}: its diagonal [r, r] block is 0):
    #
    #     (I - A) U = R^ S0 + A_rk V,  A_ij[t, s] = sum_d r_(t,i)d l_(s,j)d exp(b_{t-1,d} - b_sd)  (s < t)
    #     R_out = (Q * exp(bq0)) S0 + sum_j [A_ql_j]_(t >= s) U_j + sum_m [A_qk_m]_(t >= s) V_m
    #     S_C   = exp(bl0) S0 + sum_j (L_j * exp(kw))^T U_j + sum_m (K_m * exp(kw))^T V_m
    #
    # The blocks keep every matrix a plain [C, *] one (no reshape of [C, r, K] into C*r rows): the
    # forward substitution walks the C tokens, each step giving the r rows of one token from the
    # rows above it (r^2 row reads per token, as C*r steps of one read over C*r rows would). A
    # scalar decay makes each block (R_i L_j^T) * exp(b_{t-1} - b_s), one matmul; a per-key decay
    # makes them [C, C, K] blocks. code.extra[S] holds the state's own matrices (sanitized):
    # L<i>, R<i> for the r terms (StateIR.terms) and K<m>, V<m> for B_t's m outer products
    # (StateIR.inputs); the generic K, V are None (B_t is no single outer product). The backward
    # keeps each term's gradient list in G under dL<i>, dU<i>, dK<m>, dV<m>.
    def chunk_inputs(self, code, st, em, kd) -> dict[str, str]:
        vd = tuple(d for d in code.order if d in set(st.value_dims)) or ("_1",)
        out = {}
        for i, (left, right) in enumerate(st.ir_pieces.terms):
            out[f"L{i}"], out[f"R{i}"] = code.matrix(em, em(left), kd), code.matrix(em, em(right), kd)
        for m, (key, value) in enumerate(st.ir_pieces.inputs):
            out[f"K{m}"], out[f"V{m}"] = code.matrix(em, em(key), kd), code.matrix(em, em(value), vd)
        return out

    @staticmethod
    def _mats(k) -> dict[str, list]:
        """The terms' L, R and the inputs' K, V as the builder's blocks."""
        x, p = k.code.extra[k.st.name], k.st.ir_pieces
        return {"Ls": [k.block(x[f"L{i}"], "i", "K") for i in range(len(p.terms))],
                "Rs": [k.block(x[f"R{i}"], "i", "K") for i in range(len(p.terms))],
                "Ks": [k.block(x[f"K{m}"], "i", "K") for m in range(len(p.inputs))],
                "Vs": [k.block(x[f"V{m}"], "i", "V") for m in range(len(p.inputs))]}

    def chunk_size(self, st) -> int:
        # the r terms' U rows [C, VF] each, the r^2 blocks A_ij and r M blocks A_rk [C, C] (and
        # their adjoints in the backward) stay live: r times rank-1's (32) registers at C = 32,
        # so C = 16 for r = 2; a per-key decay makes every block [C, C, K]: 16 as rank-1's
        return 16

    @staticmethod
    def _pair_block(k, ax):
        """The [i, j] block of the rows of X against those of Y with pair weights W."""
        if ax:
            return lambda X, Y, W: k.sum(X * k.at_keys(Y) * W, "K")
        return lambda X, Y, W: k.dot(X, k.trans(k.at_keys(Y))) * W

    @staticmethod
    def _setup_pairs(k):
        """bx0 = b_{t-1} where no reset precedes, and E, the setup's pair weights exp(b_{t-1} - b_s), s < t."""
        n, ax = k.st.name, k.decay_axes()
        b, bx, zx = (k.block(f"_{x}_{n}", "i", *ax) for x in ("b", "bx", "zx"))
        bx0 = k.let(f"_bx0_{n}", k.where(zx > 0, -k.INF, bx), "i", *ax)
        return bx0, b, bx

    @staticmethod
    def _weights(k, b, bx):
        ax = k.decay_axes()
        return k.exp(k.where((k.row_i > k.key_j) & k.pair_ok(f"_zx_{k.st.name}"), bx - k.at_keys(b), -k.INF)), ax

    def chunk_setup(self, code, st, parts) -> list[str]:
        """After the shifted rows bx, zx: the blocks A_ij, A_rk_im, R^_i = R_i * exp(b_{t-1}) and U_i,
        then the block forward substitution: row t of every U_i from the rows s < t of all U_j."""
        n = st.name
        pre = [code.shifted(st, f"_b_{n}", f"_bx_{n}"), code.shifted(st, f"_z_{n}", f"_zx_{n}")]
        k = code.builder(st)
        M, s = self._mats(k), k.state()
        bx0, b, bx = self._setup_pairs(k)
        weights, ax = self._weights(k, b, bx)
        E = k.let("_E", weights, "i", "j", *ax)
        pairs = self._pair_block(k, ax)
        Arl, U = {}, []
        for i, R in enumerate(M["Rs"]):
            for j, L in enumerate(M["Ls"]):
                Arl[i, j] = k.let(f"_Arl_{n}_{i}_{j}", pairs(R, L, E), "i", "j")
            Ark = [k.let(f"_Ark_{n}_{i}_{m}", pairs(R, K, E), "i", "j") for m, K in enumerate(M["Ks"])]
            Rh = k.let(f"_Rh_{n}_{i}", R * k.exp(bx0), "i", "K")
            y = k.dot(Rh, s)
            for A, V in zip(Ark, M["Vs"]):
                y = y + k.dot(A, k.at_keys(V))
            U.append(k.let(f"_U_{n}_{i}", y, "i", "V"))
        r = len(U)
        with k.loop("_j", 1, k.rows_block) as t:
            sel = k.let("_sel", k.offs.eq(t), "i")
            nu = []
            for i in range(r):
                row = None
                for j in range(r):          # row t of A_ij times U_j, summed over the rows s
                    x = k.sum(k.where(sel, Arl[i, j], 0.0), "i") * k.at_keys(U[j])
                    row = x if row is None else row + x
                nu.append(k.let(f"_nu{i}", k.sum(row, "j"), "V"))
            for i in range(r):
                k.let(U[i], k.where(sel, U[i] + nu[i], U[i]), "i", "V")
        return pre + k.lines()

    def _query(self, k, prev: bool):
        """b at the query rows, their weight from the chunk's start, the no-reset pair mask."""
        n, x, ax = k.st.name, "x" if prev else "", k.decay_axes()
        return (k.block(f"_b{x}_{n}", "i", *ax), k.block(f"_b{x}0_{n}", "i", *ax), k.pair_ok(f"_z{x}_{n}"))

    def _us(self, k):
        return [k.block(f"_U_{k.st.name}_{j}", "i", "V") for j in range(len(k.st.ir_pieces.terms))]

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        k = code.builder(st)
        M, s, ax = self._mats(k), k.state(), k.decay_axes()
        Q, b = k.block(Q, "i", "K"), k.block(f"_b_{st.name}", "i", *ax)
        bq, bq0, ok = self._query(k, prev)
        D = k.let("_D", k.exp(k.where(k.causal(prev) & ok, bq - k.at_keys(b), -k.INF)), "i", "j", *ax)
        pairs = self._pair_block(k, ax)
        out = k.let(R, k.dot(Q * k.exp(bq0), s), "i", "V")
        for L, U in zip(M["Ls"], self._us(k)):
            out = k.let(out, out + k.dot(pairs(Q, L, D), k.at_keys(U)), "i", "V")
        for K_, V_ in zip(M["Ks"], M["Vs"]):
            out = k.let(out, out + k.dot(pairs(Q, K_, D), k.at_keys(V_)), "i", "V")
        return k.lines()

    def chunk_advance(self, code, st, parts) -> list[str]:
        k = code.builder(st)
        M, s, ax, n = self._mats(k), k.state(), k.decay_axes(), st.name
        w = k.let("_w", k.exp(k.block(f"_kw_{n}", "i", *ax)), "i", *ax)
        S = k.let("_S", k.exp(k.block(f"_bl0_{n}", *ax)) * s, "K", "V")
        for L, U in zip(M["Ls"], self._us(k)):
            S = k.let(S, S + k.dot(k.trans(L * w), U), "K", "V")
        for K_, V_ in zip(M["Ks"], M["Vs"]):
            S = k.let(S, S + k.dot(k.trans(K_ * w), V_), "K", "V")
        k.let(s, S, "K", "V")
        return k.lines()

    def _grads(self, code, st, G, stem: str) -> dict:
        """Fresh names of one stage's dS0, db and per term (j, dL_j, dU_j), per input (m, dK_m,
        dV_m); registered in G."""
        t, p = code.fresh(stem), st.ir_pieces
        G["dS0"].append(f"_dS0{t}")
        G["db"].append(f"_db{t}")
        lu = [(j, f"_dL{t}_{j}", f"_dU{t}_{j}") for j in range(len(p.terms))]
        kv = [(m, f"_dK{t}_{m}", f"_dV{t}_{m}") for m in range(len(p.inputs))]
        for j, dL, dU in lu:
            G.setdefault(f"dL{j}", []).append(dL)
            G.setdefault(f"dU{j}", []).append(dU)
        for m, dK, dV in kv:
            G.setdefault(f"dK{m}", []).append(dK)
            G.setdefault(f"dV{m}", []).append(dV)
        return {"dS0": f"_dS0{t}", "db": f"_db{t}", "lu": lu, "kv": kv}

    def _parts(self, k, names):
        """(X, Y, dX, dY) per term (L_j, U_j) and per input (K_m, V_m), as the adjoints pair them."""
        M, Us = self._mats(k), self._us(k)
        return ([(M["Ls"][j], Us[j], dL, dU) for j, dL, dU in names["lu"]]
                + [(M["Ks"][m], M["Vs"][m], dK, dV) for m, dK, dV in names["kv"]])

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        """dR = dL/dR [i, V]: assigns dQ and this readout's dS0, db and per term dL_j, dU_j, per
        input dK_m, dV_m (db: the keys' side; _dbq, the query rows' side, goes into db after
        this: ChunkBackward.query_side). As rank1.py's, summed over the terms: the pair of a row
        with the token it reads last spans no log decay, dropped from E."""
        names = self._grads(code, st, G, "w")
        k = code.builder(st)
        s, ax = k.state(), k.decay_axes()
        Q, dR, b = k.block(Q, "i", "K"), k.block(dR, "i", "V"), k.block(f"_b_{st.name}", "i", *ax)
        bq, bq0, ok = self._query(k, prev)
        eb = k.let("_eb", k.exp(bq0), "i", *ax)
        Gq = k.let("_Gq", k.dot(dR, k.trans(s)), "i", "K")
        D = k.let("_D", k.exp(k.where(k.causal(prev) & ok, bq - k.at_keys(b), -k.INF)), "i", "j", *ax)
        dq = k.let(dQ, Gq * eb, "i", "K")
        E = k.let("_E", k.zeros_like(D, f32=False), "i", "j", *ax)
        for X, Y, dX, dY in self._parts(k, names):
            if not ax:
                A = k.let("_A", k.dot(Q, k.trans(k.at_keys(X))) * D, "i", "j")
                dA = k.let("_dA", k.dot(dR, k.trans(k.at_keys(Y))), "i", "j")
                dq = k.let(dq, dq + k.dot(dA * D, k.at_keys(X)), "i", "K")
                k.let(dX, k.at_rows(k.dot(k.trans(dA * D), Q)), "i", "K")
                k.let(dY, k.at_rows(k.dot(k.trans(A), dR)), "i", "V")
                E = k.let(E, E + dA * A, "i", "j")
            else:
                A = k.let("_A", k.sum(Q * k.at_keys(X) * D, "K"), "i", "j")
                Xd = k.let("_Xd", k.dot(dR, k.trans(k.at_keys(Y))) * D, "i", "j", "K")
                dq = k.let(dq, dq + k.sum(Xd * k.at_keys(X), "j"), "i", "K")
                k.let(dX, k.at_rows(k.sum(Xd * Q, "i")), "i", "K")
                k.let(dY, k.at_rows(k.dot(k.trans(A), dR)), "i", "V")
                E = k.let(E, E + Xd * Q * k.at_keys(X), "i", "j", "K")
        k.let(names["dS0"], k.dot(k.trans(Q * eb), dR), "K", "V")
        E = k.let(E, k.where(k.row_i - int(prev) > k.key_j, E, 0.0), "i", "j", *ax)
        k.let("_dbq", k.sum(E, "j") + (Gq * Q * eb if ax else k.sum(Gq * Q, "K") * eb), "i", *ax)
        k.let(names["db"], -k.at_rows(k.sum(E, "i")), "i", *ax)
        return k.lines() + code.query_side(st, names["db"], prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        """Given d = dL/dS_C: the update's dS0, db, per term dL_j, dU_j, per input dK_m, dV_m;
        _dbl_<S> the gradient of b at the chunk's last token, whose key weight exp(b_C - b_last) = 1
        spans no log decay (dropped, as in rank1.py)."""
        names = self._grads(code, st, G, "w")
        k = code.builder(st)
        s, d, ax, n = k.state(), k.state_grad(), k.decay_axes(), st.name
        kw, bl0 = k.block(f"_kw_{n}", "i", *ax), k.block(f"_bl0_{n}", *ax)
        w = k.let("_w", k.exp(kw), "i", *ax)
        k.let(names["dS0"], k.exp(bl0) * d, "K", "V")
        F = k.let("_F", k.zeros_like(kw, f32=False), "i", *ax)
        for X, Y, dX, dY in self._parts(k, names):
            dXw = k.let("_dXw", k.dot(Y, k.trans(d)), "i", "K")
            k.let(dX, dXw * w, "i", "K")
            k.let(dY, k.dot(X * w, d), "i", "V")
            F = k.let(F, F + (dXw * X if ax else k.sum(dXw * X, "K")), "i", *ax)
        F = k.let(F, k.where(k.offs.eq(k.n_valid - 1), 0.0, F * w), "i", *ax)
        k.let(names["db"], -F, "i", *ax)
        k.let(f"_dbl_{n}", k.sum(F, "i") + (k.sum(s * d, "V") if ax else k.sum(s * d)) * k.exp(bl0), *ax)
        return k.lines()

    def chunk_setup_backward(self, code, st, parts, G) -> tuple[list[str], list]:
        """Back through setup, (I - A) U = R^ S0 + A_rk V, given dU_i (every dU of term i above):
        dY = (I - A)^-T dU by block back substitution (last token first), dA_ij = dY_i U_j^T and
        dA_rk_im = dY_i V_m^T below the diagonal; assigns dR_i and this stage's dS0, db, dL_j,
        dK_m, dV_m. b_{t-1}'s gradient _dbx goes to row t - 1."""
        K, V, g, kd, vd = parts
        n, p = st.name, st.ir_pieces
        dUs = [list(G[f"dU{j}"]) for j in range(len(p.terms))]      # the readouts' and the update's
        names = self._grads(code, st, G, "y")
        dRs = [code.fresh("dRt") for _ in p.terms]
        k = code.builder(st)
        M, s, ax, r = self._mats(k), k.state(), k.decay_axes(), len(p.terms)
        dY = []
        for i in range(r):
            total = None
            for x in dUs[i]:
                total = k.block(x, "i", "V") if total is None else total + k.block(x, "i", "V")
            dY.append(k.let(f"_dY{i}", total, "i", "V"))
        Arl = {(i, j): k.block(f"_Arl_{n}_{i}_{j}", "i", "j") for i in range(r) for j in range(r)}
        with k.loop("_jj", 1, k.rows_block) as jj:
            t = k.let("_s", k.rows_block - 1 - jj)
            sel = k.let("_sel", k.offs.eq(t), "i")
            nu = []
            for j in range(r):
                col = None
                for i in range(r):          # column t of A_ij times dY_i, summed over the rows
                    x = k.sum(k.where(k.key_j.eq(t), Arl[i, j], 0.0), "j") * dY[i]
                    col = x if col is None else col + x
                nu.append(k.let(f"_nu{j}", k.sum(col, "i"), "V"))
            for j in range(r):
                k.let(dY[j], k.where(sel, dY[j] + nu[j], dY[j]), "i", "V")
        b, bx = k.block(f"_b_{n}", "i", *ax), k.block(f"_bx_{n}", "i", *ax)
        weights, _ = self._weights(k, b, bx)
        E = k.let("_E", weights, "i", "j", *ax)
        Ey = k.let("_Ey", k.zeros_like(E, f32=False), "i", "j", *ax)
        dbx = k.let("_dbx", k.zeros_like(b, f32=False), "i", *ax)
        Rh = [k.block(f"_Rh_{n}_{i}", "i", "K") for i in range(r)]
        total = None
        for i in range(r):
            x = k.dot(k.trans(Rh[i]), dY[i])
            total = x if total is None else total + x
        k.let(names["dS0"], total, "K", "V")
        for m, _, dV in names["kv"]:
            total = None
            for i in range(r):
                x = k.at_rows(k.dot(k.trans(k.block(f"_Ark_{n}_{i}_{m}", "i", "j")), dY[i]))
                total = x if total is None else total + x
            k.let(dV, total, "i", "V")
        bx0 = k.block(f"_bx0_{n}", "i", *ax)
        Us = self._us(k)
        terms = ([(M["Ls"][j], Us[j], dL, f"_Arl_{n}_{{i}}_{j}") for j, dL, _ in names["lu"]]
                 + [(M["Ks"][m], M["Vs"][m], dK, f"_Ark_{n}_{{i}}_{m}") for m, dK, _ in names["kv"]])
        below = k.row_i > k.key_j
        for i in range(r):
            R = M["Rs"][i]
            dRh = k.let("_dRh", k.dot(dY[i], k.trans(s)), "i", "K")
            dR = k.let(dRs[i], dRh * k.exp(bx0), "i", "K")
            dbx = k.let(dbx, dbx + (dRh * Rh[i] if ax else k.sum(dRh * Rh[i], "K")), "i", *ax)
            for X, Y, dX, A in terms:
                A = k.block(A.format(i=i), "i", "j")
                dA = k.let("_dA", k.where(below, k.dot(dY[i], k.trans(k.at_keys(Y))), 0.0), "i", "j")
                if not ax:
                    P = k.let("_P", dA * E, "i", "j")
                    dR = k.let(dR, dR + k.dot(P, k.at_keys(X)), "i", "K")
                    grad = k.at_rows(k.dot(k.trans(P), R))
                    Ey = k.let(Ey, Ey + dA * A, "i", "j")
                else:
                    P = k.let("_P", dA * E, "i", "j", "K")
                    dR = k.let(dR, dR + k.sum(P * k.at_keys(X), "j"), "i", "K")
                    grad = k.at_rows(k.sum(P * R, "i"))
                    Ey = k.let(Ey, Ey + P * R * k.at_keys(X), "i", "j", "K")
                k.let(dX, grad if i == 0 else k.block(dX, "i", "K") + grad, "i", "K")
        Ey = k.let(Ey, k.where(k.row_i - 1 > k.key_j, Ey, 0.0), "i", "j", *ax)
        dbx = k.let(dbx, dbx + k.sum(Ey, "j"), "i", *ax)
        # b_{t-1}'s gradient, row t's, goes to row t - 1
        k.let(names["db"], -k.at_rows(k.sum(Ey, "i")) + k.sum(k.where((k.key_j - 1).eq(k.row_i), k.at_keys(dbx), 0.0), "j"),
              "i", *ax)
        rows, vrows = ("_T",) + kd, ("_T",) + vd      # dR, dL, dK, dV seed the spec's terms and inputs
        seeds = []
        for j, (left, right) in enumerate(p.terms):
            seeds += [(right, code.unflat(dRs[j], rows), rows),
                      (left, code.unflat(" + ".join(G[f"dL{j}"]), rows), rows)]
        for m, (key, value) in enumerate(p.inputs):
            seeds += [(key, code.unflat(" + ".join(G[f"dK{m}"]), rows), rows),
                      (value, code.unflat(" + ".join(G[f"dV{m}"]), vrows), vrows)]
        return k.lines(), seeds

    # ---- torch form ----
    # The generalized UT transform on one chunk, in the chunk-at-a-time layout of base.py's
    # torch form with a term axis: L, R [B, c, H, r, KF] (the r terms l_(t,i), r_(t,i) of a
    # token), K [B, c, H, m, KF] and V [B, c, H, m, VF] (B_t = sum_m k_(t,m) v_(t,m)^T: DeltaProduct's
    # input term is a sum of n outer products), S [B, H, KF, VF], bb the chunk's logs
    # (torch_ops.loop_chunk_logs). The plan carries the r (left, right) terms and the m (key,
    # value) pieces of B_t (StateIR.terms, .inputs); codegen/torch_module.py stacks them on axis 3
    # and runtime/torch_chunk.py's loop hands them here. Checked in float64 against fla's loop
    # with autograd's gradients (tests/ops/test_rank_r_torch_form.py: the form alone; and
    # test_rank_r_torch_mode.py: the op in mode='torch'). Only the chunk-at-a-time loop:
    torch_batched = False                   # no batched form (runtime/torch_chunk.py torch_forward_batched) yet

    def decay_axis(self, st) -> str | None:
        return "key" if st.decay_dims else "scalar"

    @staticmethod
    def _pairs(st, X, Y, w):
        """[B, H, t, i, s, j] = sum_k X[b, t, h, i, k] Y[b, s, h, j, k] w[t, s]: w the pair weights
        [B, t, s, H, K] of a per-key decay, or [B, t, s, H] of a scalar one, applied after the
        contraction over k for a scalar decay (DeltaProduct's): no [t, s, K] weights, a chunk's
        forward 3-6x faster at C = K = V = 64 on CPU."""
        torch, _ = torch_form()
        if st["decay"] != "scalar":
            return torch.einsum("bthik,bshjk,btshk->bhtisj", X, Y, w)
        return torch.einsum("bthik,bshjk->bhtisj", X, Y) * w.permute(0, 3, 1, 2)[:, :, :, None, :, None]

    @staticmethod
    def _on_keys(st, x):
        """A chunk's log weight per row [B, c, H(, K)] as a factor on [B, c, H, *, K] rows."""
        return x.exp().unsqueeze(3) if st["decay"] != "scalar" else x.exp()[..., None, None]

    def torch_setup(self, st, K, V, L, R, S, bb):
        """The C*r rows u_(t,i) = r~_(t,i) . X_{t-1} of a chunk, X_t = exp(-b_t) S_t: with
        E[t, s] = exp(b_{t-1} - b_s) (per key with a per-key decay; s < t, per pair: loop_pair_logs),

            (I - A_rl) U = R^ S0 + A_rk V,   A_xy[(t,i), (s,j)] = sum_k x_(t,i)k y_(s,j)k E[t, s]_k

        a [C*r, C*r] unit lower triangular system, block triangular in tokens (a token's r
        terms all read S_{t-1}: E is -inf, its exp 0, on the diagonal blocks). R^ = R exp(b_{t-1}).
        Returns (U [B, c, H, r, VF], the chunk's logs)."""
        torch, ops = torch_form()
        B, c, H, r, _ = R.shape
        E = torch.exp(ops.loop_pair_logs(bb[4], True))                            # [B, t, s, H(, K)]
        A_rl = self._pairs(st, R, L, E).reshape(B, H, c * r, c * r)
        A_rk = self._pairs(st, R, K, E).reshape(B, H, c * r, -1)
        Vf = V.permute(0, 2, 1, 3, 4).reshape(B, H, -1, V.shape[-1])              # rows (s, m)
        Rh = (R * self._on_keys(st, bb[2])).permute(0, 2, 1, 3, 4).reshape(B, H, c * r, -1)
        Y = torch.einsum("bhxk,bhkv->bhxv", Rh, S) + torch.einsum("bhxy,bhyv->bhxv", A_rk, Vf)
        eye = torch.eye(c * r, dtype=K.dtype, device=K.device)
        U = torch.linalg.solve_triangular(eye - A_rl, Y, upper=False, unitriangular=True)
        return U.reshape(B, H, c, r, -1).permute(0, 2, 1, 3, 4), bb

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        """q . S_t (S_{t-1} with prev) for the chunk's rows Q [B, c, H, KF]: X_0 = S0 and every
        earlier (or this) token's l~ u and k~ v terms."""
        torch, ops = torch_form()
        U, bb = ctx
        bq = bb[2] if prev else bb[0]
        w = torch.exp(ops.loop_pair_logs(bb[4], prev))                            # [B, t, s, H(, K)]
        Q1 = Q.unsqueeze(3)                                                       # one "term" per row
        A_ql, A_qk = self._pairs(st, Q1, L, w)[:, :, :, 0], self._pairs(st, Q1, K, w)[:, :, :, 0]
        return (torch.einsum("bthk,bhkv->bthv", (Q1 * self._on_keys(st, bq))[:, :, :, 0], S)
                + torch.einsum("bhtsj,bshjv->bthv", A_ql, U) + torch.einsum("bhtsm,bshmv->bthv", A_qk, V))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        """S_C = exp(b_C) S0 + sum_(s,j) l_(s,j) exp(b_C - b_s) u_(s,j)^T + the k v terms alike."""
        torch, _ = torch_form()
        U, bb = ctx
        bl, w = bb[1], self._on_keys(st, bb[3])                                  # w [B, c, H, 1, K or 1]
        b0 = bl.exp().unsqueeze(-1) if st["decay"] != "scalar" else bl.exp()[..., None, None]
        return (b0 * S + torch.einsum("bshjk,bshjv->bhkv", L * w, U)
                + torch.einsum("bshmk,bshmv->bhkv", K * w, V))

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_transition(self, st, pc, name, n, H):
        """The [KF, KF] map of a shard, the product of the tokens' (a_t + sum_i l_t,i r_t,i^T): the
        torch form's chunks run on S0 = I with every v = 0 (rank1.py's, with the term axes)."""
        return projection_shard_map(self, st, pc, name, n, H)

    def cp_apply(self, st, phi, S):
        return projection_shard_apply(phi, S)


UNIT = RankR()

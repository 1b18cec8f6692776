"""The rank-1 correction: S_t = diag(a_t) S_{t-1} + l_t (r_t . S_{t-1}) + B_t with the
decay a_t a scalar or over the key dims (DeltaNet, gated DeltaNet, Comba, KDA, Longhorn):
the chunked WY/UT form, a [C, C] triangular solve per chunk."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, projection_shard_apply, projection_shard_map, torch_form


class Rank1(TransitionClass):
    name = "rank-1 correction"
    single_projection = True
    keyed_left = True
    hardness = 5
    parallel_form = "chunk"
    torch_chunked = True
    template = "rank1.j2"

    def claims(self, u: UpdateShape) -> bool:
        if len(u.projections) != 1:
            return False
        t = u.projections[0]
        return (set(t.over) == set(u.key_dims) and set(t.proj_dims) <= set(t.over)
                and (t.scale_dims is None or set(t.scale_dims) <= set(t.over))
                and set(u.decay_dims) <= set(u.key_dims))

    # the backward's blocks of V: its tile loop holds the chunk's K, three [C, K] and four [C, C]
    # sums and matrices beside each block's [K, V-block] states (S0, dL/dS); at C = 64 and K = V =
    # 128 on sm_90 the gated delta rule's two launches spill 332 + 1644 B with blocks of 64 (the
    # corrected values, rank1.j2), 148 + 736 with 32, 104 + 684 with 16 (bench/README.md)
    backward_tile = 16
    # the intra kernel can stage each chunk's (I - M)^-1 (launch.STAGE_SOLVE): the walk then takes U as one
    # matmul instead of C - 1 dependent substitution rows; on by default on CUDA (chosen by the
    # time model against its bytes and spills: standalone/launch_data.py, stage_solve)
    stages_solve = True

    def chunk_size(self, st) -> int:
        # a per-key decay makes the A blocks [C, C, K]; otherwise C = 64 (fla's BT): with the
        # corrected values (a scaled-key left, rank1.j2) the walk spills nothing on sm_90 at
        # K = V = 128, the output kernel nothing with a chunk a program (checkpoint_tokens)
        return 16 if st.decay_dims else 64

    def checkpoint_tokens(self, st) -> int | None:
        # the output kernel walking 4 chunks of 64 from a checkpoint keeps the whole state and the chunk's
        # [C, K] blocks live (the advance reads R^ S0, a sum over the keys, before each key
        # block's update: no static key blocks): the delta rules spill 612 and 288 B on sm_90;
        # one chunk a program loops over key blocks (codegen/key_split.py) and spills nothing
        return None if st.decay_dims else 64

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        r = st.rank1[0]
        per_key = f" (a vector over {', '.join(st.decay_dims)})" if st.decay_dims else ""
        return [f"transition: {S}_t = a_t {S}_{{t-1}} + l_t (r_t . {S}_{{t-1}}) + B_t with a = {s(st.decay)}, "
                f"l = {s(r.left)}, r = {s(r.right)}",
                f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk{per_key}; L, R = rows of l, r",
                f"X_t = exp(-b_t) {S}_t gains l~_t u_t^T + k~_t v_t^T per token, u_t = r~_t . X_{{t-1}}:",
                "A_xy[j, i] = sum_k x_jk y_ik exp(b_{j-1,k} - b_ik) for i < j   (A_rl from R, L; A_rk from R, K)",
                f"U   = (I - A_rl)^-1 ((R * exp(b_{{j-1}})) {S}0 + A_rk V)   the triangular solve: forward "
                "substitution (W = (I - A_rl)^-1 R^ and U' = (I - A_rl)^-1 A_rk V, U = W S0 + U')",
                f"O   = (Q * exp(b)) {S}0 + [A_ql]_(i >= j) U + [A_qk]_(i >= j) V    (A_q. with exp(b_i - b_j))",
                f"{S}_C = exp(b_C) {S}0 + (L * exp(b_C - b))^T U + (K * exp(b_C - b))^T V",
                "only exponents b_{j-1} - b_i (i < j), b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"] + (
                [f"l = c k with c = {s(r.left / st.key)}: the kernels carry the corrected values N = V + c U "
                 "(A_rl = A_rk diag(c)): (I - diag(c) A_rk) N = V + c (R * exp(b_{j-1})) "
                 f"{S}0, O = (Q * exp(b)) {S}0 + [A_qk]_(i >= j) N, {S}_C = exp(b_C) {S}0 + (K * exp(b_C - b))^T N"]
                if st.ir_pieces is not None and st.ir_pieces.left_scale is not None else [])

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # rank1.j2, its macros in two variants: vector, a scalar decay (gated DeltaNet's), else per
    # key (KDA's); and with c, a left that is a scaled key (the delta rules'), the chunk carries the
    # corrected values. code.extra[S] holds the state's L (or c, a [C] vector) and R (sanitized).
    def chunk_inputs(self, code, st, em, kd) -> dict[str, str]:
        pieces = st.ir_pieces                # left * (right @ S): the rows of l and r
        if pieces.left_scale is not None:    # left = c * key: c's rows, not L's
            return {"c": code.row_vector(em, em(pieces.left_scale)), "R": code.matrix(em, em(pieces.right), kd)}
        return {"L": code.matrix(em, em(pieces.left), kd), "R": code.matrix(em, em(pieces.right), kd)}

    @staticmethod
    def _left(code, st) -> dict:
        """The macros' L and c (one of them None)."""
        x = code.extra[st.name]
        return {"L": x.get("L"), "c": x.get("c")}

    def chunk_setup(self, code, st, parts) -> list[str]:
        K, V = parts[:2]
        n, LR = st.name, code.extra[st.name]
        return [code.shifted(st, f"_b_{n}", f"_bx_{n}"), code.shifted(st, f"_z_{n}", f"_zx_{n}")] + self.render(
            code, "setup", n=n, K=K, V=V, ok=code.pair_ok(st, f"_zx_{n}"), vector=self.decay_is_vector(st),
            **self._left(code, st), R=code.extra[st.name]["R"], slot=code.intra_slot())

    def _query(self, code, st, prev: bool) -> dict[str, str]:
        """b at the query rows, their weight from the chunk's start and the no-reset pair mask
        (b_{i-1} for prev: setup's shifted rows)."""
        n, x = st.name, "x" if prev else ""
        return {"bq": f"_b{x}_{n}", "bq0": f"_b{x}0_{n}", "ok": code.pair_ok(st, f"_z{x}_{n}")}

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        return self.render(code, "readout", n=st.name, R=R, Q=Q, K=K, V=V, prev=prev,
                           vector=self.decay_is_vector(st), **self._query(code, st, prev), **self._left(code, st))

    def chunk_advance(self, code, st, parts) -> list[str]:
        K, V = parts[:2]
        return self.render(code, "advance", n=st.name, K=K, V=V, vector=self.decay_is_vector(st),
                           **self._left(code, st))

    @staticmethod
    def _grads(code, st, G) -> dict[str, str]:
        """Fresh names of one stage's dK, dV, dS0, db, dL, dU, registered in G (with c, U holds
        the values: V's share is in dU, and there is no L)."""
        dK, dV, dS0, db = code.grad_names(G, "w", with_db=True)
        t = code.fresh("w")
        G["dU"].append(f"_dU{t}")
        if "c" in code.extra[st.name]:
            G["dV"].remove(dV)
        else:
            G["dL"].append(f"_dL{t}")
        return {"dK": dK, "dV": dV, "dS0": dS0, "db": db, "dL": f"_dL{t}", "dU": f"_dU{t}"}

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        names = self._grads(code, st, G)
        return self.render(code, "readout_backward", n=st.name, dR=dR, Q=Q, K=K, V=V, prev=prev,
                           vector=self.decay_is_vector(st), dQ=dQ, **self._query(code, st, prev),
                           **self._left(code, st), **names) + code.query_side(st, names["db"], prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        K, V = parts[:2]
        return self.render(code, "advance_backward", n=st.name, K=K, V=V, vector=self.decay_is_vector(st),
                           **self._left(code, st), **self._grads(code, st, G))

    def chunk_setup_backward(self, code, st, parts, G) -> tuple[list[str], list]:
        K, V, g, kd, vd = parts
        n, LR = st.name, code.extra[st.name]
        dR = code.fresh("dRt")
        dK, dV, dS0, db = code.grad_names(G, "y", with_db=True)
        dL, dc = f"_dL{code.fresh('y')}", code.fresh("dc")
        dU = " + ".join(G["dU"])             # every dU above: the readouts' and the update's
        rows = ("_T",) + kd                  # dR and dL (or dc) seed the spec's right and left
        seeds = [(st.ir_pieces.right, code.unflat(dR, rows), rows)]
        if "c" in LR:
            seeds.append((st.ir_pieces.left_scale, code.unflat(dc, ("_T",)), ("_T",)))
        else:
            G["dL"].append(dL)
            seeds.append((st.ir_pieces.left, code.unflat(" + ".join(G["dL"]), rows), rows))
        lines = self.render(code, "setup_backward", n=n, K=K, V=V, ok=code.pair_ok(st, f"_zx_{n}"),
                            vector=self.decay_is_vector(st), dU=dU, dR=dR, dK=dK, dV=dV, dS0=dS0, db=db, dL=dL,
                            dc=dc, **self._left(code, st), R=code.extra[st.name]["R"])
        return lines, seeds

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "key" if st.decay_dims else "scalar"     # the delta rule has g = 0 as a scalar

    def torch_setup(self, st, K, V, L, R, S, bb):
        """The WY/UT form of a chunk of S_t = D_t S_{t-1} + l_t (r_t . S_{t-1}) + k_t v_t^T (D_t =
        exp(g_t), a scalar or per key). With b the cumulative log decay in the chunk, the state
        divided by the decay, X_t = exp(-b_t) S_t, gains l~_t u_t^T + k~_t v_t^T per token, where
        u_t = r~_t . X_{t-1}; over the chunk the u solve one unit lower-triangular system:

            (I - A_rl) U = R^ S0 + A_rk V,   A_xy[j, i] = sum_k x_jk y_ik exp(b_{j-1,k} - b_ik), i < j

        with R^ = R * exp(b_{j-1}) (each exp(b_{j-1} - b_i) summed per pair: loop_pair_logs).
        Returns (U [B, c, H, VF], the chunk's logs per key)."""
        torch, ops = torch_form()
        if st["decay"] == "scalar":             # the same decay on every key
            bb = tuple(x.unsqueeze(-1).expand(x.shape + K.shape[-1:]) for x in bb)
        c = K.shape[1]
        E = torch.exp(ops.loop_pair_logs(bb[4], True))                            # [B, j, i, H, K]
        A_rl = torch.einsum("bjhk,bihk,bjihk->bhji", R, L, E)
        A_rk = torch.einsum("bjhk,bihk,bjihk->bhji", R, K, E)
        Y = torch.einsum("bjhk,bhkv->bhjv", R * bb[2].exp(), S) + torch.einsum("bhji,bihv->bhjv", A_rk, V)
        eye = torch.eye(c, dtype=K.dtype, device=K.device)
        U = torch.linalg.solve_triangular(eye - A_rl, Y, upper=False, unitriangular=True)
        return U.permute(0, 2, 1, 3), bb

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        """q . S_t (or S_{t-1}) for the chunk's rows: X_0 = S0 and the l~ u, k~ v terms so far."""
        torch, ops = torch_form()
        U, bb = ctx
        bq = bb[2] if prev else bb[0]
        w = torch.exp(ops.loop_pair_logs(bb[4], prev))
        A_ql = torch.einsum("bthk,bjhk,btjhk->bhtj", Q, L, w)
        A_qk = torch.einsum("bthk,bjhk,btjhk->bhtj", Q, K, w)
        return (torch.einsum("bthk,bhkv->bthv", Q * bq.exp(), S) + torch.einsum("bhtj,bjhv->bthv", A_ql, U)
                + torch.einsum("bhtj,bjhv->bthv", A_qk, V))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        """S_C = exp(b_C) S0 + (L * exp(b_C - b))^T U + (K * exp(b_C - b))^T V."""
        torch, _ = torch_form()
        U, bb = ctx
        bl, w = bb[1], torch.exp(bb[3])
        return (bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", L * w, U)
                + torch.einsum("bjhk,bjhv->bhkv", K * w, V))

    def torch_chunks_setup(self, dec, K, V, L, R):
        """The WY/UT form (torch_setup) for a group of chunks: (I - A_rl) U = R^ S0 + A_rk V,
        solved once as U = W0 + Wm S0, so the walk is two matmuls per chunk. (W0, Wm, the
        update's (L exp(b_C - b))^T).

        With left = c * key (L is then c [BH, N, C]: the delta rules' -beta, -a beta) the walk
        carries the corrected values U' = V + c U instead (the delta rule's beta (v - k . S)):
        A_rl = A_rk diag(c), so S_C = exp(b_C) S0 + K~^T U' and the readout is Q^ S0 + P U';
        and from (I - A_rk D) U = R^ S0 + A_rk V, U = R^ S0 + A_rk U', so
        (I - D A_rk) U' = V + D R^ S0 (D = diag(c)): one [C, C] product for the solve and one
        for the readout (not two each), no A_rk V and no separate K^T V."""
        torch, ops = torch_form()
        if L.dim() == K.dim() - 1:
            c = L.unsqueeze(-1)
            A = dec.product(R, K, True)                          # A_rk, strictly lower
            # unitriangular: the solve takes the diagonal as 1, so -D A serves for I - D A
            A = A.mul_(c).neg_() if dec.fast else -(A * c)
            sol = _solve_unit_lower(A, torch.cat([V, dec.on_keys(R, 2) * c], -1))
            vf = V.shape[-1]
            return sol[..., :vf], sol[..., vf:], dec.on_keys(K, 3).transpose(-1, -2)
        A_rl, A_rk = dec.product(R, L, True), dec.product(R, K, True)
        # unitriangular: the solve takes the diagonal as 1, so -A_rl serves for I - A_rl
        A = A_rl.neg_() if dec.fast else -A_rl
        sol = _solve_unit_lower(A, torch.cat([ops.mm(A_rk, V, fast=dec.fast), dec.on_keys(R, 2)], -1))
        vf = V.shape[-1]
        return sol[..., :vf], sol[..., vf:], dec.on_keys(L, 3).transpose(-1, -2)

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        _, ops = torch_form()
        if L.dim() == K.dim() - 1:                  # left = c * key: U holds V + c U (setup)
            val = ops.mm(dec.on_keys(Q, 2 if prev else 0), S_starts, fast=dec.fast)
            return ops.mm(dec.product(Q, K, prev), U, val, fast=dec.fast)
        val = super().torch_chunks_readout(dec, Q, K, V, L, S_starts, U, prev)
        return ops.mm(dec.product(Q, L, prev), U, val, fast=dec.fast)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_transition(self, st, pc, name, n, H):
        """The [KF, KF] map of a shard of S_t = D_t S_{t-1} + l_t (r_t . S_{t-1}) (+ k v^T, dropped):
        the torch form's chunks (torch_setup, torch_advance) run on S0 = I with v = 0."""
        return projection_shard_map(self, st, pc, name, n, H)

    def cp_apply(self, st, phi, S):
        return projection_shard_apply(phi, S)


def _solve_unit_lower(A, rhs):
    """X with (I + A) X = rhs, A [.., C, C] strictly lower (the solve takes the diagonal as 1),
    rhs [.., C, F]: solved as X^T (I + A)^T = rhs^T on transposed views, the layout LAPACK's
    trsm reads without a copy (2-2.5x faster than the left solve at C = 64, F = 128, 1 thread)."""
    torch, _ = torch_form()
    return torch.linalg.solve_triangular(A.transpose(-1, -2), rhs.transpose(-1, -2), upper=True, left=False,
                                         unitriangular=True).transpose(-1, -2)


UNIT = Rank1()

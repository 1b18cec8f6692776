"""The rank-r correction: S_t = diag(a_t) S_{t-1} + sum_{i=1..r} l_{t,i} (r_{t,i} . S_{t-1}) + B_t,
r >= 2 projection terms, each over exactly the key dims, with the decay a_t a scalar or over
the key dims: rank1.py's claim with r terms (DeltaProduct with r Householder steps per token,
written nested or expanded; derive/affine.py distributes and merges the terms, so r is the
number of distinct projections r_i).

Its parallel form is the generalized UT transform on chunks: the C tokens' r terms give C*r
unknown rows u_{t,i} = r~_{t,i} . X_{t-1}, and X_{t-1} sums over the earlier tokens' terms, so the
rows solve one [C*r, C*r] unit lower triangular system, block triangular in tokens with [r, r]
blocks (a token's r terms all read S_{t-1}: its diagonal block is 0). The Triton chunked
kernels (rank_r.j2, the kernel stages below) keep that system as r x r blocks [C, C]; the
torch backend's chunked form (below) serves mode='torch'."""
from __future__ import annotations

from ..dsl.unparse import expr_text
from .base import TransitionClass, UpdateShape, projection_shard_apply, projection_shard_map, torch_form


class RankR(TransitionClass):
    name = "rank-r correction"
    hardness = 5.5                          # between rank-1 (5) and general linear (6)
    parallel_form = "chunk"                 # the generalized UT transform (rank_r.j2)
    torch_chunked = True                    # the torch form below serves mode='torch'
    term_axes = True                        # L, R [.., r, KF]; K, V [.., m, *]: B_t = sum_m k_m v_m^T
    template = "rank_r.j2"
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

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # rank_r.j2, its macros in two variants as rank1.py's stages: vector, a scalar decay (DeltaProduct's),
    # else per key. code.extra[S] holds the state's own matrices (sanitized): L<i>, R<i> for the
    # r terms (StateIR.terms) and K<m>, V<m> for B_t's m outer products (StateIR.inputs); the
    # generic K, V are None (B_t is no single outer product). The backward keeps each term's
    # gradient list in G under dL<i>, dU<i>, dK<m>, dV<m>.
    def chunk_inputs(self, code, st, em, kd) -> dict[str, str]:
        vd = tuple(d for d in code.order if d in set(st.value_dims)) or ("_1",)
        out = {}
        for i, (left, right) in enumerate(st.ir_pieces.terms):
            out[f"L{i}"], out[f"R{i}"] = code.matrix(em, em(left), kd), code.matrix(em, em(right), kd)
        for m, (key, value) in enumerate(st.ir_pieces.inputs):
            out[f"K{m}"], out[f"V{m}"] = code.matrix(em, em(key), kd), code.matrix(em, em(value), vd)
        return out

    @staticmethod
    def _mats(code, st) -> dict[str, list[str]]:
        x, p = code.extra[st.name], st.ir_pieces
        return {"Ls": [x[f"L{i}"] for i in range(len(p.terms))], "Rs": [x[f"R{i}"] for i in range(len(p.terms))],
                "Ks": [x[f"K{m}"] for m in range(len(p.inputs))], "Vs": [x[f"V{m}"] for m in range(len(p.inputs))]}

    def chunk_size(self, st) -> int:
        # the r terms' U rows [C, VF] each, the r^2 blocks A_ij and r M blocks A_rk [C, C] (and
        # their adjoints in the backward) stay live: r times rank-1's (32) registers at C = 32,
        # so C = 16 for r = 2; a per-key decay makes every block [C, C, K]: 16 as rank-1's
        return 16

    def chunk_setup(self, code, st, parts) -> list[str]:
        n, M = st.name, self._mats(code, st)
        return [code.shifted(st, f"_b_{n}", f"_bx_{n}"), code.shifted(st, f"_z_{n}", f"_zx_{n}")] + self.render(
            code, "setup", n=n, Ks=M["Ks"], Vs=M["Vs"], Ls=M["Ls"], Rs=M["Rs"], ok=code.pair_ok(st, f"_zx_{n}"),
            vector=self.decay_is_vector(st))

    def _query(self, code, st, prev: bool) -> dict[str, str]:
        """b at the query rows, their weight from the chunk's start, the no-reset pair mask."""
        n, x = st.name, "x" if prev else ""
        return {"bq": f"_b{x}_{n}", "bq0": f"_b{x}0_{n}", "ok": code.pair_ok(st, f"_z{x}_{n}")}

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        M = self._mats(code, st)
        return self.render(code, "readout", n=st.name, R=R, Q=Q, Ks=M["Ks"], Vs=M["Vs"], Ls=M["Ls"], prev=prev,
                           vector=self.decay_is_vector(st), **self._query(code, st, prev))

    def chunk_advance(self, code, st, parts) -> list[str]:
        M = self._mats(code, st)
        return self.render(code, "advance", n=st.name, Ks=M["Ks"], Vs=M["Vs"], Ls=M["Ls"],
                           vector=self.decay_is_vector(st))

    def _grads(self, code, st, G, stem: str) -> dict:
        """Fresh names of one stage's dS0, db and per term (L_j, U_j, dL_j, dU_j), per input
        (K_m, V_m, dK_m, dV_m): the macros' lu and kv; registered in G."""
        t, n, M = code.fresh(stem), st.name, self._mats(code, st)
        G["dS0"].append(f"_dS0{t}")
        G["db"].append(f"_db{t}")
        lu = [(L, f"_U_{n}_{j}", f"_dL{t}_{j}", f"_dU{t}_{j}") for j, L in enumerate(M["Ls"])]
        kv = [(K, V, f"_dK{t}_{m}", f"_dV{t}_{m}") for m, (K, V) in enumerate(zip(M["Ks"], M["Vs"]))]
        for j, x in enumerate(lu):
            G.setdefault(f"dL{j}", []).append(x[2])
            G.setdefault(f"dU{j}", []).append(x[3])
        for m, x in enumerate(kv):
            G.setdefault(f"dK{m}", []).append(x[2])
            G.setdefault(f"dV{m}", []).append(x[3])
        return {"dS0": f"_dS0{t}", "db": f"_db{t}", "lu": lu, "kv": kv}

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        names = self._grads(code, st, G, "w")
        return self.render(code, "readout_backward", n=st.name, dR=dR, Q=Q, prev=prev, vector=self.decay_is_vector(st),
                           dQ=dQ, **self._query(code, st, prev), **names) + code.query_side(st, names["db"], prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        return self.render(code, "advance_backward", n=st.name, vector=self.decay_is_vector(st),
                           **self._grads(code, st, G, "w"))

    def chunk_setup_backward(self, code, st, parts, G) -> tuple[list[str], list]:
        K, V, g, kd, vd = parts
        n, M, p = st.name, self._mats(code, st), st.ir_pieces
        dU = [" + ".join(G[f"dU{j}"]) for j in range(len(p.terms))]      # the readouts' and the update's
        names = self._grads(code, st, G, "y")
        lu = [(L, U, dL, dU[j]) for j, (L, U, dL, _) in enumerate(names["lu"])]
        dRs = [code.fresh("dRt") for _ in p.terms]
        lines = self.render(code, "setup_backward", n=n, lu=lu, kv=names["kv"], Rs=M["Rs"],
                            ok=code.pair_ok(st, f"_zx_{n}"), vector=self.decay_is_vector(st), dRs=dRs,
                            dS0=names["dS0"], db=names["db"])
        rows, vrows = ("_T",) + kd, ("_T",) + vd      # dR, dL, dK, dV seed the spec's terms and inputs
        seeds = []
        for j, (left, right) in enumerate(p.terms):
            seeds += [(right, code.unflat(dRs[j], rows), rows),
                      (left, code.unflat(" + ".join(G[f"dL{j}"]), rows), rows)]
        for m, (key, value) in enumerate(p.inputs):
            seeds += [(key, code.unflat(" + ".join(G[f"dK{m}"]), rows), rows),
                      (value, code.unflat(" + ".join(G[f"dV{m}"]), vrows), vrows)]
        return lines, seeds

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

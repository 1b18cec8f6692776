"""A sum of outer products: S_t = diag(a_t) S_{t-1} + B_t, B_t = sum_{m=1..M} k_(t,m) v_(t,m)^T
with M >= 2 and the decay a_t a scalar or over the key dims: Mamba-3's trapezoidal update
(beta_t B_{t-1} x_{t-1}^T + gamma_t B_t x_t^T, with prev() of inputs), or any gated update whose
input term is a sum of outer products that share no one key or value.

Its chunked form is the rank-r class's (rank_r.py) with r = 0 projection terms: no triangular
system to solve, the M pieces each a key/value pair of the chunk (K_m, V_m rows [C, KF], [C, VF]):

    O   = (Q * exp(b)) S0 + sum_m [ (Q K_m^T)_ij exp(b_i - b_j), i >= j ] V_m
    S_C = exp(b_C) S0 + sum_m (K_m * exp(b_C - b))^T V_m

The Triton kernels are rank_r.py's readout, advance and their backwards over the M pairs (its
setup and the setup's backward, the UT solve, have nothing to do); the torch backend's chunked
form is the rank-r form's without the U rows."""
from __future__ import annotations

from ..dsl.unparse import expr_text
from .base import UpdateShape, torch_form
from .rank_r import RankR


class OuterSum(RankR):
    name = "sum of outer products"
    hardness = 3.5                          # a scalar or per-key decay, M pairs: between key-diag and elementwise
    # no correction terms amplify a rounded chunk-start state (the rank-r class's reason for
    # fp32 checkpoints): half checkpoints as the scalar class
    half_checkpoints = True

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and u.input_pieces >= 2 and set(u.decay_dims) <= set(u.key_dims)

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        pieces = st.ir_pieces.inputs if st.ir_pieces is not None else ()
        per_key = f" (a vector over {', '.join(st.decay_dims)})" if st.decay_dims else ""
        split = "; ".join(f"k_{i + 1} = {expr_text(k)}, v_{i + 1} = {expr_text(v)}" for i, (k, v) in enumerate(pieces))
        return [f"transition: {S}_t = a_t {S}_{{t-1}} + B_t: a = {s(st.decay)}{per_key}",
                f"B_t = sum_m k_m v_m^T, m = {len(pieces)} outer products (split at the top-level + and -): {split}",
                f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk",
                f"O   = (Q * exp(b)) {S}0 + sum_m [ (Q K_m^T)_ij exp(b_i - b_j), i >= j ] V_m",
                f"{S}_C = exp(b_C) * {S}0 + sum_m (K_m * exp(b_C - b))^T V_m",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"]

    def chunk_size(self, st) -> int:
        # M key/value pairs [C, KF], [C, VF] live with the [C, C] pair weights: mamba3 (M = 2) at
        # N = P = 64 compiled for sm_90 spills 360 B in its backward's tiles kernel at C = 32 (255
        # registers), none at C = 16 (248); the rank-r class's 16
        return 16

    # ---- kernel stages: the rank-r class's with no terms (no solve) ----
    def chunk_setup(self, code, st, parts) -> list[str]:
        """Only b_{t-1} where no reset precedes (bx0), which the readout of S_{t-1} reads."""
        n = st.name
        k = code.builder(st)
        self._setup_pairs(k)
        return [code.shifted(st, f"_b_{n}", f"_bx_{n}"), code.shifted(st, f"_z_{n}", f"_zx_{n}")] + k.lines()

    def chunk_setup_backward(self, code, st, parts, G) -> tuple[list[str], list]:
        K, V, g, kd, vd = parts
        p = st.ir_pieces
        rows, vrows = ("_T",) + kd, ("_T",) + vd      # dK, dV seed the spec's inputs
        seeds = []
        for m, (key, value) in enumerate(p.inputs):
            seeds += [(key, code.unflat(" + ".join(G[f"dK{m}"]), rows), rows),
                      (value, code.unflat(" + ".join(G[f"dV{m}"]), vrows), vrows)]
        return [], seeds

    # ---- torch form: the rank-r form's with no U rows ----
    def torch_setup(self, st, K, V, L, R, S, bb):
        return None, bb

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        """q . S_t (S_{t-1} with prev) for the chunk's rows Q [B, c, H, KF]: S0 and the k~ v terms."""
        torch, ops = torch_form()
        _, bb = ctx
        bq = bb[2] if prev else bb[0]
        w = torch.exp(ops.loop_pair_logs(bb[4], prev))                            # [B, t, s, H(, K)]
        Q1 = Q.unsqueeze(3)
        A_qk = self._pairs(st, Q1, K, w)[:, :, :, 0]
        return (torch.einsum("bthk,bhkv->bthv", (Q1 * self._on_keys(st, bq))[:, :, :, 0], S)
                + torch.einsum("bhtsm,bshmv->bthv", A_qk, V))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        """S_C = exp(b_C) S0 + sum_(s,m) k_(s,m) exp(b_C - b_s) v_(s,m)^T."""
        torch, _ = torch_form()
        _, bb = ctx
        bl, w = bb[1], self._on_keys(st, bb[3])
        b0 = bl.exp().unsqueeze(-1) if st["decay"] != "scalar" else bl.exp()[..., None, None]
        return b0 * S + torch.einsum("bshmk,bshmv->bhkv", K * w, V)

    # ---- context parallel (runtime/context_parallel.py): no projection terms, so a shard's map
    # is its decays' product, exp(the sum of g over the shard), [n, H] or [n, H, KF] ----
    def cp_transition(self, st, pc, name, n, H):
        return pc["g"][name].sum(1).exp()

    def cp_apply(self, st, phi, S):
        return phi[:, :, None, None] * S if phi.dim() == 2 else phi.unsqueeze(-1) * S


UNIT = OuterSum()

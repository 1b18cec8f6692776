"""The rank-1 correction: S_t = diag(a_t) S_{t-1} + l_t (r_t . S_{t-1}) + B_t with the
decay a_t a scalar or over the key dims (DeltaNet, gated DeltaNet, Comba, KDA, Longhorn):
the chunked WY/UT form, a [C, C] triangular solve per chunk."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class Rank1(TransitionClass):
    name = "rank-1 correction"
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

    def chunk_size(self, st) -> int:
        # a per-key decay makes the A blocks [C, C, K]; otherwise U, the [C, C] solve and its
        # adjoint stay live, and 64 spills on sm_90
        return 16 if st.decay_dims else 32

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
                "only exponents b_{j-1} - b_i (i < j), b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    def decay_is_vector(self, st) -> bool:
        return not st.decay_dims            # a scalar decay (gated DeltaNet), else per key (KDA)

    def decay_axes(self, st, kd, vd):
        return () if self.decay_is_vector(st) else kd


UNIT = Rank1()

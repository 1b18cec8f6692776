"""The value-diagonal decay: S_t = S_{t-1} diag(a_t) + B_t with a_t over the value dims
(HGRN's h[D], read as is, decays per value channel)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class ValueDiagonal(TransitionClass):
    name = "value-diagonal decay"
    hardness = 2
    parallel_form = "chunk"
    torch_chunked = True
    conv_form = True
    template = "value_diag.j2"

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

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    def decay_axes(self, st, kd, vd):
        return vd


UNIT = ValueDiagonal()

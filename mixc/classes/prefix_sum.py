"""The prefix sum: S_t = S_{t-1} + B_t (linear attention, no decay)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class PrefixSum(TransitionClass):
    name = "prefix sum"
    hardness = 0
    parallel_form = "chunk"
    torch_chunked = True
    conv_form = True
    stabilizable = True
    template = "prefix_sum.j2"

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and u.decay_is_one

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"O   = Q {S}0 + [(Q K^T) masked i >= j] V",
                f"{S}_C = {S}0 + K^T V"]


UNIT = PrefixSum()

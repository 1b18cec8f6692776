"""The scalar decay: S_t = a_t S_{t-1} + B_t with one a_t per head and token (RetNet,
Mamba-2, simple GLA, gated delta rule's decay part)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class ScalarDecay(TransitionClass):
    name = "scalar decay"
    hardness = 1
    parallel_form = "chunk"
    torch_chunked = True
    conv_form = True
    stabilizable = True
    template = "scalar.j2"

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and not u.decay_dims

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk",
                f"O   = (Q * exp(b)) {S}0 + [ (Q K^T)_ij exp(b_i - b_j), i >= j ] V",
                f"{S}_C = exp(b_C) * {S}0 + (K * exp(b_C - b))^T V",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"]


UNIT = ScalarDecay()

"""The elementwise decay: S_t = a_t * S_{t-1} + B_t with a_t over key and value dims alike
(Mamba's selective SSM: exp(dt A) per element of the state)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class Elementwise(TransitionClass):
    name = "elementwise decay"
    hardness = 4
    parallel_form = "scan"
    torch_chunked = True            # exp(b_i - b_j) per state element, on sub-chunks
    template = None                 # no chunked kernels: the recurrent ones (fla has none either)

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections

    def chunk_size(self, st) -> int:
        return 16

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        shape = "[" + ", ".join(st.shape) + "]"
        return [f"no matmul form: {S}_t = a_t * {S}_{{t-1}} + B_t is a first-order recurrence per element of "
                f"{shape} with a = {s(st.decay)}",
                "parallel form: an associative scan over pairs (a, B), (a1, B1) o (a2, B2) = (a1 a2, a2 B1 + B2), "
                f"in log space: log a = {s(st.log_decay)}"]


UNIT = Elementwise()

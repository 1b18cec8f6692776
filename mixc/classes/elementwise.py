"""The elementwise decay: S_t = a_t * S_{t-1} + B_t with a_t over key and value dims alike
(Mamba's selective SSM: exp(dt A) per element of the state)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class Elementwise(TransitionClass):
    name = "elementwise decay"
    hardness = 4
    parallel_form = "scan"
    torch_chunked = True            # exp(b_i - b_j) per state element, on sub-chunks
    token_loop_prefill = True       # mode torch prefills by the token loop (runtime/torch_step.py)

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

    # ---- torch form (runtime/torch_chunk.py) ----
    torch_batched = False           # a [C, C, K, V] factor per chunk: the chunk-at-a-time loop only

    def decay_axis(self, st) -> str | None:
        return "element"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H, K, V]
        bq = b_excl if prev else b
        w = torch.exp(ops.loop_pair_logs(g, prev))
        return (torch.einsum("bthk,bhkv,bthkv->bthv", Q, S, bq.exp())
                + torch.einsum("bthk,bjhk,bjhv,btjhkv->bthv", Q, K, V, w))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        w = torch.exp(sfx)                                                        # [B, c, H, K, V]
        return bl.exp() * S + torch.einsum("bjhk,bjhv,bjhkv->bhkv", K, V, w)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi * S                                  # phi [n, H, KF, VF]


UNIT = Elementwise()

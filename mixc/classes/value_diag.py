"""The value-diagonal decay: S_t = S_{t-1} diag(a_t) + B_t with a_t over the value dims
(HGRN's h[D], read as is, decays per value channel)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class ValueDiagonal(TransitionClass):
    name = "value-diagonal decay"
    hardness = 2
    parallel_form = "chunk"
    torch_chunked = True
    token_loop_prefill = True       # mode torch prefills by the token loop (runtime/torch_step.py)
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
    # base.py's hooks (the diagonal decays' defaults) render value_diag.j2

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "value"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H, V]
        bq = b_excl if prev else b
        A = torch.einsum("bihk,bjhk->bhij", Q, K).masked_fill(~ops.causal(Q.shape[1], prev, Q.device), 0.0)
        w = torch.exp(ops.loop_pair_logs(g, prev))
        return torch.einsum("bihk,bhkv->bihv", Q, S) * bq.exp() + torch.einsum("bhij,bijhv,bjhv->bihv", A, w, V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        w = torch.exp(sfx)
        return S * bl.exp().unsqueeze(-2) + torch.einsum("bjhk,bjhv->bhkv", K, V * w)

    # the batched form: the decay acts on the values (dec: a torch_ops.ValueDecay, or a
    # NoDecay for a log decay of constant 0, which takes the keys' path)
    def torch_chunks_update(self, dec, K, V):
        if dec.g is None:
            return super().torch_chunks_update(dec, K, V)
        return K.transpose(-1, -2) @ dec.on_values(V, 3)

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        if dec.g is None:
            return super().torch_chunks_readout(dec, Q, K, V, L, S_starts, U, prev)
        _, ops = torch_form()
        return dec.on_values(Q @ S_starts, 2 if prev else 0) + ops.value_mix(dec.product(Q, K, prev), V, dec.g, prev)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi.unsqueeze(-2) * S                    # phi [n, H, VF]


UNIT = ValueDiagonal()

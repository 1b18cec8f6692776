"""The prefix sum: S_t = S_{t-1} + B_t (linear attention, no decay)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


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

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # no decay: no log weights, no db; advance is the default (prefix_sum.j2)
    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        return self.render(code, "readout", n=st.name, R=R, Q=Q, K=K, V=V, prev=prev)

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        dK, dV, dS0 = code.grad_names(G, "t", with_db=False)
        return self.render(code, "readout_backward", n=st.name, dR=dR, Q=Q, K=K, V=V, prev=prev, dQ=dQ, dK=dK,
                           dV=dV, dS0=dS0)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        K, V = parts[:2]
        dK, dV, dS0 = code.grad_names(G, "u", with_db=False)
        return self.render(code, "advance_backward", n=st.name, K=K, V=V, dK=dK, dV=dV, dS0=dS0)

    # ---- torch form (runtime/torch_chunk.py) ----
    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        A = torch.einsum("bihk,bjhk->bhij", Q, K).masked_fill(~ops.causal(Q.shape[1], prev, Q.device), 0.0)
        return torch.einsum("bihk,bhkv->bihv", Q, S) + torch.einsum("bhij,bjhv->bihv", A, V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        return S + torch.einsum("bjhk,bjhv->bhkv", K, V)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_transition(self, st, pc, name, n, H):
        return pc["K"][name].new_ones((n, H))           # Phi = 1

    def cp_apply(self, st, phi, S):
        return phi[:, :, None, None] * S


UNIT = PrefixSum()

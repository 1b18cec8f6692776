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

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and u.decay_is_one

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"O   = Q {S}0 + [(Q K^T) masked i >= j] V",
                f"{S}_C = {S}0 + K^T V"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py), built as kernel IR ----
    # The prefix sum's chunk (linear attention): S_t = S_{t-1} + k_t v_t^T, no decay: no log
    # weights, no db. Notation (codegen/chunk_stage.py): k, the stage's builder; rows i are the
    # chunk's C tokens, j the same rows as keys; Q, K [i, K] and V [i, V] are the chunk's query,
    # key and value matrices (the state's key and value dims flattened); s = s_<S>, the state S0
    # at the chunk's start [K, V], d = d_<S> = dL/dS_C; prev: the readout reads S_{t-1}, so
    # token i sees keys j < i (else j <= i). k.dot is _mixc_dot, tl.dot at the DOT precision.
    #
    #     R   = Q S0 + [(Q K^T) masked i >= j] V
    #     S_C = S0 + K^T V

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        k = code.builder(st)
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        A = k.let("_A", k.where(k.causal(prev), k.dot(Q, k.trans(k.at_keys(K))), 0.0), "i", "j")
        k.let(R, k.dot(Q, s) + k.dot(A, k.at_keys(V)), "i", "V")
        return k.lines()

    def chunk_advance(self, code, st, parts) -> list[str]:
        k = code.builder(st)
        K, V, s = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state()
        k.let(s, s + k.dot(k.trans(K), V), "K", "V")
        return k.lines()

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        """dR = dL/dR [i, V]: assigns dQ and this term's dK, dV, dS0."""
        dK, dV, dS0 = code.grad_names(G, "t", with_db=False)
        k = code.builder(st)
        Q, K, V, s = k.block(Q, "i", "K"), k.block(K, "i", "K"), k.block(V, "i", "V"), k.state()
        dR = k.block(dR, "i", "V")
        causal = k.causal(prev)
        A = k.let("_A", k.where(causal, k.dot(Q, k.trans(k.at_keys(K))), 0.0), "i", "j")
        dA = k.let("_dA", k.where(causal, k.dot(dR, k.trans(k.at_keys(V))), 0.0), "i", "j")
        k.let(dQ, k.dot(dR, k.trans(s)) + k.dot(dA, k.at_keys(K)), "i", "K")
        k.let(dK, k.at_rows(k.dot(k.trans(dA), Q)), "i", "K")
        k.let(dV, k.at_rows(k.dot(k.trans(A), dR)), "i", "V")
        k.let(dS0, k.dot(k.trans(Q), dR), "K", "V")
        return k.lines()

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        """Given d = dL/dS_C."""
        dK, dV, dS0 = code.grad_names(G, "u", with_db=False)
        k = code.builder(st)
        K, V, d = k.block(parts[0], "i", "K"), k.block(parts[1], "i", "V"), k.state_grad()
        k.let(dS0, d, "K", "V")
        k.let(dK, k.dot(V, k.trans(d)), "i", "K")
        k.let(dV, k.dot(K, d), "i", "V")
        return k.lines()

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

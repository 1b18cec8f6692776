"""The scalar decay: S_t = a_t S_{t-1} + B_t with one a_t per head and token (RetNet,
Mamba-2, simple GLA, gated delta rule's decay part)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class ScalarDecay(TransitionClass):
    name = "scalar decay"
    stabilizer_keeps_decay = True
    hardness = 1
    parallel_form = "chunk"
    torch_chunked = True
    diagonal_segments = True
    conv_form = True
    stabilizable = True
    template = "scalar.j2"
    # the output kernel (the outputs) in the walk's tile blocks (64), as every other class. Blocks of 32
    # spilled nothing where 64 spilled 128 B (Mamba-2's [C, 64] skip-term operand, sm_90, K = V =
    # 128), but on the first GPU run (H200, Triton 3.6, 2026-12-04) every scalar-decay op at
    # K = V = 128 in that launch (retention at three shapes; simple_gla) ended in "an illegal
    # memory access", while gla and linear_attn, the output kernel in blocks of 64 at the same shape, ran;
    # the interpreter's bounds checker finds every access in bounds (tests/runtime/
    # test_kernel_bounds.py). Unproven either way until bench/gpubench/p2_fault.py runs on a GPU
    # (its "p2-tile-64" variant is this setting); a fault costs more than a spill.
    output_tile = None

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and not u.decay_dims

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk",
                f"O   = (Q * exp(b)) {S}0 + [ (Q K^T)_ij exp(b_i - b_j), i >= j ] V",
                f"{S}_C = exp(b_C) * {S}0 + (K * exp(b_C - b))^T V",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # the log weights come from ChunkCode.scalar_logs / scalar_advance_logs, which subtract
    # the stabilizer's m for the states of its group (scalar.j2)
    compensated_sum = True          # scalar.j2's pair_logs: b_i - b_j as (hi_i - hi_j) + (lo_i - lo_j)

    def chunk_readout(self, code, st, R, Q, K, V, prev) -> list[str]:
        pre, bq, bk, b0 = code.scalar_logs(st, prev)
        return pre + self.render(code, "readout", n=st.name, R=R, Q=Q, K=K, V=V, prev=prev,
                                 ok=code.pair_ok(st, code.query_z(st, prev)), bq=bq, bk=bk, b0=b0)

    def chunk_advance(self, code, st, parts) -> list[str]:
        K, V = parts[:2]
        bs, kw = code.scalar_advance_logs(st)
        return self.render(code, "advance", n=st.name, K=K, V=V, bs=bs, kw=kw)

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G) -> list[str]:
        dK, dV, dS0, db = code.grad_names(G, "t", with_db=True)
        pre, bq, bk, b0 = code.scalar_logs(st, prev)
        di = self._di(code, st, G)
        return pre + self.render(code, "readout_backward", n=st.name, dR=dR, Q=Q, K=K, V=V, prev=prev,
                                 ok=code.pair_ok(st, code.query_z(st, prev)), bq=bq, bk=bk, b0=b0, dQ=dQ, dK=dK,
                                 dV=dV, dS0=dS0, db=db, stabilized=di is not None, di=di) \
            + code.query_side(st, db, prev)

    def chunk_advance_backward(self, code, st, parts, G) -> list[str]:
        K, V = parts[:2]
        dK, dV, dS0, db = code.grad_names(G, "u", with_db=True)
        bs, kw = code.scalar_advance_logs(st)
        di = self._di(code, st, G)
        return self.render(code, "advance_backward", n=st.name, K=K, V=V, bs=bs, kw=kw, dK=dK, dV=dV, dS0=dS0,
                           db=db, stabilized=di is not None, di=di)

    @staticmethod
    def _di(code, st, G) -> str | None:
        """A stabilized state's part of the gate exponent's gradient (None: not stabilized)."""
        if not code.stabilized(st):
            return None
        G["di"].append(code.fresh("di"))
        return G["di"][-1]

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "scalar"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H]
        bq = b_excl if prev else b
        diff, b0 = ops.loop_pair_logs(g, prev), bq                                # [B, i, j, H]
        if logs is not None:        # stabilized: m off each query row, the gate on the keys
            mrow, gi, M0, _ = logs
            diff, b0 = diff - mrow.unsqueeze(2) + gi.unsqueeze(1), bq + M0.unsqueeze(1) - mrow
        A = torch.einsum("bihk,bjhk->bhij", Q, K) * torch.exp(diff.permute(0, 3, 1, 2))
        return (torch.einsum("bihk,bhkv->bihv", Q * b0.exp().unsqueeze(-1), S)
                + torch.einsum("bhij,bjhv->bihv", A, V))

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        if logs is not None:
            _, gi, M0, mnew = logs
            w = torch.exp(sfx + gi - mnew.unsqueeze(1))
            return torch.exp(bl + M0 - mnew)[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)
        w = torch.exp(sfx)                                                        # [B, c, H]
        return bl.exp()[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)

    def torch_chunks_update(self, dec, K, V):
        """base's (K exp(b_C - b))^T V, into the group's arena without autograd (the walk reads it)."""
        _, ops = torch_form()
        Kw = dec.on_keys(K, 3).transpose(-1, -2)
        return ops.mm(Kw, V, fast=dec.fast, out=dec.take(Kw.shape[:-1] + V.shape[-1:], V))

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        """The batched readout (base's), with exp(b) scaling the rows of Q S rather than Q: Q
        is a strided view of the input and Q * exp(b) a fresh copy of it, while Q S is fresh
        and contiguous, scaled in place without autograd; or, where the decay keeps Q * exp(b)
        for its product anyway (dec.readout_rows: the row and column factors), that copy."""
        _, ops = torch_form()
        Qe = dec.readout_rows(Q, prev)
        val = ops.mm(Q if Qe is None else Qe, S_starts, fast=dec.fast, out=dec.out)
        if Qe is None and dec.axis is not None:         # None: a log decay of constant 0
            e = dec.key_factor(2 if prev else 0).unsqueeze(-1)
            val = val.mul_(e) if dec.fast else val * e
        return ops.mm(dec.product(Q, K, prev), V, val, fast=dec.fast)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi[:, :, None, None] * S                # phi [n, H]


UNIT = ScalarDecay()

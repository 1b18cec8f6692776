"""The key-diagonal decay: S_t = diag(a_t) S_{t-1} + B_t with a_t over the key dims (GLA,
RWKV-6, HGRN-2, KDA's decay part)."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class KeyDiagonal(TransitionClass):
    name = "key-diagonal decay"
    hardness = 3
    parallel_form = "chunk"
    torch_chunked = True
    diagonal_segments = True
    conv_form = True
    template = "key_diag.j2"
    compensated_sum = True          # key_diag.j2's pair log weights: (hi_i - hi_j) + (lo_i - lo_j)
    # the sub-chunk loops that make A (16 diagonal steps of [C, K] exps) run once per chunk in
    # the intra kernel, not once per tile block in the output kernel, whose registers they took (sm_90, K = V = 128:
    # gla's output kernel spilled 32 B, rwkv6's 148 B with them; bench/README.md)
    stages_intra = True
    # at C = 64 a key block holds its [C, KB] keys, queries, decays (hi, lo, resets) and, in the
    # backward, dq's and dk's terms and the sub-chunk loops' exps: sm_90 (K = V = 128, bf16, 8
    # warps) spills at KB = 64 / 32 / 16: backward tiles kernel gla 1200 / 136 / 0 B (fla's whole
    # backward 420), rwkv6 1752 / 432 / 56 (fla 972); forward intra kernel rwkv6 32 / 0 / 0, the output kernel
    # walking four chunks rwkv6 224 / 24 / 0, gla 0 / 0 / 0. The cost: each key block of the
    # backward reads dO and V again in its tile loop (from L2: the HBM bytes are the same), and
    # the walk's static blocks are eight copies of the block's statements
    key_block = 16
    # the output kernel walking R chunks at C = 64 spilled 464 B (gla), 992 (rwkv6) with its state whole
    walks_key_blocks = True

    def claims(self, u: UpdateShape) -> bool:
        return not u.projections and set(u.decay_dims) <= set(u.key_dims)

    def chunk_size(self, st) -> int:
        # the intra-chunk term runs on sub-chunks of 16 (key_diag.j2), so any C is a matter of
        # registers. C = 64, as fla's: wgmma on sm_90 (C = 32 is below its 64 rows: mma.sync),
        # half C = 32's sequential steps in the walk. It fits with the key dim in blocks
        # of key_block (codegen/key_split.py, key_walk.py): sm_90 at K = V = 128 (bf16, 8 warps)
        # spills nothing forward (gla, rwkv6; whole in K: the intra kernel 456 and 856 B, the output kernel walking
        # four chunks 464 and 992), backward gla 0 B, rwkv6 524 (its walk 468; fla 420 and 972);
        # bytes per token-head gla forward 3344 (C = 32: 3216), forward + backward 9408 (11328)
        # (bench/results/static-sm90, traffic-sm90). The tuner also times 32 and 16 on the GPU.
        return 64

    def chunk_candidates(self, C: int) -> list[int]:
        return [C] + [c for c in (64, 32, 16) if c != C]

    def explain_chunk(self, st, s) -> list[str]:
        S = st.name
        return [f"b_t = cumulative sum of log a = {s(st.log_decay)} inside the chunk "
                f"(a vector over {', '.join(st.decay_dims)})",
                f"O   = (Q * exp(b)) {S}0 + [ sum_d q_id k_jd exp(b_id - b_jd), i >= j ] V",
                f"{S}_C = exp(b_C) * {S}0 + (K * exp(b_C - b))^T V",
                "only exponents b_i - b_j (i >= j) and b_C - b_j are formed: none is positive",
                "the intra-chunk term runs on sub-chunks of 16: a sub-block below the diagonal is one "
                "matmul through the b of the row before it (both factors <= 1), a diagonal sub-block "
                "elementwise in fp32"]

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # base.py's hooks (the diagonal decays' defaults) render key_diag.j2, but for the readouts:
    # a readout of S_{t-1} moves the keys' rows (the macros' `moved`) instead of the queries' b,
    # and its b gradient comes out whole (no query_side step)
    def chunk_readout(self, code, st, R, Q, K, V, prev):
        return self.render(code, "readout", n=st.name, R=R, Q=Q, K=K, V=V, prev=prev, slot=code.intra_slot())

    def chunk_readout_backward(self, code, st, dR, Q, K, V, prev, dQ, G):
        dK, dV, dS0, db = code.grad_names(G, "t", with_db=True)
        return self.render(code, "readout_backward", n=st.name, dR=dR, Q=Q, K=K, V=V, prev=prev,
                           dQ=dQ, dK=dK, dV=dV, dS0=dS0, db=db)

    # ---- torch form (runtime/torch_chunk.py) ----
    def decay_axis(self, st) -> str | None:
        return "key"

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        torch, ops = torch_form()
        b, _, b_excl, _, g = bb                                                   # g: [B, c, H, K]
        bq = b_excl if prev else b
        w = torch.exp(ops.loop_pair_logs(g, prev))                                # [B, i, j, H, K]
        A = torch.einsum("bihk,bjhk,bijhk->bhij", Q, K, w)
        return torch.einsum("bihk,bhkv->bihv", Q * bq.exp(), S) + torch.einsum("bhij,bjhv->bihv", A, V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        torch, _ = torch_form()
        _, bl, _, sfx, _ = bb
        w = torch.exp(sfx)                                                        # [B, c, H, K]
        return bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", K * w, V)

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_apply(self, st, phi, S):
        return phi.unsqueeze(-1) * S                    # phi [n, H, KF]


UNIT = KeyDiagonal()

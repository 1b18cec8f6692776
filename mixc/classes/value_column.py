"""The per-value-column rank-1 correction: S_t = S_{t-1} diag(a_t) + L_t (r_t . S_{t-1}) + B_t with
one projection over the key dims whose left L_t varies per value column (a [K, V] matrix, e.g.
beta_t[V] k_t) and a decay a_t that is a scalar or over the value dims. Column c of the state
is a delta rule of its own:

    s^c_t = a^c_t s^c_{t-1} + l^c_t (r_t . s^c_{t-1}) + k_t v^c_t

exact Longhorn (a step beta^c per column, Liu et al. 2024) and the delta rule with a
value-diagonal decay, S_t = (I - beta k k^T) S_{t-1} diag(a_t) + beta k v^T (column c's left is
-a^c beta k). rank1.py claims the left and decay over the key dims; this unit the rest with one
projection (general.py: none known).

Its parallel form is rank-1's UT transform once per value column: the chunk's u^c = r~ . X^c
solve (I - A^c) u^c = y^c with A^c[j, i] = (r_j . l^c_i) exp(b^c_{j-1} - b^c_i) for i < j: a
[C, C] unit lower triangular system per column, V of them per chunk, each with one right-hand
side. The torch backend batches them over V ([B, H, V, C, C]: torch_setup). The Triton kernels
have no chunked form for it (no_parallel_note): a [C, C] system per column is a [C, C, V]
block (rank-1's per-key decay already needs C = 16 for its [C, C, K] blocks) and V separate
substitutions per chunk, so the recurrent kernels serve it there."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape, torch_form


class ValueColumn(TransitionClass):
    name = "per-value-column rank-1"
    single_projection = True
    hardness = 5.25                         # between rank-1 (5) and rank-r (5.5)
    parallel_form = None                    # no chunked Triton kernels (the module docstring)
    torch_chunked = True                    # the torch form below serves mode='torch'
    torch_batched = False                   # the chunk-at-a-time loop (runtime/torch_chunk.py) only
    # its [C, C, V] pair weights cost C^2 V per chunk, C times the loop's K V per token over K:
    # at K = V = 64, H = 4, T = 1K-4K (1 thread, CPU time, best of 2) C = 16 beat the float32
    # token loop (forward 0.63-0.96x, forward + backward 0.18-0.61x) where 64 lost (forward 1.1-3.6x)
    torch_chunk = 16
    left_per_value = True                   # L per value column: codegen/torch_module.py

    def claims(self, u: UpdateShape) -> bool:
        if len(u.projections) != 1:
            return False
        t, key, value = u.projections[0], set(u.key_dims), set(u.value_dims)
        return (bool(value) and set(t.over) == key and set(t.proj_dims) <= key
                and (t.scale_dims is None or set(t.scale_dims) <= key | value)
                and set(u.decay_dims) <= value)

    def chunk_size(self, st) -> int:
        return 16                           # the [C, C, V] blocks (as value_diag.py's); torch: TORCH_CHUNK

    # ---- explain ----
    _WHY = ("no chunked Triton kernels: the UT transform's [C, C] system differs per value column ([C, C, V] "
            "blocks and V separate solves per chunk), so the recurrent kernels serve mode 'auto' on the GPU (and "
            "'recurrent'; 'chunk' is refused); the torch backend runs the chunked form below (mode='torch', "
            "CPU 'auto'):")

    def no_parallel_note(self, st) -> str | None:
        return (f"state {st.name} is a per-value-column rank-1 correction: no chunked Triton kernels (a [C, C] "
                "triangular system per value column); the recurrent and step kernels serve it, and mode='torch' "
                "runs its chunked form")

    def explain_chunk(self, st, s) -> list[str]:
        S, r = st.name, st.rank1[0]
        decay = f"over {', '.join(st.decay_dims)}" if st.decay_dims else "a scalar"
        return [self._WHY,
                f"transition: per value column c, s^c_t = a^c_t s^c_{{t-1}} + l^c_t (r_t . s^c_{{t-1}}) + k_t v^c_t: "
                f"a = {s(st.decay)} ({decay}), l = {s(r.left)} (a [K, V] matrix per token), r = {s(r.right)}",
                f"per column, rank-1's UT transform: b^c = cumulative sum of log a^c inside the chunk, X^c_t = "
                f"exp(-b^c_t) s^c_t, u^c_j = r~_j . X^c_{{j-1}} solve (I - A^c) u^c = "
                f"(R {S}0)^c exp(b^c_{{j-1}}) + [(R K^T) exp(b^c_{{j-1}} - b^c_i)]_(i < j) v^c,  "
                "A^c[j, i] = (r_j . l^c_i) exp(b^c_{j-1} - b^c_i), i < j",
                f"O^c = (Q {S}0)^c exp(b^c) + sum_(i <= t) exp(b^c_t - b^c_i) "
                "((q_t . l^c_i) u^c_i + (q_t . k_i) v^c_i), "
                f"{S}_C^c = exp(b^c_C) {S}0^c + sum_i exp(b^c_C - b^c_i) (l^c_i u^c_i + k_i v^c_i)",
                "the V systems are batched: [B, H, V, C, C] per chunk; where l = lk (x) lv (a key times a value "
                "factor) every product over the keys is one [C, C] matrix shared by the columns"]

    # ---- torch form (runtime/torch_chunk.py: one chunk at a time) ----
    # K, R [B, c, H, KF], V [B, c, H, VF], S [B, H, KF, VF], bb the chunk's logs
    # (torch_ops.loop_chunk_logs of g [B, c, H] or [B, c, H, VF]). L is the left's key and value
    # factors side by side, [B, c, H, KF + VF], where the left is lk (x) lv (Longhorn's eps k, the
    # decayed delta rule's -a beta k: codegen/torch_module.py), else the left itself [B, c, H, KF,
    # VF]. With the factors every product over the keys is one [C, C] matrix shared by the
    # columns (C^2 (K + V) per chunk, not C^2 K V). Inside, every column c carries W right-hand
    # sides (a trailing axis: W = 1 here, W = KF for the context-parallel map below, whose
    # columns are the identity's).
    def decay_axis(self, st) -> str | None:
        return "value" if st.decay_dims else "scalar"      # no decay: g = 0 as a scalar (rank-1's)

    @staticmethod
    def _per_value(st, bb):
        """The chunk's logs with a value axis: a scalar decay's gets one of size 1 (each column
        decays alike; broadcast, the pair sums stay [C, C] per head)."""
        return bb if st["decay"] != "scalar" else tuple(x.unsqueeze(-1) for x in bb)

    @staticmethod
    def _left(K, L):
        """(lk [.., KF], lv [.., VF]) of a factored left, else (None, L [.., KF, VF])."""
        if L.dim() == K.dim():
            return L[..., :K.shape[-1]], L[..., K.shape[-1]:]
        return None, L

    def _pairs(self, X, K, L, w):
        """[B, t, i, H, VF]: (x_t . l^c_i) w^c[t, i] for the rows X [B, t, H, KF]."""
        torch, _ = torch_form()
        lk, lv = self._left(K, L)
        if lk is None:
            return torch.einsum("bthk,bihkv->btihv", X, lv) * w
        return torch.einsum("bthk,bihk->btih", X, lk).unsqueeze(-1) * lv.unsqueeze(1) * w

    def _solve(self, st, K, V, L, R, S, bb):
        """U [B, c, H, VF, W]: each column's u^c_j = r~_j . X^c_{j-1} over the chunk, from

            (I - A^c) u^c = y^c,  A^c[j, i] = (r_j . l^c_i) exp(b^c_{j-1} - b^c_i)  (i < j)
            y^c_j = exp(b^c_{j-1}) (r_j . s^c_0) + sum_(i < j) (r_j . k_i) exp(b^c_{j-1} - b^c_i) v^c_i

        V [B, c, H, VF, W] or None (every value 0), S [B, H, KF, VF, W]: V batched [C, C] solves."""
        torch, ops = torch_form()
        c, VF = K.shape[1], S.shape[-2]
        E = torch.exp(ops.loop_pair_logs(bb[4], True))                           # [B, j, i, H, VF or 1], 0 for i >= j
        A = self._pairs(R, K, L, E)
        Y = torch.einsum("bjhk,bhkvw->bjhvw", R, S) * bb[2].exp().unsqueeze(-1)
        if V is not None:
            P = torch.einsum("bjhk,bihk->bjih", R, K).unsqueeze(-1) * E
            Y = Y + torch.einsum("bjihv,bihvw->bjhvw", P.expand(P.shape[:-1] + (VF,)), V)
        eye = torch.eye(c, dtype=K.dtype, device=K.device)
        U = torch.linalg.solve_triangular(eye - A.permute(0, 3, 4, 1, 2), Y.permute(0, 2, 3, 1, 4), upper=False,
                                          unitriangular=True)                    # [B, H, VF, C, W]
        return U.permute(0, 3, 1, 2, 4)

    def _advance(self, K, V, L, S, bb, U):
        """S_C^c = exp(b^c_C) s^c_0 + sum_i exp(b^c_C - b^c_i) (l^c_i u^c_i + k_i v^c_i), [B, H, KF, VF, W]."""
        torch, _ = torch_form()
        w = bb[3].exp().unsqueeze(-1)                                             # [B, c, H, VF or 1, 1]
        lk, lv = self._left(K, L)
        out = bb[1].exp()[:, :, None, :, None] * S
        if lk is None:
            out = out + torch.einsum("bihkv,bihvw->bhkvw", lv, U * w)
        else:
            out = out + torch.einsum("bihk,bihvw->bhkvw", lk, U * w * lv.unsqueeze(-1))
        if V is not None:
            out = out + torch.einsum("bihk,bihvw->bhkvw", K, V * w)
        return out

    def torch_setup(self, st, K, V, L, R, S, bb):
        """(U [B, c, H, VF, 1], the chunk's logs per value column)."""
        bb = self._per_value(st, bb)
        return self._solve(st, K, V.unsqueeze(-1), L, R, S.unsqueeze(-1), bb), bb

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        """O^c = (Q s^c_0) exp(b^c) + sum_(i <= t) exp(b^c_t - b^c_i) ((q_t . l^c_i) u^c_i + (q_t . k_i) v^c_i)
        (b_{t-1} and i < t with prev), [B, c, H, VF]."""
        torch, ops = torch_form()
        U, bb = ctx
        U = U[..., 0]
        bq = bb[2] if prev else bb[0]
        w = torch.exp(ops.loop_pair_logs(bb[4], prev))                           # [B, t, i, H, VF or 1]
        o = torch.einsum("bthk,bhkv->bthv", Q, S) * bq.exp()
        o = o + torch.einsum("btihv,bihv->bthv", self._pairs(Q, K, L, w), U)
        P = torch.einsum("bthk,bihk->btih", Q, K).unsqueeze(-1) * w
        return o + torch.einsum("btihv,bihv->bthv", P.expand(P.shape[:-1] + V.shape[-1:]), V)

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        U, bb = ctx
        return self._advance(K, V.unsqueeze(-1), L, S.unsqueeze(-1), bb, U)[..., 0]

    # ---- context parallel (runtime/context_parallel.py) ----
    def cp_transition(self, st, pc, name, n, H):
        """Phi [n, H, KF, VF, KF]: column c's [KF, KF] map of the shard, the product of its tokens'
        (a^c_t I + l^c_t r_t^T). The torch form's chunks run with every value 0 and each column's
        state the identity (KF right-hand sides per column): V x rank-1's work, KF x its solve's."""
        torch, ops = torch_form()
        L, R, K, g = pc["L"][name], pc["R"][name], pc["K"][name], pc["g"][name]
        T, KF, VF = K.shape[1], K.shape[-1], pc["V"][name].shape[-1]
        S = torch.eye(KF, dtype=K.dtype, device=K.device)[:, None, :].expand(n, H, KF, VF, KF)
        C = 32
        for c0 in range(0, T, C):
            c1 = min(c0 + C, T)
            bb = self._per_value(st, ops.loop_chunk_logs(g[:, c0:c1]))
            K_, L_, R_ = K[:, c0:c1], L[:, c0:c1], R[:, c0:c1]
            U = self._solve(st, K_, None, L_, R_, S, bb)
            S = self._advance(K_, None, L_, S, bb, U)
        return S

    def cp_apply(self, st, phi, S):
        torch, _ = torch_form()
        return torch.einsum("nhicj,nhjc->nhic", phi, S)


UNIT = ValueColumn()

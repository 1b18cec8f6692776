"""The torch backend's chunked form: the same algorithm as the chunked Triton kernel
(codegen/chunk.py), in plain torch with autograd, for CPU tensors without Triton's
interpreter. Lets, keys, values, log decays and queries come from the Plan's IR pieces,
evaluated over the whole sequence; the chunks then run in order with einsum."""
from __future__ import annotations

import math

import torch

from ..derive import plan as P
from ..derive.plan import Plan
from ..dsl import ir
from .reference import Evaluator, _align
from .signature import Bound, option_values


def torch_chunked(plan: Plan, bound: Bound, *, output_final_state: bool, dtype: torch.dtype, C: int = 64):
    """(o [B, T, H, *out dims] in dtype, final states {name: [N, H, *dims]} or None)."""
    m: ir.MixerIR = plan.ir
    B, T, H = bound.B, bound.T, bound.H
    device = next(iter(bound.inputs.values())).device
    env = {n: (x.to(dtype), m.input(n).shape) for n, x in bound.inputs.items()}
    env.update({n: (x.to(dtype).reshape((1, 1) + tuple(x.shape)), m.param(n).shape) for n, x in bound.params.items()})
    for name, v in option_values(m, bound).items():
        env[name] = (torch.tensor(v, dtype=dtype, device=device).reshape(1, 1, 1), ())
    ev = Evaluator(m, bound, env, lead=3, dtype=dtype)
    for let in m.lets:
        env[let.name] = ev(let.expr)
    size = bound.sizes

    def full(v, axes):
        """[B, T, H, prod(axes)] (a unit axis when axes is empty)."""
        t = _align(v, axes, 3)
        t = t.expand((B, T, H) + tuple(size[d] for d in axes))
        return t.reshape(B, T, H, math.prod(size[d] for d in axes)) if axes else t.unsqueeze(-1)

    pieces = {}
    for st in plan.states:
        kd = tuple(d for d in m.dim_names if d in st.key_dims)
        vd = tuple(d for d in m.dim_names if d in st.value_dims)
        p = st.ir_pieces
        K = full(ev(p.key), kd)
        V = full(ev(p.value), vd) if p.value is not None else torch.ones(B, T, H, 1, dtype=dtype, device=device)
        g = None
        if st.transition == P.SCALAR:
            g = _align(ev(p.log_decay), (), 3).expand(B, T, H)
        elif st.transition == P.KEY_DIAG:
            g = full(ev(p.log_decay), kd)
        elif st.transition == P.VALUE_DIAG:
            g = full(ev(p.log_decay), vd)
        pieces[st.name] = (K, V, g, kd, vd)
    queries = {}
    for r in plan.output.readouts:
        K, V, g, kd, vd = pieces[r.state]
        terms = []
        for t in r.terms_ir:
            q = full(ev(t.proj), kd) if t.proj is not None else torch.ones(B, T, H, 1, dtype=dtype, device=device)
            sc = full(ev(t.scale), vd) if t.scale is not None else None
            terms.append((q, sc))
        queries[r.name] = terms

    segments = [(0, T)] if bound.cu_seqlens is None else list(zip(bound.cu_seqlens.tolist()[:-1],
                                                                     bound.cu_seqlens.tolist()[1:]))
    readout_vals = {r.name: [] for r in plan.output.readouts}
    finals = {s.name: [] for s in m.states}
    for i_seq, (start, end) in enumerate(segments):
        rows = slice(None) if bound.cu_seqlens is None else slice(0, 1)
        states = {}
        for st in plan.states:
            K, V, g, kd, vd = pieces[st.name]
            kf, vf = K.shape[-1], V.shape[-1]
            if bound.initial_state is not None:
                s0 = bound.initial_state[st.name].to(dtype)
                s0 = s0 if bound.cu_seqlens is None else s0[i_seq:i_seq + 1]
                decl = m.state(st.name).shape
                s0 = s0.permute(0, 1, *[2 + decl.index(d) for d in kd + vd]).reshape(s0.shape[0], H, kf, vf)
            else:
                s0 = torch.zeros((B if bound.cu_seqlens is None else 1), H, kf, vf, dtype=dtype, device=device)
            states[st.name] = s0
        outs = {r.name: [] for r in plan.output.readouts}
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)
            chunk_b = {}
            for st in plan.states:
                K, V, g, kd, vd = pieces[st.name]
                if g is not None:
                    gc = g[rows, c0:c1]
                    b = gc.cumsum(1)
                    chunk_b[st.name] = (b, b[:, -1], torch.cat([torch.zeros_like(b[:, :1]), b[:, :-1]], 1))
            for r in plan.output.readouts:
                st = plan.state(r.state)
                K, V, g, kd, vd = pieces[st.name]
                Kc, Vc, S = K[rows, c0:c1], V[rows, c0:c1], states[st.name]
                total = 0
                for q, sc in queries[r.name]:
                    val = _readout(st, q[rows, c0:c1], Kc, Vc, S, chunk_b.get(st.name), r.prev)
                    total = total + (val * sc[rows, c0:c1] if sc is not None else val)
                outs[r.name].append(total)
            for st in plan.states:
                K, V, g, kd, vd = pieces[st.name]
                states[st.name] = _advance(st, K[rows, c0:c1], V[rows, c0:c1], states[st.name], chunk_b.get(st.name))
        for r in plan.output.readouts:
            val = (torch.cat(outs[r.name], 1) if outs[r.name] else
                   torch.zeros((B if bound.cu_seqlens is None else 1), 0, H, pieces[r.state][1].shape[-1],
                               dtype=dtype, device=device))
            readout_vals[r.name].append(val)
        for st in plan.states:
            K, V, g, kd, vd = pieces[st.name]
            S = states[st.name]
            S = S.reshape(S.shape[:2] + tuple(size[d] for d in kd + vd))
            decl = m.state(st.name).shape
            finals[st.name].append(S.permute(0, 1, *[2 + (kd + vd).index(d) for d in decl]))

    out_env = dict(env)
    for r in plan.output.readouts:
        val = torch.cat(readout_vals[r.name], 1)
        vd = pieces[r.state][4]
        val = val.reshape(val.shape[:3] + tuple(size[d] for d in vd)) if vd else val[..., 0]
        out_env[r.name] = (val, vd)
    o = Evaluator(m, bound, out_env, lead=3, dtype=dtype)(plan.output.combine_ir)
    o = _align(o, m.output.expr.shape, 3).expand((B, T, H) + tuple(size[d] for d in m.output.expr.shape))
    final = {k: torch.cat(v, 0) for k, v in finals.items()} if output_final_state else None
    return o, final


def _readout(st: P.StatePlan, Q, K, V, S, bb, prev: bool):
    """[B, c, H, VF]: the readouts of one chunk's tokens (S: the state at the chunk start)."""
    c = Q.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool, device=Q.device).tril(-1 if prev else 0)
    if st.transition == P.PREFIX_SUM:
        A = torch.einsum("bihk,bjhk->bhij", Q, K) * causal
        return torch.einsum("bihk,bhkv->bihv", Q, S) + torch.einsum("bhij,bjhv->bihv", A, V)
    b, _, b_excl = bb
    bq = b_excl if prev else b
    if st.transition == P.SCALAR:                       # b: [B, c, H]
        diff = (bq.unsqueeze(2) - b.unsqueeze(1)).permute(0, 3, 1, 2)          # [B, H, i, j]
        A = torch.einsum("bihk,bjhk->bhij", Q, K) * torch.exp(diff.masked_fill(~causal, float("-inf")))
        return (torch.einsum("bihk,bhkv->bihv", Q * bq.exp().unsqueeze(-1), S)
                + torch.einsum("bhij,bjhv->bihv", A, V))
    if st.transition == P.KEY_DIAG:                     # b: [B, c, H, K]
        diff = bq.unsqueeze(2) - b.unsqueeze(1)                                   # [B, i, j, H, K]
        w = torch.exp(diff.masked_fill(~causal[None, :, :, None, None], float("-inf")))
        A = torch.einsum("bihk,bjhk,bijhk->bhij", Q, K, w)
        return torch.einsum("bihk,bhkv->bihv", Q * bq.exp(), S) + torch.einsum("bhij,bjhv->bihv", A, V)
    # value-diagonal: b [B, c, H, V]
    A = torch.einsum("bihk,bjhk->bhij", Q, K) * causal
    diff = bq.unsqueeze(2) - b.unsqueeze(1)                                       # [B, i, j, H, V]
    w = torch.exp(diff.masked_fill(~causal[None, :, :, None, None], float("-inf")))
    return torch.einsum("bihk,bhkv->bihv", Q, S) * bq.exp() + torch.einsum("bhij,bijhv,bjhv->bihv", A, w, V)


def _advance(st: P.StatePlan, K, V, S, bb):
    if st.transition == P.PREFIX_SUM:
        return S + torch.einsum("bjhk,bjhv->bhkv", K, V)
    b, bl, _ = bb
    if st.transition == P.SCALAR:
        w = torch.exp(bl.unsqueeze(1) - b)                                        # [B, c, H]
        return bl.exp()[:, :, None, None] * S + torch.einsum("bjhk,bjh,bjhv->bhkv", K, w, V)
    if st.transition == P.KEY_DIAG:
        w = torch.exp(bl.unsqueeze(1) - b)                                        # [B, c, H, K]
        return bl.exp().unsqueeze(-1) * S + torch.einsum("bjhk,bjhv->bhkv", K * w, V)
    w = torch.exp(bl.unsqueeze(1) - b)                                            # [B, c, H, V]
    return S * bl.exp().unsqueeze(-2) + torch.einsum("bjhk,bjhv->bhkv", K, V * w)

"""The torch backend's chunked form of a block-affine system (mode "torch" for Titans' memory
with momentum): the generated module's pieces (codegen/torch_module.py: each system's log
gates, its projection's right and lefts, its input terms; each readout's queries), chunk by
chunk through the class unit's torch form (classes/block_affine.py torch_system_chunk), the
output from the generated torch_combine. Autograd gives the backward. Sequences of cu_seqlens
run one after another (each from its own initial state); a last chunk shorter than C is a
chunk of its own length. Derive decides where it serves (derive/system_chunk.py,
layout.system_chunk_supported: one system holding every state)."""
from __future__ import annotations

import math

import torch

from .. import classes


def torch_system_forward(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                         output_final_state=False, C=64):
    """(o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None): torch_forward for a
    spec whose states are one block-affine system."""
    ((key, sy),) = mod.TORCH_SYSTEMS.items()
    unit = classes.unit(classes.SYSTEM_CLASS)
    names, kd, vd = sy["states"], sy["kd"], sy["vd"]
    read = names.index(sy["read"]) if sy["read"] is not None else None
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    pieces = pc["Sys"][key]
    kf, vf = (math.prod(sizes[d] for d in dims) for dims in (kd, vd))
    segments = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    rows = slice(None) if cu_seqlens is None else slice(0, 1)
    Bs = B if cu_seqlens is None else 1
    decl = {n: mod.TORCH_STATES[n]["decl"] for n in names}
    flat = kd + vd
    queries = [(r, names.index(rd["state"]), rd["prev"]) for r, rd in mod.TORCH_READOUTS.items()]
    readout_vals = {r: [] for r in mod.TORCH_READOUTS}
    finals = {n: [] for n in names}
    for i_seq, (start, end) in enumerate(segments):
        X = []
        for n in names:
            if initial_state is not None:
                s0 = initial_state[n].to(dtype)
                s0 = s0 if cu_seqlens is None else s0[i_seq:i_seq + 1]
                s0 = s0.permute(0, 1, *[2 + decl[n].index(d) for d in flat]).reshape(s0.shape[0], H, kf, vf)
            else:
                s0 = torch.zeros(Bs, H, kf, vf, dtype=dtype, device=device)
            X.append(s0)
        X = tuple(X)
        outs = {r: [] for r in mod.TORCH_READOUTS}
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)

            def cut(t):
                return None if t is None else t[rows, c0:c1]
            key_side = {"w": cut(pieces["w"]), "c": cut(pieces["c"])}
            key_side.update({f"u{i}": cut(t) for i, t in enumerate(pieces["u"])})
            for m, (_, k, v) in enumerate(pieces["inputs"]):
                key_side.update({f"kin{m}": cut(k), f"vin{m}": cut(v)})
            logs = {g: cut(pieces[g]) for g in ("log_a", "log_d")}
            key_side, logs, bad = _finite_rows(key_side, logs)
            inputs = [(i, key_side[f"kin{m}"], key_side[f"vin{m}"]) for m, (i, _, _) in enumerate(pieces["inputs"])]
            terms = [(r, i, prev, Q, sc) for r, i, prev in queries for Q, sc in pc["Q"][r]]
            vals, X = unit.torch_system_chunk((logs["log_a"], key_side["c"], logs["log_d"]), key_side["w"],
                                              [key_side["u0"], key_side["u1"]], inputs,
                                              X, read, [(i, prev, cut(Q)) for _, i, prev, Q, _ in terms])
            total = {}
            for (r, _, _, _, sc), val in zip(terms, vals):
                val = val * cut(sc) if sc is not None else val
                total[r] = total[r] + val if r in total else val
            for r, (_, _, prev) in zip(outs, queries):
                seen = bad.cumsum(1) - (bad.to(torch.long) if prev else 0)       # bad tokens up to the row
                outs[r].append(total[r].masked_fill((seen > 0).unsqueeze(-1), float("nan")))
            X = tuple(S.masked_fill(bad.any(1)[:, :, None, None], float("nan")) for S in X)
        for r in readout_vals:
            readout_vals[r].append(torch.cat(outs[r], 1) if outs[r] else
                                   torch.zeros(Bs, 0, H, vf, dtype=dtype, device=device))
        for n, S in zip(names, X):
            S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in flat))
            finals[n].append(S.permute(0, 1, *[2 + flat.index(d) for d in decl[n]]))
    r = {}
    for name in mod.TORCH_READOUTS:
        val = torch.cat(readout_vals[name], 1)
        r[name] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, None)
    final = {k: torch.cat(v, 0) for k, v in finals.items()} if output_final_state else None
    return o, final


def _finite_rows(key_side: dict, logs: dict):
    """Causality under non-finite input, as the other classes' chunk loop (runtime/torch_chunk.py):
    a token whose key-side pieces (w, the lefts, the input terms, c) hold inf or NaN, or whose
    log gate is NaN or +inf (-inf is a gate of 0: a reset), has them zeroed before the chunk's
    matmuls (a masked 0 times a NaN would reach the earlier rows); the caller makes the readouts
    from that token on, and the states at the chunk's end, NaN. Returns (key_side, logs, bad
    [B, n, H])."""
    bad = None
    for t in key_side.values():
        if t is not None:
            b = ~torch.isfinite(t)
            b = b.flatten(3).any(-1) if b.dim() > 3 else b
            bad = b if bad is None else bad | b
    for g in logs.values():
        b = ~(g < math.inf)
        bad = b if bad is None else bad | b
    logs = {k: g.masked_fill(bad, 0.0) for k, g in logs.items()}
    key_side = {k: None if t is None else t.masked_fill(bad.reshape(bad.shape + (1,) * (t.dim() - 3)), 0.0)
                for k, t in key_side.items()}
    return key_side, logs, bad

"""The torch backend's chunked form, for CPU tensors without Triton's interpreter: the same
algorithm as the chunked Triton kernel (codegen/chunk.py) in plain torch, autograd giving the
backward. The spec's expressions come from the generated module (codegen/torch_module.py,
templates/torch_chunk.py.j2: torch_pieces, torch_combine and the tables of states and
readouts); the chunk loop below is the same for every spec, and each class's chunk (its
readouts, its update, the rank-1 solve) is its unit's torch form (mixc/classes/<class>.py,
looked up by TORCH_STATES' "class")."""
from __future__ import annotations

import math

import torch

from .. import classes
from ..classes.torch_ops import loop_chunk_logs, loop_pair_logs
from ..derive.plan import Plan
from ..derive.stabilize import M_EMPTY
from .cache import load_module
from .signature import Bound, option_values
from .torch_chunks import batched_supported, torch_forward_batched


# the torch backend's default chunk: 64 for every class (the kernels' C, 16 for a per-key decay,
# is a GPU register budget; here the key class works on sub-chunks inside the chunk, and a
# longer chunk means fewer steps of the sequential walk)
TORCH_CHUNK = 64


def torch_chunked(plan: Plan, bound: Bound, *, output_final_state: bool, dtype: torch.dtype, C: int | None = None):
    """(o [B, T, H, *out dims] in dtype, final states {name: [N, H, *dims]} or None)."""
    C = C or min(classes.unit(s.transition).torch_chunk or TORCH_CHUNK for s in plan.states)    # a class's own
    mod = load_module(plan)
    x = {n: t.to(dtype) for n, t in bound.inputs.items()}
    p = {n: t.to(dtype) for n, t in bound.params.items()}
    opt = option_values(plan.ir, bound)
    init = dict(bound.initial_state) if bound.initial_state is not None else None
    return torch_forward(mod, x, p, opt, dict(bound.sizes), bound.B, bound.T, bound.H, initial_state=init,
                         cu_seqlens=bound.cu_seqlens, output_final_state=output_final_state, C=C)


def _nonfinite_rows(*xs):
    """[B, c, H]: the tokens whose key-side values (key, value, the rank-1 vectors) hold an inf
    or a NaN. They are zeroed before any matmul (0 * inf would be NaN in every row the matmul
    mixes them into, earlier tokens included) and their rows on are set to NaN instead."""
    bad = None
    for x in xs:
        if x is not None:
            nf = ~torch.isfinite(x).flatten(3).all(-1)
            bad = nf if bad is None else bad | nf
    return bad


def torch_forward(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None, output_final_state=False,
                  C=64):
    """(o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None) of the generated
    module `mod`: inputs x [B, T, H, *dims] and params p [H, *dims] in the compute dtype,
    options opt (numbers). All chunks at once (torch_chunks.py) where the spec allows, else
    the loop over chunks below (the stabilized and elementwise classes)."""
    if batched_supported(mod):
        return torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens, output_final_state=output_final_state, C=C)
    return torch_forward_loop(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              output_final_state=output_final_state, C=C)


def torch_forward_loop(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                       output_final_state=False, C=64):
    """torch_forward, one chunk at a time (for every class)."""
    TORCH_STATES, TORCH_READOUTS, TORCH_STABILIZED = mod.TORCH_STATES, mod.TORCH_READOUTS, mod.TORCH_STABILIZED
    units = {name: classes.unit(st["class"]) for name, st in TORCH_STATES.items()}     # each class's chunk
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    segments = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    rows = slice(None) if cu_seqlens is None else slice(0, 1)
    Bs = B if cu_seqlens is None else 1
    # Every per-token piece is split once into the chunks of every sequence (cu_seqlens runs
    # from 0 to T): slicing each chunk out on its own costs, in the backward, a zero-filled
    # full-length gradient per chunk (O(T^2 / C): the superlinear growth `mixc bench` showed
    # past T = 4096); the backward of one split concatenates once.
    lengths = [min(C, end - c0) for start, end in segments for c0 in range(start, end, C)]

    def split(t):
        return None if t is None else t[rows].split(lengths, 1)
    ch = {k: {n: split(t) for n, t in pc[k].items()} for k in ("K", "V", "g", "L", "R")}
    ch_q = {r: [(split(Q), split(sc)) for Q, sc in terms] for r, terms in pc["Q"].items()}
    ch_gate = split(pc["gate"])
    ci = -1                                   # the running chunk index over all sequences
    readout_vals = {r: [] for r in TORCH_READOUTS}
    finals = {s: [] for s in TORCH_STATES}
    m_rows, mp_rows = [], []
    for i_seq, (start, end) in enumerate(segments):
        states = {}
        for name, st in TORCH_STATES.items():
            kf, vf = pc["K"][name].shape[-1], pc["V"][name].shape[-1]
            if initial_state is not None:
                s0 = initial_state[name].to(dtype)
                s0 = s0 if cu_seqlens is None else s0[i_seq:i_seq + 1]
                s0 = s0.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]]).reshape(
                    s0.shape[0], H, kf, vf)
            else:
                s0 = torch.zeros(Bs, H, kf, vf, dtype=dtype, device=device)
            states[name] = s0
        # the stabilizer's m: 0 with a given state (S~ = S), an empty state's without one
        M = torch.full((Bs, H), 0.0 if initial_state is not None else M_EMPTY, dtype=dtype, device=device)
        outs = {r: [] for r in TORCH_READOUTS}
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)
            ci += 1
            K_, V_, L_, R_, g_ = ({n: v[ci] for n, v in ch[k].items() if v is not None}
                                  for k in ("K", "V", "L", "R", "g"))
            # causality under non-finite input: the key-side rows of a token holding inf or NaN
            # are zeroed before the matmuls, and the readouts from that token on are NaN
            gi = ch_gate[ci] if TORCH_STABILIZED else None
            gate_bad = ~torch.isfinite(gi) if gi is not None else None
            bad = {}
            for name in TORCH_STATES:
                bad[name] = _nonfinite_rows(K_[name], V_[name], L_.get(name), R_.get(name))
                if name in g_:
                    # a NaN or +inf log decay (-inf is a reset): its token is bad too and its
                    # log 0 in the chunk's sums, where its NaN reached the earlier rows (issue 30)
                    g_bad = ~(g_[name] < math.inf)
                    bad[name] = bad[name] | (g_bad.flatten(3).any(-1) if g_bad.dim() > 3 else g_bad)
                    g_[name] = g_[name].masked_fill(g_bad, 0.0)
                if name in TORCH_STABILIZED:
                    bad[name] = bad[name] | gate_bad
                for part in (K_, V_, L_, R_):
                    if name in part:
                        # [B, c, H, 1(, 1)]: the rank-r pieces have a term axis
                        mask = bad[name].reshape(bad[name].shape + (1,) * (part[name].dim() - 3))
                        part[name] = part[name].masked_fill(mask, 0.0)
            if gi is not None:
                gi = gi.masked_fill(gate_bad, 0.0)
            chunk_b = {}
            for name in TORCH_STATES:
                if name in g_:
                    chunk_b[name] = loop_chunk_logs(g_[name])
            logs = None
            if TORCH_STABILIZED:
                b, bl, _, sfx, g = chunk_b[TORCH_STABILIZED[0]]
                L = loop_pair_logs(g, False) + gi.unsqueeze(1)                       # [B, i, j, H]
                # m is a scale the gradients hold constant
                mrow = torch.maximum(L.amax(2), b + M.unsqueeze(1)).detach()
                mnew = torch.maximum(bl + M, (sfx + gi).amax(1)).detach()
                # a readout of S~_{t-1} is relative to m_{t-1}, its own scale (derive/stabilize.py)
                mprev = torch.cat([M.unsqueeze(1), mrow[:, :-1]], 1)
                logs = (mrow, gi, M, mnew)
                logs_prev = (mprev, gi, M, mnew)
                m_rows.append(mrow)
                mp_rows.append(mprev)
            # what each state's readouts and update share (rank-1: the WY/UT solve)
            ctx = {name: units[name].torch_setup(st, K_[name], V_[name], L_.get(name), R_.get(name), states[name],
                                                 chunk_b.get(name)) for name, st in TORCH_STATES.items()}
            for r, rd in TORCH_READOUTS.items():
                s = rd["state"]
                total = 0
                for Q, sc in ch_q[r]:
                    lg = (logs_prev if rd["prev"] else logs) if s in TORCH_STABILIZED else None
                    val = units[s].torch_readout(TORCH_STATES[s], Q[ci], K_[s], V_[s], L_.get(s), states[s],
                                                 chunk_b.get(s), rd["prev"], lg, ctx[s])
                    total = total + (val * sc[ci] if sc is not None else val)
                seen = bad[s].cumsum(1) - (bad[s].to(torch.long) if rd["prev"] else 0)      # bad tokens up to the row
                outs[r].append(total.masked_fill((seen > 0).unsqueeze(-1), float("nan")))
            for name, st in TORCH_STATES.items():
                states[name] = units[name].torch_advance(st, K_[name], V_[name], L_.get(name), states[name],
                                                         chunk_b.get(name), logs if name in TORCH_STABILIZED else None,
                                                         ctx[name])
            for name in TORCH_STATES:
                states[name] = states[name].masked_fill(bad[name].any(1)[:, :, None, None], float("nan"))
            if logs is not None:
                M = logs[3]
        for r, rd in TORCH_READOUTS.items():
            vf = pc["V"][rd["state"]].shape[-1]
            readout_vals[r].append(torch.cat(outs[r], 1) if outs[r] else
                                   torch.zeros(Bs, 0, H, vf, dtype=dtype, device=device))
        for name, st in TORCH_STATES.items():
            S = states[name]
            if name in TORCH_STABILIZED:        # the spec's state: S~ exp(m)
                S = S * torch.exp(M)[:, :, None, None]
            S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
            finals[name].append(S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]]))
    r = {}
    for name, rd in TORCH_READOUTS.items():
        val = torch.cat(readout_vals[name], 1)
        vd = TORCH_STATES[rd["state"]]["vd"]
        r[name] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    m = tuple(torch.cat(x, 1) if x else torch.zeros(B, 0, H, dtype=dtype, device=device)
              for x in (m_rows, mp_rows)) if TORCH_STABILIZED else None
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, m)
    final = {k: torch.cat(v, 0) for k, v in finals.items()} if output_final_state else None
    return o, final

"""The torch backend's chunked form, for CPU tensors without Triton's interpreter: the same
algorithm as the chunked Triton kernel (codegen/chunk.py) in plain torch, autograd giving the
backward. The spec's expressions come from the generated module (codegen/torch_module.py,
templates/torch_chunk.py.j2: torch_pieces, torch_combine and the tables of states and
readouts); the chunk loops below are the same for every spec, and each class's chunk (its
readouts, its update, the rank-1 solve) is its unit's torch form (mixc/classes/<class>.py,
looked up by TORCH_STATES' "class"; the shared products in classes/torch_ops.py). Two loops:

- all chunks at once, in groups (torch_forward_batched, every class but the stabilized and
  elementwise ones: `batched_supported`): every intra-chunk product is one batched matmul over
  [B*H, n chunks, C, dim] (views of the inputs, one layout change out), and only the walk of
  the state from chunk to chunk is a python loop, of one to three fused ops per chunk
  (addcmul, baddbmm). Each group goes from the inputs to its readouts before the next (the
  state carried between), so its tensors stay small; without an autograd graph (`fast`) the
  group's fresh intermediates are updated in place, the matmuls run per head on the views (no
  layout copies) and the walk writes into one buffer. Sequences of cu_seqlens are gathered
  into chunks padded with zeros (a key and value of 0 and a log decay of 0 leave the state as
  it is), so one walk serves them all, resetting at each sequence's first chunk. The
  per-chunk loop did ~166 small ops per chunk on the [B, c, H, dim] layout (einsums that
  copy), 2-3x fla's naive chunked reference.
- one chunk at a time (torch_forward_loop, every class).

Both have the same numerics: decay factors from per-pair sums of the log decay (a decay of 0
resets; dg exact for neighbours at strong decay), key-side rows holding inf/NaN zeroed before
the matmuls and the readouts from them on NaN. (torch_chunks.py, the batched loop, was a
module of its own beside this one until issue 31: one place now.)"""
from __future__ import annotations

import math

import torch

from .. import classes
from ..classes.torch_ops import GROUP_ELEMENTS, arena, groups, loop_chunk_logs, loop_pair_logs, release_arena
from ..derive.plan import Plan
from ..derive.stabilize import M_EMPTY
from .cache import load_module
from .signature import Bound, option_values
from .torch_system import torch_system_forward


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


def torch_forward(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None, output_final_state=False,
                  C=64):
    """(o [B, T, H, *out dims], final states {name: [N, H, *dims]} or None) of the generated
    module `mod`: inputs x [B, T, H, *dims] and params p [H, *dims] in the compute dtype,
    options opt (numbers). All chunks at once (torch_forward_batched) where the spec allows,
    else the loop over chunks (the stabilized and elementwise classes); a block-affine
    system's own chunks (runtime/torch_system.py)."""
    if getattr(mod, "TORCH_SYSTEMS", None):
        return torch_system_forward(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, output_final_state=output_final_state, C=C)
    if batched_supported(mod):
        return torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens, output_final_state=output_final_state, C=C)
    return torch_forward_loop(mod, x, p, opt, sizes, B, T, H, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              output_final_state=output_final_state, C=C)


# ---- all chunks at once, in groups of chunks ----

# the forward runs in groups of chunks of about GROUP_ELEMENTS elements (classes/torch_ops.py:
# 1 MB in float32, below glibc's mmap threshold); under autograd the groups are larger (fewer
# graph nodes; linear_attn's forward + backward at T = 16K: 0.96x fla's at 2^20, 1.2x at 2^18)
GRAD_GROUP_ELEMENTS = 1 << 20


def batched_supported(mod) -> bool:
    return not mod.TORCH_STABILIZED and all(classes.unit(st["class"]).torch_batched
                                            for st in mod.TORCH_STATES.values())


class Layout:
    """Tokens [B, T, H, *] <-> chunks [B' * H, N, C, *] (B' = 1 with cu_seqlens)."""

    fast = False            # no autograd graph is recorded (torch_forward_batched sets it)
    # fast on the CPU: the classes.torch_ops.Arena the group's intermediates are taken from
    # (reset at each group; nothing taken outlives its group)
    arena = None
    # {state: its key-side inputs hold no inf or NaN} (checked once a call; absent: unknown)
    finite: dict = {}

    def __init__(self, B, T, H, C, cu_seqlens, device):
        self.B, self.T, self.H, self.C = B, T, H, C
        if cu_seqlens is None:
            self.N = -(-T // C)
            self.Bp, self.idx = B, None
            self.first, self.seq = [n == 0 for n in range(self.N)], [0] * self.N
            self.last = {0: self.N - 1} if self.N else {}
            return
        self.Bp = 1
        cu = cu_seqlens.tolist()
        starts, first, seq, last = [], [], [], {}
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            for c0 in range(s, e, C):
                first.append(c0 == s)
                seq.append(i)
                starts.append(c0)
            if e > s:
                last[i] = len(starts) - 1
        self.N, self.first, self.seq, self.last = len(starts), first, seq, last
        ends = torch.tensor([cu[i + 1] for i in seq], dtype=torch.long, device=device)
        pos = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(C, device=device)
        self.valid = (pos < ends[:, None]).reshape(-1)                      # [N * C]
        self.idx = torch.where(self.valid, pos.reshape(-1), 0)
        # token t's place in the padded chunks
        self.back = torch.nonzero(self.valid).reshape(-1)

    def chunks(self, x, s=None):
        """[B, T, H, *f] -> [B' H, n, C, *f] for the chunks s (all without; contiguous,
        zero-padded): one copy of a group's tokens, not of the whole sequence."""
        if x is None:
            return None
        B, H, C = self.B, self.H, self.C
        n0, n1 = (0, self.N) if s is None else (s.start, s.stop)
        n, f = n1 - n0, x.shape[3:]
        if self.idx is None:
            x = x[:, n0 * C:n1 * C]
            if x.shape[1] != n * C:
                x = torch.cat([x, x.new_zeros((B, n * C - x.shape[1]) + x.shape[2:])], 1)
            x = x.reshape((B, n, C, H) + f)
        else:
            valid = self.valid[n0 * C:n1 * C]
            x = x[0].index_select(0, self.idx[n0 * C:n1 * C])
            x = torch.where(valid.view((-1,) + (1,) * (x.dim() - 1)), x, torch.zeros((), dtype=x.dtype,
                                                                                    device=x.device))
            x = x.reshape((1, n, C, H) + f)
        x = x.permute((0, 3, 1, 2) + tuple(range(4, 4 + len(f)))).reshape((self.Bp * H, n, C) + f)
        # under autograd one copy into the chunk layout: matmul copies a view whose [BH, n] has
        # no single stride, once per product that reads it (K, V and Q twice each), and saves
        # the copy for the backward
        return x if self.fast else x.contiguous()

    def tokens(self, parts, f):
        """The chunk groups [B' H, n, C, *f] in order -> [B, T, H, *f]: the layout change and the
        concatenation are one copy."""
        ys = [y.reshape((self.Bp, self.H, -1) + tuple(f)).transpose(1, 2) for y in parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        return y[:, :self.T] if self.idx is None else y.index_select(1, self.back)


def all_finite(*xs) -> bool:
    """Whether the tensors hold no inf or NaN, by one sum each (a finite total means none
    does; an overflowing one answers False, and the row test below decides). False under
    torch.compile, where a host read is a graph break."""
    if torch.compiler.is_compiling():
        return False
    total = None
    for x in xs:
        if x is not None:
            s = x.detach().sum()
            total = s if total is None else total.add_(s)
    return total is None or math.isfinite(total.item())


def nonfinite_rows(*xs):
    """[BH, N, C]: the tokens whose key-side values hold an inf or a NaN (None: none do). One
    sum per tensor first (isfinite over every element costs four passes): a finite sum means
    no inf or NaN; only an overflowing or non-finite one takes the per-row test."""
    xs = [x for x in xs if x is not None]
    # under torch.compile a host read is a graph break (fullgraph fails): always the row test
    tracing = torch.compiler.is_compiling()
    if not tracing and bool(torch.isfinite(torch.stack([x.detach().sum() for x in xs])).all()):
        return None
    bad = None
    for x in xs:
        if x is not None:
            nf = ~torch.isfinite(x).all(-1)
            bad = nf if bad is None else bad | nf
    return bad if bad is not None and (tracing or bool(bad.any())) else None


def _walk(lay, s, KV, a, S, init, finals, rank1=None):
    """The walk over the chunks s: the state at each one's start [BH, n, KF, VF] (and, rank-1,
    the U [BH, n, C, VF]) and the state after the last, from S after the chunks before (None
    at the first); each sequence's final state goes to finals {seq: [BH, KF, VF]}. Per chunk
    S <- a S + KV (rank-1: U = W0 + Wm S, S <- a S + KV + Lw^T U), resetting to init(seq) at a
    sequence's first chunk."""
    n0, n1 = s.start, s.stop
    if a is None and rank1 is None and lay.idx is None:            # a prefix sum: one cumsum
        S0 = init(0) if n0 == 0 else S
        if lay.arena is not None:       # the states [BH, n + 1, ..] in one arena buffer, no cat
            buf = lay.arena.take(KV.shape[:1] + (n1 - n0 + 1,) + KV.shape[2:], KV)
            buf[:, 0].copy_(S0)
            torch.cumsum(KV, 1, out=buf[:, 1:]).add_(S0.unsqueeze(1))
            S = buf[:, -1].clone()          # carried past the group: out of the arena
            if lay.last.get(0) == n1 - 1:
                finals[0] = S
            return buf[:, :-1], None, S
        run = KV.cumsum(1).add_(S0.unsqueeze(1))
        S = run[:, -1]
        if lay.last.get(0) == n1 - 1:
            finals[0] = S
        return torch.cat([S0.unsqueeze(1), run[:, :-1]], 1), None, S
    if lay.fast:
        return _walk_into(lay, s, KV, a, S, init, finals, rank1)
    starts, us = [], []
    BH = (KV if KV is not None else rank1[0]).shape[0]
    KV = KV.unbind(1) if KV is not None else None       # one op for all the chunks' views, not a slice each
    a = a.expand((BH, n1 - n0) + a.shape[2:]).unbind(1) if a is not None else None
    if rank1 is not None:
        rank1 = tuple(t.unbind(1) for t in rank1)
    for n in range(n0, n1):
        i = n - n0
        if lay.first[n]:
            S = init(lay.seq[n])
        starts.append(S)
        if rank1 is not None:
            W0, Wm, LwT = rank1
            U = torch.baddbmm(W0[i], Wm[i], S)
            us.append(U)
            if KV is None:                    # U holds the values (left = c * key)
                base = S if a is None else a[i] * S
            else:
                base = KV[i] + S if a is None else torch.addcmul(KV[i], a[i], S)
            S = torch.baddbmm(base, LwT[i], U)
        else:
            S = KV[i] + S if a is None else torch.addcmul(KV[i], a[i], S)
        if lay.last.get(lay.seq[n]) == n:
            finals[lay.seq[n]] = S
    return torch.stack(starts, 1), (torch.stack(us, 1) if us else None), S


def _walk_into(lay, s, KV, a, S, init, finals, rank1):
    """_walk without autograd: each state written once into one buffer [n + 1, BH, KF, VF] (the
    walk's own outputs, not a stack of them after; chunk-major, so that each is contiguous for
    the matmuls that write it); views unbound once, as in _walk."""
    n0, n1 = s.start, s.stop
    # [BH, KF, VF] of a state (rank-1 without KV: Wm [BH, n, C, KF], W0 [BH, n, C, VF])
    shape = (KV.shape[:1] + KV.shape[2:]) if KV is not None else (rank1[1].shape[:1] + rank1[1].shape[3:]
                                                                  + rank1[0].shape[3:])
    like = KV if KV is not None else rank1[0]
    buf = lay.arena.take((n1 - n0 + 1,) + shape, like) if lay.arena is not None else like.new_empty(
        (n1 - n0 + 1,) + shape)
    bufs, KVs = buf.unbind(0), (KV.unbind(1) if KV is not None else None)
    a = a.expand(shape[:1] + (n1 - n0,) + a.shape[2:]).unbind(1) if a is not None else None
    if rank1 is not None:
        ushape = (n1 - n0,) + rank1[0].shape[:1] + rank1[0].shape[2:3] + shape[2:]
        us = lay.arena.take(ushape, like) if lay.arena is not None else like.new_empty(ushape)
        W0, Wm, LwT = (t.unbind(1) for t in rank1)
        U = us.unbind(0)
    if not lay.first[n0]:
        bufs[0].copy_(S)
    for n in range(n0, n1):
        i = n - n0
        if lay.first[n]:
            bufs[i].copy_(init(lay.seq[n]))
        if rank1 is not None:
            torch.baddbmm(W0[i], Wm[i], bufs[i], out=U[i])
            if KVs is None:                   # U holds the values (left = c * key)
                if a is None:
                    torch.baddbmm(bufs[i], LwT[i], U[i], out=bufs[i + 1])
                else:
                    torch.mul(a[i], bufs[i], out=bufs[i + 1]).baddbmm_(LwT[i], U[i])
            else:
                base = KVs[i] + bufs[i] if a is None else torch.addcmul(KVs[i], a[i], bufs[i])
                torch.baddbmm(base, LwT[i], U[i], out=bufs[i + 1])
        elif a is None:
            torch.add(KVs[i], bufs[i], out=bufs[i + 1])
        else:
            torch.addcmul(KVs[i], a[i], bufs[i], out=bufs[i + 1])
        if lay.last.get(lay.seq[n]) == n:           # a copy: the next sequence's reset takes this slot
            finals[lay.seq[n]] = bufs[i + 1].clone()
    # the state carried to the next group: a copy out of the arena, which the next group reuses
    S = bufs[-1] if lay.arena is None else bufs[-1].clone()
    return buf[:-1].transpose(0, 1), (us.transpose(0, 1) if rank1 is not None else None), S


def _readout_part(unit, dec, terms, K, V, L, S_starts, U, prev):
    """The readouts of a group of chunks [BH, n, C, VF]: the state at each chunk's start plus the
    chunk's own tokens (the unit's torch_chunks_readout), summed over the readout's terms
    (query, scale)."""
    total = 0
    for Q, sc in terms:
        val = unit.torch_chunks_readout(dec, Q, K, V, L, S_starts, U, prev)
        if sc is not None:
            val = val.mul_(sc) if dec.fast else val * sc
        total = val if isinstance(total, int) else (total.add_(val) if dec.fast else total + val)
    return total


def below_inf(g) -> bool:
    """Whether a log decay holds no NaN and no +inf (-inf is a state reset, which the decays
    take), by one max; False under torch.compile (a host read is a graph break)."""
    if g is None:
        return True
    if torch.compiler.is_compiling():
        return False
    return bool(g.detach().max() < math.inf) if g.numel() else True


def nonfinite_decay_rows(g):
    """[BH, N, C]: the tokens whose log decay g [BH, N, C(, F)] holds a NaN or +inf (None:
    none do, or no decay)."""
    if g is None:
        return None
    bad = ~(g.detach() < math.inf)
    bad = bad.any(-1) if bad.dim() == 4 else bad
    return bad if torch.compiler.is_compiling() or bool(bad.any()) else None


def torch_forward_batched(mod, x, p, opt, sizes, B, T, H, initial_state=None, cu_seqlens=None,
                          output_final_state=False, C=64):
    """torch_forward for the specs batched_supported admits: (o [B, T, H, *out dims],
    final states {name: [N, H, *dims]} or None). In groups of chunks, each taken from the
    inputs to the readouts before the next (the state carried between): whole-sequence
    intermediates were fresh tensors past glibc's mmap threshold, page faults at every op, and
    made the forward 1.2-2.5x fla's naive per-chunk loop at T = 4K-16K."""
    STATES, READOUTS = mod.TORCH_STATES, mod.TORCH_READOUTS
    x0 = next(iter(x.values()))
    dtype, device = x0.dtype, x0.device
    opt = {k: torch.tensor(v, dtype=dtype, device=device) for k, v in opt.items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    pc["g"] = {name: _decay_or_none(g) for name, g in pc["g"].items()}
    lay = Layout(B, T, H, C, cu_seqlens, device)
    # no autograd graph: fresh intermediates may be updated in place (the backward needs none)
    lay.fast = not torch.is_grad_enabled() or not any(
        t.requires_grad for t in list(x.values()) + list(p.values()) + list((initial_state or {}).values()))
    BH = lay.Bp * H
    dims = {name: (pc["K"][name].shape[-1], pc["V"][name].shape[-1]) for name in STATES}

    def init(name, i):
        return _initial(initial_state, name, STATES[name], i, cu_seqlens, BH, *dims[name], dtype, device)
    # a state no readout reads (linear_attn's normalizer z with normalize off) is walked only
    # for its final state
    live = {name: st for name, st in STATES.items()
            if output_final_state or any(rd["state"] == name for rd in READOUTS.values())}
    # each state's key-side inputs checked once for inf / NaN over the whole sequence: where
    # they are finite no group repeats the test (nonfinite_rows)
    lay.finite = {name: all_finite(pc["K"][name], pc["V"][name], pc.get("Lc", {}).get(name, pc["L"].get(name)),
                                   pc["R"].get(name)) and below_inf(pc["g"][name]) for name in live}
    carry = {name: None for name in STATES}
    finals = {name: {} for name in STATES}
    parts = {rname: [] for rname in READOUTS}
    width = max([C] + [d for kv in dims.values() for d in kv])
    grouped = groups(lay.N, BH * C * width, GROUP_ELEMENTS if lay.fast else GRAD_GROUP_ELEMENTS)
    # without autograd over several groups, each group's readouts land in one [B' H, N, C, VF]
    # whose token view is the output (no copy out; fla's naive form returns such a view too)
    whole = {}
    if lay.fast and lay.idx is None and len(grouped) > 1:
        whole = {rname: torch.empty((BH, lay.N, C, dims[rd["state"]][1]), dtype=dtype, device=device)
                 for rname, rd in READOUTS.items()}
    # fast on the CPU: the groups' intermediates from buffers kept across calls (torch_ops.Arena)
    lay.arena = arena(x0) if lay.fast else None
    try:
        for s in grouped:
            if lay.arena is not None:       # the last group's takes are dead
                lay.arena.reset()
            walked = {}
            for name, st in live.items():
                walked[name], carry[name] = _state_group(lay, s, st, pc, name, carry[name],
                                                         lambda i, name=name: init(name, i), finals[name])
            for rname, rd in READOUTS.items():
                unit = classes.unit(STATES[rd["state"]]["class"])
                K, V, L, dec, S_starts, U, bad = walked[rd["state"]]
                terms = [(lay.chunks(Q, s), lay.chunks(sc, s)) for Q, sc in pc["Q"][rname]]
                into = whole[rname][:, s] if rname in whole else None
                dec.out = into if len(terms) == 1 and terms[0][1] is None else None
                total = _readout_part(unit, dec, terms, K, V, L, S_starts, U, rd["prev"])
                dec.out = None
                if bad is not None:
                    seen = bad.cumsum(-1) - (bad.to(torch.long) if rd["prev"] else 0)      # bad tokens up to the row
                    total = total.masked_fill((seen > 0).unsqueeze(-1), float("nan"))
                if into is not None and total.data_ptr() != into.data_ptr():
                    into.copy_(total)
                elif into is None and lay.arena is not None and lay.arena.owns(total):
                    total = total.clone()           # a readout is returned: never an arena's view
                parts[rname].append(into if into is not None else total)
    finally:
        release_arena(lay.arena)
        lay.arena = None
    r = {}
    for rname, rd in READOUTS.items():
        vf = dims[rd["state"]][1]
        got = [whole[rname]] if rname in whole else parts[rname]
        val = lay.tokens(got, (vf,)) if got else torch.zeros(B, T, H, vf, dtype=dtype, device=device)
        vd = STATES[rd["state"]]["vd"]
        r[rname] = val.reshape(val.shape[:3] + tuple(sizes[d] for d in vd)) if vd else val[..., 0]
    o = mod.torch_combine(x, p, opt, sizes, B, T, H, r, None)
    if not output_final_state:
        return o, None
    final = {}
    n_seq = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    for name, st in STATES.items():
        kf, vf = dims[name]
        # an empty sequence keeps its initial state
        S = [finals[name][i] if i in finals[name] else init(name, i) for i in range(n_seq)]
        S = torch.cat([s.reshape(lay.Bp, H, kf, vf) for s in S], 0)
        S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in st["kd"] + st["vd"]))
        final[name] = S.permute(0, 1, *[2 + (st["kd"] + st["vd"]).index(d) for d in st["decl"]])
    return o, final


def _decay_or_none(g):
    """g, or None for a constant log decay of 0 (the delta rule's: a 0-d zero expanded), whose
    pair factors would all be 1: the products skip them."""
    if g is None or g.requires_grad or any(st != 0 for st in g.stride()) or not g.numel():
        return g
    return None if float(g.reshape(-1)[0]) == 0.0 else g


def _state_group(lay, s, st, pc, name, S, init, finals):
    """One state over the chunks s: ((K, V, L, its decay (the unit's torch_decay), the states at
    the chunks' starts, the rank-1 U, the tokens holding inf/NaN or None), the state after them)."""
    unit = classes.unit(st["class"])
    K, V = lay.chunks(pc["K"][name], s), lay.chunks(pc["V"][name], s)
    # a rank-1 left that is a scaled key (left = c * key) comes as c [B' H, N, C]
    scaled = name in pc.get("Lc", {})
    L = lay.chunks(pc["Lc"][name] if scaled else pc["L"].get(name), s)
    R = lay.chunks(pc["R"].get(name), s)
    # causality under non-finite input: a token's key-side rows holding inf or NaN are zeroed
    # before the matmuls; the readouts from it on and the states after are NaN
    bad, g = None, lay.chunks(pc["g"][name], s)
    if not lay.finite.get(name):
        # a NaN or +inf log decay makes its token bad too, and is 0 in the cumulative sums:
        # there its NaN reached the earlier rows of its chunk (issue 30); -inf is a reset
        bad, gbad = nonfinite_rows(K, V, L.unsqueeze(-1) if scaled else L, R), nonfinite_decay_rows(g)
        bad = gbad if bad is None else bad if gbad is None else bad | gbad
        if gbad is not None:
            g = g.masked_fill(~(g < math.inf), 0.0)
    if bad is not None:
        K, V, R = (t.masked_fill(bad.unsqueeze(-1), 0.0) if t is not None else None for t in (K, V, R))
        if L is not None:
            L = L.masked_fill(bad if scaled else bad.unsqueeze(-1), 0.0)
    dec = unit.torch_decay(st, g, lay.fast)
    dec.arena = lay.arena
    rank1 = unit.torch_chunks_setup(dec, K, V, L, R)          # rank-1: the WY/UT solve, U = W0 + Wm S0
    # with left = c * key the rank-1 unit's U holds the values too: no separate K^T V
    KV = None if scaled else unit.torch_chunks_update(dec, K, V)
    if bad is not None:             # the states after a bad token: NaN
        nan = bad.any(-1)[..., None, None]
        if KV is not None:
            KV = KV.masked_fill(nan, float("nan"))
        else:
            rank1 = rank1[:2] + (rank1[2].masked_fill(nan, float("nan")),)
    a = dec.last()
    S_starts, U, S = _walk(lay, s, KV, a, S, init, finals, rank1)
    return (K, V, L, dec, S_starts, U, bad), S


def _initial(initial_state, name, st, i, cu_seqlens, BH, kf, vf, dtype, device):
    """Sequence i's initial state [BH, KF, VF] (B' = 1 with cu_seqlens), zeros without one."""
    if initial_state is None:
        return torch.zeros(BH, kf, vf, dtype=dtype, device=device)
    s0 = initial_state[name].to(dtype)
    s0 = s0 if cu_seqlens is None else s0[i:i + 1]
    s0 = s0.permute(0, 1, *[2 + st["decl"].index(d) for d in st["kd"] + st["vd"]])
    return s0.reshape(BH, kf, vf)


# ---- one chunk at a time ----


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

"""The segmented walk (issue 34 item 4): a sequence's chunk walk split into S segments walked at once.

At B = 1, H = 8 the chunked walk runs on B * H * (tile blocks) programs (16 at V = 128), each
T / C dependent chunk-steps long, while most of an H100's 132 SMs wait. A linear recurrence maps
the state at a stretch's start affinely to its end, S_end = Phi S_start + Z (docs/distributed.md:
context parallelism, the same summary inside one device), so each sequence is cut into S
segments (at multiples of the checkpoint span from its start, never across its end), and:

1. the walk kernel runs over the segments as packed sequences (the segmented stream's offsets,
   `split`), from zero (a sequence's first segment from its initial state): S times the
   programs, 1/S of the chain; each segment's final state is its Z;
2. Phi of each segment, and of each checkpoint's prefix of it, is exp(the sum of the log decays)
   for the scalar and key-diagonal classes: `torch_log_decays` of the generated module (only the
   inputs the decay reads) summed per checkpoint slot (`slot_decays`);
3. the S summaries fold per (sequence, head) into each segment's true start state (`fold`: one
   small matmul, S_start[s] = sum_{r<s} exp(G[s] - G[r+1]) Z[r], G the cumulative log decay at
   segment starts);
4. the output kernel adds exp(the log decay from segment s's start to the checkpoint) * S_start[s]
   to each checkpoint it loads (SEGMENTED: codegen/chunk_ir.segment_correction) and, where the
   checkpoints are kept for the backward, stores the sum back, so the refill and tiles kernels
   read the true chunk-start states, as unsegmented. No pass of its own over the checkpoints:
   the bytes grow by the decays' slot sums and the S start states only
   (bench/results/time-model/segments.md).

The backward's reverse walk alike: segments walked from zero dL/dS (the last from the final
state's gradient), folded from the end (`fold_back`), and the tiles kernel adds
exp(the log decay from a chunk's end to its segment's end) * dL/dS at the segment's end to the
walk's dL/dS at that chunk's end as it reads it (SEGMENTED: codegen/chunk_bwd).

Everything runs in the segmented stream (B = 1, the segments as packed sequences): the
checkpoints a forward keeps are in its layout (checkpoint_slots of that stream), and the
backward takes the same segments (the count is a rule of the shapes and settings only). The
fold and the slot sums are torch on the device without a host sync."""
from __future__ import annotations

from dataclasses import replace

import torch

from .binding import expand_heads
from .buffers import checkpoint_slots, chunk_seqs, empty, one_stage as _one_stage



def unsupported(lp, module, b) -> str | None:
    """Why the segmented walk cannot run this spec's call (None where it can)."""
    states = getattr(module, "TORCH_STATES", None)
    if states is None or not hasattr(module, "torch_log_decays"):
        return "no chunked torch form (its log decays)"
    if lp.fp32_states or set(states) != {n for n, _ in lp.states}:
        return "a stabilizer state"
    for name, st in states.items():
        # the unit says whether Phi is diagonal (classes/base.py diagonal_segments)
        if not st.get("diagonal_segments") or st["decay"] not in ("scalar", "key"):
            return f"state {name} is a {st['class']} (segments: scalar and key-diagonal decays)"
        if st["decl"] != st["kd"] + st["vd"]:
            return f"state {name}'s key dims do not lead its layout"
    if lp.tile is not None and any(lp.tile not in dims for _, dims in lp.states):
        return "a state without the tile dim (per-tile dL/dS partials)"
    return None


def offsets(b, S: int, span: int) -> torch.Tensor:
    """The segmented stream's offsets (int64 [n * S + 1], on the inputs' device): sequence i cut
    into S segments of L_i = ceil(len_i / (S span)) spans each (the last ones shorter or empty),
    segment (i, s) the stream's (i S + s)-th sequence."""
    device = next(iter(b.inputs.values())).device
    n = b.n_seqs
    if b.cu_seqlens is None:
        starts = torch.arange(n, device=device, dtype=torch.int64) * b.T
        lens = torch.full((n,), b.T, device=device, dtype=torch.int64)
    else:
        cu = b.cu_seqlens.to(device=device, dtype=torch.int64)
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    seg = (lens + S * span - 1) // (S * span) * span                      # [n]
    s = torch.arange(S, device=device, dtype=torch.int64)
    cuts = starts[:, None] + torch.minimum(s[None, :] * seg[:, None], lens[:, None])
    end = (starts[-1:] + lens[-1:]) if n else torch.zeros(1, device=device, dtype=torch.int64)
    return torch.cat([cuts.reshape(-1), end])


def split(b, S: int, span: int):
    """The call as the segmented stream: B = 1, T = B * T, the segments as packed sequences (a
    sequence's initial state at its first segment, zeros at the others)."""
    cu = offsets(b, S, span)
    n = b.n_seqs
    inputs = {k: x.reshape((1, x.shape[0] * x.shape[1]) + tuple(x.shape[2:])) for k, x in b.inputs.items()}
    init = None
    if b.initial_state is not None:
        init = {}
        for k, x in b.initial_state.items():
            rows = torch.zeros((n, S) + tuple(x.shape[1:]), dtype=torch.float32, device=x.device)
            rows[:, 0] = x
            init[k] = rows.reshape((n * S,) + tuple(x.shape[1:]))
    return replace(b, B=1, T=b.B * b.T, inputs=inputs, initial_state=init, cu_seqlens=cu), cu


def log_decays(module, b) -> dict:
    """Per state its log decay per token of the (segmented) call: the generated module's
    torch_log_decays on the inputs it reads (each head group expanded). A decay that is an input
    as it is (gla's g, rwkv6's w) or that torch computes in float32 (mamba2's softplus(dt +
    dt_bias) * A, a float32 param) is taken as computed: its slot sums read it once; any other
    is computed again from float32 inputs (as the kernels compute it), not in bf16."""
    x0 = next(iter(b.inputs.values()))

    def run(cast: bool) -> dict:
        xs = {"_dtype": torch.empty(0, dtype=torch.float32, device=x0.device)}   # _x0: float32, the device
        for k in module.TORCH_LOG_DECAY_INPUTS:
            x = expand_heads(b.inputs[k], b.groups[k]) if k in b.groups else b.inputs[k]
            xs[k] = x.float() if cast else x
        p = {k: t.float() for k, t in b.params.items()}
        opt = {k: torch.tensor(float(v), dtype=torch.float32, device=x0.device) for k, v in b.options.items()}
        return module.torch_log_decays(xs, p, opt, dict(b.sizes), b.B, b.T, b.H)

    g = run(False)
    inputs = {b.inputs[k].untyped_storage().data_ptr() for k in module.TORCH_LOG_DECAY_INPUTS}
    if all(v is None or v.dtype in (torch.float32, torch.float64) or v.untyped_storage().data_ptr() in inputs
           for v in g.values()):
        return g
    return run(True)


class SlotDecays:
    """The log decays of a segmented stream per slot of `span` tokens (numbered as the
    checkpoints: segment q's j-th from cu[q] // span + q): per slot the sum over its tokens
    (`sums`) and the sum from its segment's start to the slot's start (`before`), per segment
    the total (`total` [n S, H, *F]), and each slot's segment (`seg`), float32 (the cumulative
    sums in float64: a 64K-token stream's log decays reach 1e4)."""

    def __init__(self, g: torch.Tensor, cu: torch.Tensor, span: int, slots: int, rows: tuple | None = None):
        n_seg = cu.shape[0] - 1
        device = g.device
        self.sums = torch.zeros((slots,) + tuple(g.shape[2:]), dtype=torch.float64, device=device)
        if rows is not None and rows[1] % span == 0 and n_seg:
            # rows B x T of whole spans (no packing): a reshape's sums, each chunk c of row i to its
            # slot i T / span + c + (its segment, i S + s)
            B, T = rows
            S = n_seg // B
            per = g.reshape((B, T // span, span) + tuple(g.shape[2:])).sum(2, dtype=torch.float64)
            seg_len = (cu[1] - cu[0]) // span                     # spans per segment (every row alike)
            c = torch.arange(T // span, device=device, dtype=torch.int64)
            i = torch.arange(B, device=device, dtype=torch.int64)[:, None]
            slot = i * (T // span) + c[None, :] + i * S + torch.clamp(c[None, :] // seg_len.clamp(min=1), max=S - 1)
            self.sums[slot.reshape(-1)] = per.reshape((-1,) + tuple(per.shape[2:]))
        else:
            tok = torch.arange(g.shape[1], device=device, dtype=torch.int64)
            q = torch.searchsorted(cu[1:].contiguous(), tok, right=True)
            slot = cu[q] // span + q + (tok - cu[q]) // span
            self.sums.index_add_(0, slot, g[0].to(torch.float64))      # (packed: a float64 copy of g)
        ex = torch.cumsum(self.sums, 0) - self.sums                  # before each slot, from the stream's start
        first = cu // span + torch.arange(n_seg + 1, device=device, dtype=torch.int64)    # [n S + 1]
        self.seg = chunk_seqs(cu, span, n_seg, slots, device).to(torch.int64)
        self.before = ex - ex[first[self.seg]]
        self.total = ex[first[1:]] - ex[first[:-1]]


def fold(Z: torch.Tensor, G: torch.Tensor, n: int, S: int) -> torch.Tensor:
    """Each segment's true start state and the sequence's end state, [n, S + 1, H, *state]
    (row 0 zeros: a first segment walked from its true start), from the segments' Z [n S, H,
    *state] (float32) and total log decays G [n S, H, *F] (float64, F the decay's dims leading
    the state): S_start[t] = sum_{r < t} exp(Gc[t] - Gc[r + 1]) Z[r], Gc the cumulative sums."""
    Gc = _cumulative(G, n, S)                                   # [n, S + 1, H, *F]
    t = torch.arange(S + 1, device=Z.device)
    r = torch.arange(S, device=Z.device)
    # W[t, r] = exp(Gc[t] - Gc[r + 1]) for r < t
    w = Gc[:, :, None] - Gc[:, None, 1:]                        # [n, S + 1, S, H, *F]
    w = _masked_exp(w, (r[None, :] < t[:, None]))
    return _apply(w, Z, n, S)


def fold_back(D: torch.Tensor, G: torch.Tensor, n: int, S: int) -> torch.Tensor:
    """dL/dS at each segment's true start, [n, S + 1, H, *state] (row S zeros), from the
    segments' local gradients at their starts D [n S, H, *state] (the last segment's from the
    final state's gradient; the others from zero): D_true[t] = sum_{r >= t} exp(Gc[r] - Gc[t]) D[r]."""
    Gc = _cumulative(G, n, S)
    t = torch.arange(S + 1, device=D.device)
    r = torch.arange(S, device=D.device)
    w = Gc[:, None, :S] - Gc[:, :, None]                        # [n, S + 1, S, H, *F]: Gc[r] - Gc[t]
    w = _masked_exp(w, (r[None, :] >= t[:, None]))
    return _apply(w, D, n, S)


def _cumulative(G: torch.Tensor, n: int, S: int) -> torch.Tensor:
    G = G.reshape((n, S) + tuple(G.shape[1:]))
    zero = torch.zeros_like(G[:, :1])
    return torch.cat([zero, torch.cumsum(G, 1)], 1)


def _masked_exp(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    keep = keep.reshape(keep.shape + (1,) * (w.dim() - 3))
    return torch.where(keep, w, torch.full_like(w, float("-inf"))).exp().float()


def _apply(w: torch.Tensor, X: torch.Tensor, n: int, S: int) -> torch.Tensor:
    """out[:, t] = sum_r w[:, t, r] * X[:, r], w [n, S', S, H, *F] broadcast over the state's
    trailing dims, X [n S, H, *F, *R]: a batched matmul over (n, H, *F)."""
    F = w.dim() - 4
    X = X.reshape((n, S) + tuple(X.shape[1:]))                 # [n, S, H, *F, *R]
    lead = X.shape[3:3 + F]
    rest = X.shape[3 + F:]
    H, Sp = X.shape[2], w.shape[1]
    xm = X.reshape(n, S, H, -1, max(1, _prod(rest))).permute(0, 2, 3, 1, 4)        # [n, H, F, S, R]
    wm = w.reshape(n, Sp, S, H, -1).permute(0, 3, 4, 1, 2)                         # [n, H, F, S', S]
    out = torch.matmul(wm, xm)                                                     # [n, H, F, S', R]
    return out.permute(0, 3, 1, 2, 4).reshape((n, Sp, H) + tuple(lead) + tuple(rest))


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# ---- the launches (Launcher.chunk_forward / chunk_backward with S > 1) ----

def _rows(b) -> tuple | None:
    """(B, T) of a call without packed sequences (SlotDecays' reshape), else None."""
    return (b.B, b.T) if b.cu_seqlens is None else None


def _decays(L, b, bs, cu, span: int, slots: int) -> dict:
    """SlotDecays of each state over the segmented stream bs (slots of `span` tokens)."""
    g = log_decays(L.module, bs)
    out = {}
    for name, _ in L.lp.states:
        gn = g[name]
        if gn is None:
            x0 = next(iter(bs.inputs.values()))
            gn = torch.zeros((1, bs.T, bs.H), dtype=torch.float32, device=x0.device)
        out[name] = SlotDecays(gn, cu, span, slots, _rows(b))
    return out


def _key_rows(L, b, name: str, log: torch.Tensor) -> torch.Tensor:
    """A state's per-slot log decays [slots, H, *F] (F: () for a scalar decay, the key dims for a
    key-diagonal one) as the kernels read them: float32 [slots, H, key rows] (a scalar's
    repeated over the rows: a key row's index is all the kernel needs)."""
    rows = _prod(b.sizes[d] for d in L.module.TORCH_STATES[name]["kd"])
    log = log.reshape(tuple(log.shape[:2]) + (-1,)).float()
    return log.expand(tuple(log.shape[:2]) + (rows,)).contiguous()


def forward(L, b, S: int, C: int, every: int, cfg, *, output_final_state: bool, out_dtype, checkpoints: bool):
    """The chunked forward in two launches over S segments per sequence (this module's
    docstring): (o, final states or None, checkpoints in the segmented stream's slots or None)."""
    span = C * every
    n, H = b.n_seqs, b.H
    bs, cu = split(b, S, span)
    x0 = next(iter(bs.inputs.values()))
    programs, common = L.chunk_launch(bs, C, every)
    launch = common | (cfg.launch() if cfg is not None else {})
    kw = dict(chunk_tokens=span, out_dtype=out_dtype)
    intra = None
    if L.stages():      # the intra kernel, as unsegmented (one program per chunk: the segments change nothing)
        dot_dtype = {1: torch.bfloat16, 2: torch.float16}.get(common["dot"], torch.float32)
        intra = empty((bs.T, H, L.lp.intra_matrices, C), dot_dtype, x0.device)
        L.forward(bs, "chunk_fwd", checkpoints=False, ckpts_in={}, write_out=False, grid0=programs * H, tiles=1,
                  intra=intra, output_final_state=False, launch=_one_stage(launch) | {"stage": "intra"}, **kw)
    # 1. the segments' walks from zero (a sequence's first from its initial state): Z, local checkpoints
    _, Z, ckpts = L.forward(bs, "chunk_fwd", checkpoints=True, write_out=False, intra=intra, staged=intra is not None,
                            output_final_state=True, launch=launch | {"stage": "walk"}, **kw)
    # 2.-3. the summaries folded into each segment's true start; 4. the output kernel adds it,
    # decayed, to each checkpoint it loads (and stores the sum back where the checkpoints are kept)
    decays = _decays(L, b, bs, cu, span, checkpoint_slots(bs, span))
    finals, seg = {}, {"segmented": True}
    for name, _ in L.lp.states:
        d = decays[name]
        starts = fold(Z[name], d.total, n, S)                         # [n, S + 1, H, *state]
        seg["seg_start", name] = starts[:, :S].reshape((n * S,) + tuple(starts.shape[2:])).contiguous()
        seg["seg_decay", name] = _key_rows(L, b, name, d.before)
        finals[name] = starts[:, S].contiguous()
    o, _, _ = L.forward(bs, "chunk_fwd", checkpoints=False, ckpts_in=ckpts, grid0=programs * H, intra=intra,
                        staged=intra is not None, output_final_state=False,
                        launch=_one_stage(launch) | {"stage": "output", "segments": S, "store_ckpt": checkpoints}
                        | seg | L.output_blocks(bs), **kw)
    o = o.reshape((b.B, b.T) + tuple(o.shape[2:]))
    return o, (finals if output_final_state else None), (ckpts if checkpoints else None)


def backward(L, b, S: int, ckpts: dict, do: torch.Tensor, dfinal: dict | None, C: int, cfg):
    """The chunked backward over the forward's S segments per sequence: the segments' reverse
    walks from zero dL/dS (the last from the final state's gradient), folded from the end, each
    chunk end's dL/dS corrected in place, then the tiles kernel as unsegmented. Same returns as
    Launcher.chunk_backward."""
    every = L.checkpoint_every(b, C)
    n, H, lp = b.n_seqs, b.H, L.lp
    bs, cu = split(b, S, C * every)
    x0 = next(iter(bs.inputs.values()))
    ckpts = L.chunk_states(bs, ckpts, C)
    slots = checkpoint_slots(bs, C)
    chunk_programs, launch_kw = L.chunk_launch(bs, C)
    common = launch_kw | L.backward_blocks(bs) | (cfg.launch() if cfg is not None else {})
    do_s = do.reshape((1, bs.T) + tuple(do.shape[2:]))
    dfin = None
    if dfinal:
        dfin = {}
        for name, dims in lp.states:
            shape = (n, S, H) + tuple(b.sizes[d] for d in dims)
            rows = torch.zeros(shape, dtype=torch.float32, device=x0.device)
            if name in dfinal:
                rows[:, S - 1] = dfinal[name]
            dfin[name] = rows.reshape((n * S,) + shape[2:])
    dh = {}

    def per_state(name, shape, dfn, dinit, device):
        dh[name] = empty((slots, H) + shape, L.checkpoint_dtype(True, x0.dtype, name), device)
        return dict(ckpt=ckpts[name], dfinal=dfn if dfn is not None else dinit, dinit=dinit, dh=dh[name])
    _, _, local = L.backward(bs, "chunk_bwd", per_state, do_s, dfin, write=("dinit",), launch=common | {"stage": "walk"})
    decays = _decays(L, b, bs, cu, C, slots)
    dinit, seg = {}, {"segmented": True}
    for name, _ in lp.states:
        d = decays[name]
        true = fold_back(local[name], d.total, n, S)                  # [n, S + 1, H, *state]
        # the tiles kernel adds dL/dS at the chunk's segment's end, decayed by exp(the log decay
        # from the chunk's end to there), to the walk's dL/dS at each chunk's end
        seg["seg_start", name] = true[:, 1:].reshape((n * S,) + tuple(true.shape[2:])).contiguous()
        seg["seg_decay", name] = _key_rows(L, b, name, d.total[d.seg] - d.before - d.sums)
        dinit[name] = true[:, 0].contiguous()
    dinputs, dparams, _ = L.backward(
        bs, "chunk_bwd", lambda name, *a: dict(ckpt=ckpts[name], dfinal=do_s, dinit=do_s, dh=dh[name]),
        do_s, dfin, write=("inputs", "params"), grid0=chunk_programs * H, param_rows=chunk_programs,
        launch=_one_stage(common) | {"stage": "tiles"} | seg, tile_programs=1 if lp.tile_loop else None)
    dinputs = {k: x.reshape(b.inputs[k].shape) for k, x in dinputs.items()}
    return dinputs, dparams, dinit

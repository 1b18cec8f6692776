"""Mode "chunk" of a spec whose states are one 2x2 block-affine system (Titans' memory with
momentum): the generated module's torch_pieces (the per-token gates, projections, input terms
and query, float32, with autograd back to the inputs), the chunked Triton kernels over those
pieces (runtime/system_kernels.py: forward and hand-derived backward, an autograd Function),
then the generated torch_combine. The spec's per-token maps stay in torch here (not fused into
the kernels as the other classes' are): the kernels take the system's canonical pieces, so one
kernel pair serves every system of this shape (derive/system_chunk.py kernel_unsupported)."""
from __future__ import annotations

import math

import torch
import triton

from ..standalone.buffers import empty
from . import system_kernels as K
from .cache import interpreting, load_module
from .signature import option_values

# the kernels' block of the value dim (one program per block; tests set it lower for several)
SYSTEM_TILE = 64
# the chunk of mode "chunk" where the call passes none, and each kernel's warps: sm_90's compile
# (tools/aot.py compile_system) at K = V = 64 spills fwd 2,192 B, bwd 52,916 B at C = 16 on 8 / 4
# warps against 13,636 / 78,140 B at C = 32 on 4; at K = V = 16 168 / 3,504 B against 1,752 /
# 51,520. Half the chunk is twice the chunk-steps but half the solve rows in each (the dependent
# rows per token stay ~1) and half the [C, C] products' FLOPs per token.
SYSTEM_CHUNK = 16
SYSTEM_WARPS = {"fwd": 8, "bwd": 4}


class _SystemChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, cu, la, c, ld, w, u0, u1, k0, v0, k1, v1, q, init0, init1):
        C, READ, QS, PREV, H, KF, VF = meta
        n = cu.numel() - 1
        NT = la.shape[0]
        dev = la.device
        BK, BV = max(16, triton.next_power_of_2(KF)), max(16, min(triton.next_power_of_2(VF), SYSTEM_TILE))
        dot = 3 if dev.type == "cuda" and not interpreting() else 0
        out = empty((NT, H, VF), torch.float32, dev)
        fin0, fin1 = (empty((n, H, KF, VF), torch.float32, dev) for _ in range(2))
        slots = NT // C + n + 1
        ck0, ck1 = (empty((slots, H, KF, VF), torch.float32, dev) for _ in range(2))
        use_init = init0 is not None
        grid = (n * H, triton.cdiv(VF, BV))
        K.system_chunk_fwd[grid](la, c, ld, w, u0, u1, k0, v0, k1, v1, q, init0 if use_init else out,
                                 init1 if use_init else out, out, fin0, fin1, ck0, ck1, cu, H, KF, VF,
                                 C=C, BK=BK, BV=BV, READ=READ, QS=QS, PREV=PREV, USE_INIT=use_init, DOT=dot,
                                 num_warps=SYSTEM_WARPS["fwd"])
        ctx.save_for_backward(cu, la, c, ld, w, u0, u1, k0, v0, k1, v1, q, ck0, ck1)
        ctx.meta, ctx.blocks, ctx.use_init = meta, (BK, BV, dot, grid), use_init
        return out, fin0, fin1

    @staticmethod
    def backward(ctx, do, dfin0, dfin1):
        cu, la, c, ld, w, u0, u1, k0, v0, k1, v1, q, ck0, ck1 = ctx.saved_tensors
        C, READ, QS, PREV, H, KF, VF = ctx.meta
        BK, BV, dot, grid = ctx.blocks
        n, NT, dev = cu.numel() - 1, la.shape[0], la.device
        tiles = grid[1]
        do = torch.zeros((NT, H, VF), dtype=torch.float32, device=dev) if do is None else do.float().contiguous()
        use_dfinal = dfin0 is not None or dfin1 is not None
        if use_dfinal:
            dfin0 = torch.zeros((n, H, KF, VF), device=dev) if dfin0 is None else dfin0.float().contiguous()
            dfin1 = torch.zeros((n, H, KF, VF), device=dev) if dfin1 is None else dfin1.float().contiguous()
        g = [empty((tiles, NT, H), torch.float32, dev) for _ in range(3)]
        kg = [empty((tiles, NT, H, KF), torch.float32, dev) for _ in range(6)]
        vg = [empty((NT, H, VF), torch.float32, dev) for _ in range(2)]
        dinit = [empty((n, H, KF, VF), torch.float32, dev) for _ in range(2)]
        K.system_chunk_bwd[grid](la, c, ld, w, u0, u1, k0, v0, k1, v1, q, ck0, ck1, do,
                                 dfin0 if use_dfinal else do, dfin1 if use_dfinal else do, cu,
                                 g[0], g[1], g[2], kg[0], kg[1], kg[2], kg[3], vg[0], kg[4], vg[1], kg[5],
                                 dinit[0], dinit[1], H, KF, VF, NT,
                                 C=C, BK=BK, BV=BV, READ=READ, QS=QS, PREV=PREV, USE_DFINAL=use_dfinal, DOT=dot,
                                 num_warps=SYSTEM_WARPS["bwd"])
        dla, dc, dld = (x.sum(0) for x in g)
        dw, du0, du1, dk0, dk1, dq = (x.sum(0) for x in kg)
        di = (dinit[0], dinit[1]) if ctx.use_init else (None, None)
        return None, None, dla, dc, dld, dw, du0, du1, dk0, vg[0], dk1, vg[1], dq, *di


def system_chunked(plan, bound, *, output_final_state: bool, C: int):
    """(o [B, T, H, *out dims] float32, final states {name: [N, H, *dims]} float32 or None)."""
    mod = load_module(plan)
    ((key, sy),) = mod.TORCH_SYSTEMS.items()
    names, kd, vd = sy["states"], sy["kd"], sy["vd"]
    B, T, H, sizes = bound.B, bound.T, bound.H, dict(bound.sizes)
    f32 = torch.float32
    x = {n: t.to(f32) for n, t in bound.inputs.items()}
    p = {n: t.to(f32) for n, t in bound.params.items()}
    x0 = next(iter(x.values()))
    dev = x0.device
    opt = {k: torch.tensor(v, dtype=f32, device=dev) for k, v in option_values(plan.ir, bound).items()}
    pc = mod.torch_pieces(x, p, opt, sizes, B, T, H)
    pieces = pc["Sys"][key]
    kf, vf = (math.prod(sizes[d] for d in dims) for dims in (kd, vd))
    NT = B * T

    def flat(t, F=None):
        shape = (NT, H) + ((F,) if F is not None else ())
        return torch.zeros(shape, dtype=f32, device=dev) if t is None else t.reshape(shape).to(f32).contiguous()
    ins = {0: (None, None), 1: (None, None)}
    for i, kin, vin in pieces["inputs"]:
        ins[i] = (kin, vin)
    ((rname, rd),) = mod.TORCH_READOUTS.items()
    ((Q, sc),) = pc["Q"][rname]
    cu = (bound.cu_seqlens.to(device=dev, dtype=torch.int64) if bound.cu_seqlens is not None
          else torch.arange(B + 1, device=dev, dtype=torch.int64) * T)
    n = cu.numel() - 1
    decl = {nm: mod.TORCH_STATES[nm]["decl"] for nm in names}
    order = kd + vd
    init = [None, None]
    if bound.initial_state is not None:
        for i, nm in enumerate(names):
            s0 = bound.initial_state[nm].to(f32)
            init[i] = s0.permute(0, 1, *[2 + decl[nm].index(d) for d in order]).reshape(n, H, kf, vf).contiguous()
    meta = (C, names.index(sy["read"]), names.index(rd["state"]), bool(rd["prev"]), H, kf, vf)
    o, f0, f1 = _SystemChunk.apply(meta, cu, flat(pieces["log_a"]), flat(pieces["c"]), flat(pieces["log_d"]),
                                   flat(pieces["w"], kf), flat(pieces["u"][0], kf), flat(pieces["u"][1], kf),
                                   flat(ins[0][0], kf), flat(ins[0][1], vf), flat(ins[1][0], kf),
                                   flat(ins[1][1], vf), flat(Q, kf), *init)
    r = o.reshape((B, T, H) + tuple(sizes[d] for d in vd))
    if not vd:
        r = r[..., 0] if r.dim() > 3 else r
    if sc is not None:
        r = r * sc
    out = mod.torch_combine(x, p, opt, sizes, B, T, H, {rname: r}, None)
    if not output_final_state:
        return out, None
    finals = {}
    for nm, S in zip(names, (f0, f1)):
        S = S.reshape(S.shape[:2] + tuple(sizes[d] for d in order))
        finals[nm] = S.permute(0, 1, *[2 + order.index(d) for d in decl[nm]])
    return out, finals

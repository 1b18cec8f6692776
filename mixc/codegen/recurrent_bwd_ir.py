"""The fused recurrent backward as kernel IR: chunks of CK tokens from last to first; each
chunk's states recomputed from its checkpoint into a scratch buffer, then its tokens walked in
reverse, carrying d_<state> = dL/dS_t back to dL/dS_{t-1} with the adjoint (adjoint.py) of the
forward's per-token code (recurrent_ir.Token)."""
from __future__ import annotations

from ..derive.plan import Plan
from .adjoint import Adjoint, combine
from .kir import nodes as K
from .recurrent_ir import (Token, add, arg, arguments, let, load, mul, name, num, op, prologue, state, state_base,
                           store, tile_base, zeros)
from .triton_expr import Emitter, canon

BWD_NOTES = (
    "One program per (sequence, head), tile block and split block (gradients of what lacks the",
    "tile or the split dim are per-block partials, summed on the host). Chunks of CK tokens from last",
    "to first: recompute the chunk's states from its checkpoint into the scratch, then walk its tokens",
    "in reverse, carrying d_<state> = dL/dS_t back to dL/dS_{t-1}.",
)


def _init_grads(plan: Plan) -> list[K.Stmt]:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    tile = plan.layout.tile
    out: list[K.Stmt] = [K.Comment(""),
                         K.Comment("gradients: of the states (from the final state's), of the params (summed over tokens)")]
    for s in m.states:
        out.append(let(f"d_{s.name}", zeros(canon(order, s.shape))))
        cond = arg("use_dfinal")
        if tile is not None and tile not in s.shape:
            # a state every tile keeps whole: its final gradient enters once, in tile 0
            cond = op("and", cond, op("==", K.Call("tl.program_id", (num(1),)), num(0)))
        out.append(K.If(cond, (let(f"d_{s.name}", load(arg("dfinal", s.name), state_base("seq"), s.shape, order)),)))
    for d in m.params:
        out.append(let(f"dp_{d.name}", zeros(canon(order, d.shape))))
    return out


def _token_backward(plan: Plan) -> list[K.Stmt]:
    """One token in reverse: its forward code, the output's gradient, the adjoints of the output,
    the updates and the lets, the gradients of the inputs stored, of the params summed, of the
    previous states carried."""
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    sdims = {s.name: canon(order, s.shape) for s in m.states}
    tok = Token(plan).build()
    o_shape = canon(order, m.output.expr.shape)
    body = list(tok.stmts)
    body.append(let("_do", load(arg("do"), name("_row"), m.output.expr.shape, order)))
    adj_o = Adjoint(tok.out, "_ao")
    adj_o.backward(m.output.expr, ("_do", o_shape))
    adj_z = None
    if tok.out0 is not None:
        adj_z = Adjoint(tok.out0, "_az")
        adj_z.backward(m.output.expr, adj_z.emit(mul(K.Neg(name("_not_first")), name("_do", o_shape)), o_shape))
    adj_u = Adjoint(tok.upd, "_au")
    seeds = {}
    for s in m.states:       # the gradient of S_t: from later tokens, and from this token's output
        seeds[s.name] = combine(adj_o.out, [(f"d_{s.name}", sdims[s.name])] + adj_o.leaf_parts(("state", s.name)))
    for u in m.updates:
        adj_u.backward(u.expr, seeds[u.state])
    body += adj_o.stmts + (adj_z.stmts if adj_z else []) + adj_u.stmts
    # lets, in reverse: each collects what the output, the updates and later lets sent it
    adj_l = Adjoint(tok.lets, "_al")
    adjs = (adj_o, adj_u, adj_l) + ((adj_z,) if adj_z else ())
    for x in reversed(m.lets):
        parts = [g for a in adjs for g in a.leaf_parts(("let", x.name))]
        if parts:
            adj_l.backward(x.expr, combine(adj_l.out, parts))
    body += adj_l.stmts

    # totals per leaf, once every adjoint has run
    sums = Emitter(m, {}, prefix="_s", values=tok.values)
    tail: list[K.Stmt] = []
    for d in m.inputs:
        cd = canon(order, d.shape)
        g = combine(sums, [g for a in adjs for g in a.leaf_parts(("input", d.name))])
        tail.append(store(arg("dinput", d.name), tile_base(plan, d.shape, name("_row"), "_ntok"), d.shape, order,
                          sums.bcast(*g, cd) if g else zeros(cd), cast=True))
    for d in m.params:
        if (g := combine(sums, [g for a in adjs for g in a.leaf_parts(("param", d.name))])) is not None:
            cd = canon(order, d.shape)
            tail.append(let(f"dp_{d.name}", add(name(f"dp_{d.name}", cd), sums.bcast(*g, cd))))
    for s in m.states:
        # S_{t-1} reaches token t through the update (as S or prev(S)) and the prev() readouts
        parts = (adj_u.leaf_parts(("state", s.name)) + adj_u.leaf_parts(("prev", s.name))
                 + adj_o.leaf_parts(("prev", s.name)))
        g = combine(sums, parts)
        tail.append(let(f"d_{s.name}", sums.bcast(*g, sdims[s.name]) if g else zeros(sdims[s.name])))
    return body + sums.stmts + tail


def backward_kernel(plan: Plan, kernel: str, header: tuple[str, ...]) -> K.Kernel:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    opening, rest = prologue(plan, f"blocks of {plan.layout.split} after the first drop out(0)",
                             "rows of the per-tile gradient partials")
    ckpt = [let(f"s_{s.name}", load(arg("ckpt", s.name), state_base("ckpt"), s.shape, order)) for s in m.states]
    # chunk recompute: states from the checkpoint, stored per token into the scratch buffer
    fwd = Token(plan).build(with_output=False)
    recompute = K.For("_t", name("_c_start"), name("_c_end"), (
        let("_row", add(mul(name("_t"), arg("H")), name("i_h")), "i64"),
        *fwd.stmts,
        *[let(f"s_{s}", fwd.upd.value(v, canon(order, m.state(s).shape))) for s, v in fwd.new.items()],
        let("_slot", op("-", name("_t"), name("_c_start")), "i64"),
        *[store(arg("scratch", s.name), state_base("scratch"), s.shape, order, state(s, order)) for s in m.states],
    ))
    # reverse step: S_{t-1} from the checkpoint or the scratch, then forward and adjoint code
    prev: list[K.Stmt] = [let("_slot", op("-", op("-", name("_t"), name("_c_start")), num(1)), "i64")]
    for s in m.states:
        prev.append(let(f"s_{s.name}", load(arg("ckpt", s.name), state_base("ckpt"), s.shape, order)))
        prev.append(K.If(op(">=", name("_slot"), num(0)),
                         (let(f"s_{s.name}", load(arg("scratch", s.name), state_base("scratch"), s.shape, order)),)))
    reverse = K.For("_tt", num(0), op("-", name("_c_end"), name("_c_start")), (
        let("_t", op("-", op("-", name("_c_end"), num(1)), name("_tt")), "i64"),
        let("_row", add(mul(name("_t"), arg("H")), name("i_h")), "i64"),
        *prev,
        *_token_backward(plan),
    ))
    barrier = K.Do(K.Call("tl.debug_barrier", ()))
    n_chunks = op("//", op("-", add(op("-", name("eos"), name("bos")), arg("ck")), num(1)), arg("ck"))
    chunks = K.For("_cc", num(0), name("_n_chunks_here"), (
        let("_chunk", op("-", op("-", name("_n_chunks_here"), num(1)), name("_cc")), "i64"),
        let("_c_start", add(name("bos"), mul(name("_chunk"), arg("ck"))), "i64"),
        let("_c_end", K.Call("tl.minimum", (add(name("_c_start"), arg("ck")), name("eos"))), "i64"),
        *ckpt, recompute, barrier, reverse, barrier))
    final = [store(arg("dinit", s.name), tile_base(plan, s.shape, state_base("seq"), "_nseq"), s.shape, order,
                   name(f"d_{s.name}", canon(order, s.shape))) for s in m.states]
    final += [store(arg("dparam", d.name), tile_base(plan, d.shape, state_base("seq"), "_nseq"), d.shape, order,
                    name(f"dp_{d.name}", canon(order, d.shape))) for d in m.params]
    body = (*opening, *rest, *_init_grads(plan), K.Comment(""),
            let("_n_chunks_here", n_chunks, "i64"), chunks, K.Comment(""), *final)
    return K.Kernel(kernel, header, arguments(plan, "recurrent_bwd"), tuple(body), BWD_NOTES)

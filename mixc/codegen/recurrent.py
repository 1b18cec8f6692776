"""The fused recurrent kernels: one program per (sequence, head), states in registers, tokens
in order. The forward is also the decode step (T = 1, a state in and out). The backward
recomputes each chunk of CK tokens from a checkpointed state, keeps the chunk's states in a
scratch buffer, and walks the tokens in reverse with the adjoint of the same per-token code.
Templates: templates/recurrent_fwd.py.j2 and recurrent_bwd.py.j2 (plain Triton, named hooks)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..derive.plan import Plan
from ..derive.stabilize import M, M_EMPTY
from ..dsl import ir
from .adjoint import Adjoint, combine
from .triton_expr import Emitter, canon, expand

I1, I2, I3 = "    ", "        ", "            "
Var = tuple[str, tuple[str, ...]]


def _offsets(decl_dims: tuple[str, ...], order: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """Offsets of a block laid out in declared order, as a block in canonical order."""
    cd = canon(order, decl_dims)
    terms = []
    for i, d in enumerate(decl_dims):
        stride = " * ".join(f"_size_{x}" for x in decl_dims[i + 1:])
        term = expand(f"_offs_{d}", (d,), cd)
        terms.append(f"{term} * {stride}" if stride else term)
    return " + ".join(terms), cd


def numel(dims) -> str:
    return " * ".join(f"_size_{d}" for d in dims) or "1"


def mask(dims: tuple[str, ...]) -> str:
    return " & ".join(expand(f"_mask_{d}", (d,), dims) for d in dims) or "True"


def load(ptr: str, base: str, decl: tuple[str, ...], order, indent: str, var: str) -> list[str]:
    if not decl:
        return [f"{indent}{var} = tl.load({ptr} + {base}).to(tl.float32)"]
    offs, cd = _offsets(decl, order)
    return [f"{indent}{var} = tl.load({ptr} + {base} * {numel(decl)} + {offs}, mask={mask(cd)}, "
            f"other=0.0).to(tl.float32)"]


def store(ptr: str, base: str, decl: tuple[str, ...], order, indent: str, value: str, cast: bool = False) -> list[str]:
    v = f"{value}.to({ptr}.dtype.element_ty)" if cast else value
    if not decl:
        return [f"{indent}tl.store({ptr} + {base}, {v})"]
    offs, cd = _offsets(decl, order)
    return [f"{indent}tl.store({ptr} + {base} * {numel(decl)} + {offs}, {v}, mask={mask(cd)})"]


def zeros(dims: tuple[str, ...]) -> str:
    return f"tl.zeros([{', '.join(f'_BLOCK_{d}' for d in dims)}], dtype=tl.float32)" if dims else "_head_f * 0.0"


@dataclass
class Token:
    """The forward code of one token: loads, lets, updates (from states `s_*`), output."""

    plan: Plan
    indent: str
    lines: list[str] = field(default_factory=list)
    env: dict[str, Var] = field(default_factory=dict)
    new: dict[str, str] = field(default_factory=dict)

    def build(self, with_output: bool = True) -> "Token":
        m, order, ind = self.plan.kernel_ir, self.plan.kernel_ir.dim_names, self.indent
        self.env = base_env(self.plan)
        for d in m.inputs:      # its row: token _t, its head (grouped heads: common_hooks)
            self.lines += load(f"p_{d.name}", input_row(d.name, "_t"), d.shape, order, ind, f"v_{d.name}")
            self.env[d.name] = (f"v_{d.name}", canon(order, d.shape))
        self.lets = Emitter(m, self.env, indent=ind, prefix="_l")
        for let in m.lets:
            self.env[let.name] = self.lets(let.expr)
            self.lets.env[let.name] = self.env[let.name]
        self.lines += self.lets.lines
        upd_env = dict(self.env)
        for s in m.states:
            upd_env[s.name] = upd_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
        self.upd = Emitter(m, upd_env, indent=ind, prefix="_u")
        for u in m.updates:
            var, dims = self.upd(u.expr)
            assert set(dims) == set(m.state(u.state).shape)
            self.new[u.state] = var
        self.lines += self.upd.lines
        if with_output:
            out_env = dict(self.env)
            for s in m.states:
                out_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
                out_env[s.name] = (self.new[s.name], canon(order, s.shape))
            self.out = Emitter(m, out_env, indent=ind, prefix="_o")
            self.o = self.out(m.output.expr)
            self.lines += self.out.lines
            self.out0 = None
            if self.plan.layout.split is not None:
                # the state-free part of the output (D * x) counts once: block 0 keeps it, the
                # other blocks subtract it (out evaluated at zero states)
                zero_env = dict(self.env)
                for s in m.states:
                    zs = (f"_zs_{s.name}", canon(order, s.shape))
                    self.lines.append(f"{ind}_zs_{s.name} = {zeros(zs[1])}")
                    zero_env[s.name] = zero_env["prev " + s.name] = zs
                self.out0 = Emitter(m, zero_env, indent=ind, prefix="_z")
                o0 = self.out0(m.output.expr)
                self.lines += self.out0.lines
                od = canon(order, m.output.expr.shape)
                self.lines.append(f"{ind}_oj = {expand(self.o[0], self.o[1], od)} - _not_first * "
                                  f"{expand(o0[0], o0[1], od)}")
                self.o = ("_oj", od)
        return self


def input_row(name: str, token: str) -> str:
    """The row of an input at a token (or a block of tokens): [B, T, H_x, *dims] read at head
    _head_x of its _heads_x (common_hooks; H and i_h where it has every head)."""
    return f"({token} * _heads_{name} + _head_{name})"


def base_env(plan: Plan) -> dict[str, Var]:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    env = {d.name: (f"v_{d.name}", canon(order, d.shape)) for d in m.params}
    env.update({o.name: (f"v_{o.name}", ()) for o in m.options if o.kind == "float"})
    return env


def common_hooks(plan: Plan) -> dict[str, object]:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    params = []
    for d in m.params:
        params += load(f"p_{d.name}", "i_h", d.shape, order, I1, f"v_{d.name}")
    # grouped heads: input x has H / _group_x heads and head i_h reads its head i_h // _group_x
    # (no copy per head; _group_x = 1, Triton's specialization, folds this away)
    if m.inputs:
        params.append(f"{I1}# grouped heads: each input's heads, and the one this head reads")
    for d in m.inputs:
        params.append(f"{I1}_heads_{d.name} = H // _group_{d.name}")
        params.append(f"{I1}_head_{d.name} = i_h // _group_{d.name}")
    # the arguments are not hooks: plan.layout.kernel_args (standalone/kernel_args.py)
    return {
        "dims": list(order),
        "tile": plan.layout.tile,
        "split": plan.layout.split,
        "load_params": "\n".join(params) or f"{I1}pass",
    }


def partial_index(plan: Plan, shape: tuple[str, ...]) -> str | None:
    """Which partial a program writes for a gradient (or output) of this shape: what lacks the
    tile dim gets one per tile, what lacks the split dim one per split block (summed on the
    host). None where every program writes its own elements of one buffer."""
    t, k = plan.layout.tile, plan.layout.split
    by_tile = t is not None and t not in shape
    by_split = k is not None and k not in shape
    if by_tile and by_split:
        return "(tl.program_id(1).to(tl.int64) * tl.num_programs(2) + tl.program_id(2))"
    if by_tile:
        return "tl.program_id(1).to(tl.int64)"
    if by_split:
        return "tl.program_id(2).to(tl.int64)"
    return None


def tile_base(plan: Plan, shape: tuple[str, ...], base: str) -> str:
    """The row of a gradient of something without the tile or the split dim: each such
    program writes its own partial (summed on the host), rows offset by partial * rows."""
    index = partial_index(plan, shape)
    if index is None:
        return base
    rows = "_ntok * H" if base == "_row" else "_nseq * H"
    return f"({index} * {rows} + {base})"


def state_base(kind: str) -> str:
    """Row of a state in its buffer: per (sequence, head), per (cache slot, head) in the forward
    (slot: the sequence's own row, or its entry of state_indices), or per checkpoint / scratch slot."""
    # checkpoint slots: sequence i's chunks start at bos // CK + i, which never overlaps sequence
    # i - 1's, so packed sequences need at most (total tokens) // CK + N + 1 slots
    return {"seq": "(i_n * H + i_h)", "slot": "(i_s * H + i_h)", "ckpt": "((bos // CK + i_n + _chunk) * H + i_h)",
            "scratch": "(((tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)"
                       " + tl.program_id(2)) * CK + _slot)"}[kind]


def recurrent_fwd_hooks(plan: Plan) -> dict[str, object]:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    init = []
    for s in m.states:
        if s.name == M:         # a stabilizer's m: an empty state's (derive/stabilize.py)
            init.append(f"{I1}s_{s.name} = _head_f * 0.0 + {M_EMPTY}")
        else:
            init.append(f"{I1}s_{s.name} = {zeros(canon(order, s.shape))}")
        init.append(f"{I1}if USE_INITIAL_STATE:")
        init += load(f"p_init_{s.name}", state_base("slot"), s.shape, order, I2, f"s_{s.name}")
    ckpt = [f"{I2}if STORE_CHECKPOINTS:", f"{I3}if (_t - bos) % CK == 0:", f"{I3}    _chunk = (_t - bos) // CK"]
    for s in m.states:
        ckpt += store(f"p_ckpt_{s.name}", state_base("ckpt"), s.shape, order, I3 + "    ", f"s_{s.name}")
    tok = Token(plan, I2).build()
    o_var, o_dims = tok.o
    o_shape = m.output.expr.shape
    out = store("p_out", tile_base(plan, o_shape, "_row") if plan.layout.split else "_row", o_shape, order, I2,
                expand(o_var, o_dims, canon(order, o_shape)), cast=True)
    # the states advance after the output has read both the old and the new ones
    advance = [f"{I2}s_{s} = {v}" for s, v in tok.new.items()]
    final = []
    for s in m.states:
        final += store(f"p_final_{s.name}", state_base("slot"), s.shape, order, I2, f"s_{s.name}")
    return common_hooks(plan) | {
        "init_states": "\n".join(init),
        "checkpoint": "\n".join(ckpt),
        "token": "\n".join(tok.lines + out + advance),
        "store_states": "\n".join(final),
    }


def recurrent_bwd_hooks(plan: Plan) -> dict[str, object]:
    m, order = plan.kernel_ir, plan.kernel_ir.dim_names
    sdims = {s.name: canon(order, s.shape) for s in m.states}
    init = []
    tile = plan.layout.tile
    for s in m.states:
        init.append(f"{I1}d_{s.name} = {zeros(sdims[s.name])}")
        if tile is None or tile in s.shape:
            init.append(f"{I1}if USE_FINAL_STATE_GRAD:")
        else:       # a state every tile keeps whole: its final gradient enters once, in tile 0
            init.append(f"{I1}if USE_FINAL_STATE_GRAD and tl.program_id(1) == 0:")
        init += load(f"p_dfinal_{s.name}", state_base("seq"), s.shape, order, I2, f"d_{s.name}")
    for d in m.params:
        init.append(f"{I1}dp_{d.name} = {zeros(canon(order, d.shape))}")

    # chunk recompute: states from the checkpoint, stored per token into the scratch buffer
    load_ckpt = []
    for s in m.states:
        load_ckpt += load(f"p_ckpt_{s.name}", state_base("ckpt"), s.shape, order, I2, f"s_{s.name}")
    fwd = Token(plan, I3).build(with_output=False)
    recompute = list(fwd.lines) + [f"{I3}s_{s} = {v}" for s, v in fwd.new.items()]
    recompute.append(f"{I3}_slot = _t - _c_start")
    for s in m.states:
        recompute += store(f"p_scratch_{s.name}", state_base("scratch"), s.shape, order, I3, f"s_{s.name}")

    # reverse step: S_{t-1} from the checkpoint or the scratch, then forward and adjoint code
    prev = [f"{I3}_slot = _t - _c_start - 1"]
    for s in m.states:
        prev += load(f"p_ckpt_{s.name}", state_base("ckpt"), s.shape, order, I3, f"s_{s.name}")
        prev.append(f"{I3}if _slot >= 0:")
        prev += load(f"p_scratch_{s.name}", state_base("scratch"), s.shape, order, I3 + "    ", f"s_{s.name}")
    tok = Token(plan, I3).build()
    o_shape = canon(order, m.output.expr.shape)
    body = list(tok.lines)
    body += load("p_do", "_row", m.output.expr.shape, order, I3, "_do")
    adj_o = Adjoint(tok.out, "_ao")
    adj_o.backward(m.output.expr, ("_do", o_shape))
    adj_z = None
    if tok.out0 is not None:
        adj_z = Adjoint(tok.out0, "_az")
        adj_z.backward(m.output.expr, adj_z.emit("-_not_first * _do", o_shape))
    adj_u = Adjoint(tok.upd, "_au")
    seeds = {}
    for s in m.states:       # the gradient of S_t: from later tokens, and from this token's output
        seeds[s.name] = combine(adj_o.out, [(f"d_{s.name}", sdims[s.name])] + adj_o.leaf_parts(("state", s.name)))
    for u in m.updates:
        adj_u.backward(u.expr, seeds[u.state])
    body += adj_o.lines + (adj_z.lines if adj_z else []) + adj_u.lines
    # lets, in reverse: each collects what the output, the updates and later lets sent it
    adj_l = Adjoint(tok.lets, "_al")
    adjs = (adj_o, adj_u, adj_l) + ((adj_z,) if adj_z else ())
    for let in reversed(m.lets):
        parts = [g for a in adjs for g in a.leaf_parts(("let", let.name))]
        if parts:
            adj_l.backward(let.expr, combine(adj_l.out, parts))
    body += adj_l.lines

    # totals per leaf, once every adjoint has run
    sums = Emitter(m, {}, indent=I3, prefix="_s")
    tail = []
    for d in m.inputs:
        cd = canon(order, d.shape)
        g = combine(sums, [g for a in adjs for g in a.leaf_parts(("input", d.name))])
        tail += store(f"p_d{d.name}", tile_base(plan, d.shape, "_row"), d.shape, order, I3,
                      expand(g[0], g[1], cd) if g else zeros(cd),
                      cast=True)
    for d in m.params:
        if (g := combine(sums, [g for a in adjs for g in a.leaf_parts(("param", d.name))])) is not None:
            tail.append(f"{I3}dp_{d.name} = dp_{d.name} + {expand(g[0], g[1], canon(order, d.shape))}")
    for s in m.states:
        # S_{t-1} reaches token t through the update (as S or prev(S)) and the prev() readouts
        parts = (adj_u.leaf_parts(("state", s.name)) + adj_u.leaf_parts(("prev", s.name))
                 + adj_o.leaf_parts(("prev", s.name)))
        g = combine(sums, parts)
        tail.append(f"{I3}d_{s.name} = {expand(g[0], g[1], sdims[s.name]) if g else zeros(sdims[s.name])}")
    body += sums.lines + tail

    final = []
    for s in m.states:
        final += store(f"p_dinit_{s.name}", tile_base(plan, s.shape, state_base("seq")), s.shape, order, I1,
                       f"d_{s.name}")
    for d in m.params:
        final += store(f"p_dp_{d.name}", tile_base(plan, d.shape, state_base("seq")), d.shape, order, I1,
                       f"dp_{d.name}")
    return common_hooks(plan) | {
        "init_grads": "\n".join(init),
        "load_checkpoint": "\n".join(load_ckpt),
        "recompute": "\n".join(recompute),
        "load_prev": "\n".join(prev),
        "token_backward": "\n".join(body),
        "store_grads": "\n".join(final),
    }

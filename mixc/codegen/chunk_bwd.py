"""The chunked backward kernel of the linear classes. One program per (sequence, head) walks
the chunks from last to first, with dL/dS (a [key, value] matrix per state) in registers:

1. recompute the chunk's forward (chunk.py's per-chunk body) from its checkpointed S0;
2. the output's adjoint gives dR for every readout (codegen/adjoint.py on the combine);
3. the matrix adjoints of the readouts and of the state update give dQ, dK, dV, db, dS0
   (per class, in matmuls: the unit's chunk_*_backward hooks, built as kernel IR in
   mixc/classes/<class>.py);
4. db becomes the per-token log-decay gradient by a reverse cumulative sum;
5. dQ, dK, dV, dg go back through the spec's own expressions (adjoint.py again) to the
   inputs of the chunk's tokens, the params (summed) and the lets."""
from __future__ import annotations

import textwrap

from .. import classes
from ..derive import plan as P
from ..derive.plan import Plan
from .adjoint import Adjoint, combine
from .chunk import ChunkCode, g_is_vector
from .recurrent import I1, I2, I3, numel, zeros
from .key_split import key_dim
from .tile_split import split_tiles
from .triton_expr import Emitter, canon, expand


class ChunkBackward(ChunkCode):
    def hooks(self) -> dict:
        m, order = self.m, self.order
        self.values_apart = True
        # the staged walk reads the inverses at their places in p_intra (the forward's order:
        # ChunkCode.intra_slot); a key-diagonal readout's staged A is read by the forward's
        # output kernel only, the backward's computes it (mixc/classes/key_diag.py _staged_pairs)
        self.staged = self.reads_staged
        # the walk writes dL/dS only (and the initial states' gradients); the tiles kernel the
        # inputs' and params' gradients; the fused walk all of them
        walks = self.kernel_stage != "tiles"
        grads_out = self.kernel_stage != "walk"
        fb = self.forward_body()
        em, per_state, readouts, oem = fb["em"], fb["per_state"], fb["readouts"], fb["oem"]
        body = list(fb["body"])
        L = body.append

        # 2. the output's adjoint
        o_shape = canon(order, m.output.expr.shape)
        want = ("_T",) + o_shape
        offs = self._offsets(m.output.expr.shape, canonical=True)
        mask = " & ".join([expand("_mask__T", ("_T",), want)] + [expand(f"_mask_{x}", (x,), want) for x in o_shape])
        rows = expand("_rows", ("_T",), want)
        L(f"{I2}_do = tl.load(p_do + ({rows} * H + i_h) * {numel(m.output.expr.shape)}"
          f"{' + ' + offs if offs else ''}, mask={mask}, other=0.0).to(tl.float32)")
        adj_o = Adjoint(oem, "_bo")
        combine_ir = self.stab.combine_ir if self.stab is not None else self.plan.output.combine_ir
        adj_o.backward(combine_ir, ("_do", want))
        d_readout = {r.name: combine(adj_o.out, adj_o.leaf_parts(("readout", r.name))) for r, _, _ in readouts}
        body += adj_o.lines

        # 3. matrix adjoints, accumulated per state
        grads = {}               # state -> dict of names of the gradient matrices
        for st in self.states:
            n = st.name
            K, V, g, kd, vd = per_state[n]
            grads[n] = {"dK": [], "dV": [], "db": [], "dS0": [], "di": [], "dL": [], "dU": []}
        seeds = []               # (IR expr, gradient var, its dims) for step 5
        for r, st, terms in readouts:
            n = st.name
            K, V, g, kd, vd = per_state[n]
            if d_readout[r.name] is None:
                continue
            dr_var, dr_dims = d_readout[r.name]
            dR = self.fresh("dR")
            L(f"{I2}{dR} = {self._value_matrix(dr_var, dr_dims, vd)}")
            for t, Q, sc, core in terms:
                dcore = dR
                if sc is not None:
                    dsc = self.fresh("dsc")
                    L(f"{I2}{dsc} = {dR} * {core}")
                    seeds.append((t.scale, self.unflat(dsc, ("_T",) + vd), ("_T",) + vd))
                    dcore = self.fresh("dR")
                    L(f"{I2}{dcore} = {dR} * {sc}")
                dQ = self.fresh("dQ")
                body += self.readout_backward(st, dcore, Q, K, V, r.prev, dQ, grads[n])
                if t.proj is not None:
                    seeds.append((t.proj, self.unflat(dQ, ("_T",) + kd), ("_T",) + kd))
        # the state updates (dL/dS_C is d_<state>)
        for st in self.states:
            body += self.advance_backward(st, per_state[st.name], grads[st.name])
        # back through the class's setup (rank-1: the triangular solve of U)
        for st in self.states:
            lines, more = classes.unit(st.transition).chunk_setup_backward(self, st, per_state[st.name], grads[st.name])
            body += self.stage(st, "setup_backward", lines)
            seeds += more

        # 4. per-token log-decay gradients; the state gradient moves to the chunk start
        for st in self.states:
            n = st.name
            K, V, g, kd, vd = per_state[n]
            G = grads[n]
            if g is not None:
                db = " + ".join(G["db"]) or "0.0"
                last = "_offs__T == _n_valid - 1" if g_is_vector(st) else "(_offs__T == _n_valid - 1)[:, None]"
                L(f"{I2}_db_{n} = {db} + tl.where({last}, _dbl_{n}, 0.0)")
                # a reset's pairs all weigh exp(-inf) = 0: its gradient is 0, not the rounding
                # left by the cancelling pairs of the reverse cumsum
                L(f"{I2}_dg_{n} = tl.where(_r_{n}, 0.0, tl.cumsum(_db_{n}, axis=0, reverse=True))")
                gdims = ("_T",) + classes.unit(st.transition).decay_axes(st, kd, vd)
                seeds.append((st.ir_pieces.log_decay, self.unflat(f"_dg_{n}", gdims), gdims))
            seeds.append((st.ir_pieces.key, self.unflat(" + ".join(G["dK"]), ("_T",) + kd), ("_T",) + kd))
            if st.ir_pieces.value is not None:
                dV = " + ".join(G["dV"])
                if n in self.badv:      # a value zeroed in this block: its gradient too (sanitize)
                    dV = self.fresh("dVz")
                    L(f"{I2}{dV} = tl.where(_badv_{n}[:, None] > 0, 0.0, {' + '.join(G['dV'])})")
                seeds.append((st.ir_pieces.value, self.unflat(dV, ("_T",) + vd), ("_T",) + vd))

        if self.stab is not None:     # the gate's exponent: its key-side log weights
            di = [x for n in self.stab.states for x in grads[n]["di"]]
            if di:
                L(f"{I2}_dgi = tl.where(_mask__T, {' + '.join(di)}, 0.0)")
                seeds.append((self.stab.log_gate, "_dgi", ("_T",)))

        # 5. back through the spec's expressions to inputs, params and lets
        adj = Adjoint(em, "_bi")
        for expr, var, dims in seeds:
            if var is None:
                continue
            name = self.fresh("seed")
            L(f"{I2}{name} = {var}")
            adj.backward(expr, (name, dims))
        adj_l = Adjoint(em, "_bl")
        adjs = (adj_o, adj, adj_l)
        for let in reversed(m.lets):
            parts = [g for a in adjs for g in a.leaf_parts(("let", let.name))]
            if parts:
                adj_l.backward(let.expr, combine(adj_l.out, parts))
        body += adj.lines + adj_l.lines
        sums = Emitter(m, {}, indent=I2, prefix="_bs", order=order)
        tail = []
        # an input's gradient lacking the tile dim (dq, dk, dg: fla's dqkwg) is summed over the
        # tile blocks in registers (_sum_d<x>, stored once after the tile loop); one with it
        # (dv) is stored per block
        sums_init, sums_store = [], []
        for d in m.inputs:
            cd = ("_T",) + canon(order, d.shape)
            g = combine(sums, [x for a in adjs for x in a.leaf_parts(("input", d.name))])
            value = expand(g[0], g[1], cd) if g else "0.0"
            if g is None or set(g[1]) != set(cd):
                value = f"({value} + tl.zeros([{', '.join(f'_BLOCK_{x}' for x in cd)}], dtype=tl.float32))"
            offs = self._offsets(d.shape)
            mask = " & ".join([expand("_mask__T", ("_T",), cd)] + [expand(f"_mask_{x}", (x,), cd) for x in cd[1:]])
            rows = expand("_rows", ("_T",), cd)
            ptr = f"p_d{d.name} + ({self._partial(d.shape, '_ntok')}{rows} * H + i_h) * {numel(d.shape)}" \
                  f"{' + ' + offs if offs else ''}"
            if self._lacks_tile(d.shape):
                acc = f"_sum_d{d.name}"
                sums_init.append(f"{I2}{acc} = tl.zeros([{', '.join(f'_BLOCK_{x}' for x in cd)}], dtype=tl.float32)")
                if grads_out:
                    tail.append(f"{I2}{acc} = {acc} + {value}")
                    sums_store.append(f"{I2}tl.store({ptr}, {acc}.to(p_d{d.name}.dtype.element_ty), mask={mask})")
                continue
            if grads_out:
                tail.append(f"{I2}tl.store({ptr}, {value}.to(p_d{d.name}.dtype.element_ty), mask={mask})")
        for d in m.params:
            g = combine(sums, [x for a in adjs for x in a.leaf_parts(("param", d.name))])
            if g is not None:
                pd = canon(order, d.shape)
                extra = tuple(x for x in g[1] if x not in pd)
                if extra:
                    g = sums.reduce(g[0], g[1], extra)
                if grads_out:
                    tail.append(f"{I2}dp_{d.name} = dp_{d.name} + {expand(g[0], g[1], pd)}")
        for st in self.states:
            tail.append(f"{I2}d_{st.name} = {' + '.join(grads[st.name]['dS0'])}")
        body += sums.lines + tail

        init, load_ckpt, final = [], [], []
        for st in self.states:
            n = st.name
            K, V, g, kd, vd = per_state[n]
            init += self.state_io(st, I1)
            init.append(f"{I1}d_{n} = tl.zeros([{self._blocks(kd)}, {self._blocks(vd)}], dtype=tl.float32)")
            # a state every tile keeps whole (a normalizer): its final gradient enters once, in tile 0
            whole = self._lacks_tile(self.m.state(n).shape)
            if walks:
                init.append(f"{I1}if USE_FINAL_STATE_GRAD{' and tl.program_id(1) == 0' if whole else ''}:")
                ptr, msk = self.state_ptr(st, f"p_dfinal_{n}", "(i_n * H + i_h)")
                init.append(f"{I2}d_{n} = tl.load({ptr}, mask={msk}, other=0.0)")
            slot = "(bos // _BLOCK__T + i_n + _chunk)"
            ptr, msk = self.state_ptr(st, f"p_ckpt_{n}", f"({slot} * H + i_h)")
            load_ckpt.append(f"{I2}s_{n} = tl.load({ptr}, mask={msk}, other=0.0).to(tl.float32)")
            # dL/dS at the chunk's end: the walk keeps it for the tiles kernel ([slots, tiles, H,
            # *dims] where the state lacks the tile dim: each block's own partial, as for dinit)
            if whole:
                slot = f"({slot} * _N_TILES + _tv)"
            ptr, msk = self.state_ptr(st, f"p_dh_{n}", f"({slot} * H + i_h)")
            if self.kernel_stage == "walk":
                load_ckpt.append(f"{I2}tl.store({ptr}, d_{n}, mask={msk})")
            elif self.kernel_stage == "tiles":
                load_ckpt.append(f"{I2}d_{n} = tl.load({ptr}, mask={msk}, other=0.0).to(tl.float32)")
                if not whole and self.stab is None:
                    load_ckpt += self._segment_correction(st, slot)
            ptr, msk = self.state_ptr(st, f"p_dinit_{n}", f"({self._partial(self.m.state(n).shape, '_nseq')}i_n * H + i_h)")
            if walks:
                final.append(f"{I1}tl.store({ptr}, d_{n}, mask={msk})")
        for d in m.params:
            init.append(f"{I1}dp_{d.name} = {zeros(canon(order, d.shape))}")
            pd = canon(order, d.shape)
            offs = " + ".join(f"{expand(f'_offs_{x}', (x,), pd)}" + "".join(f" * _size_{y}" for y in d.shape[i + 1:])
                              for i, x in enumerate(d.shape)) or "0"
            if grads_out:
                final.append(f"{I1}tl.store(p_dp_{d.name} + ({self._partial(d.shape, '_nprow')}_prow * H + i_h) * {numel(d.shape)}"
                         f" + {offs}, dp_{d.name}"
                         + (f", mask={' & '.join(expand(f'_mask_{x}', (x,), pd) for x in pd)})" if pd else ")"))
        if self.stab is not None:     # m is held constant: no gradient of its own
            load_ckpt.append(f"{I2}s__m = tl.load(p_ckpt__m + (bos // _BLOCK__T + i_n + _chunk) * H + i_h)")
            if walks:
                final.append(f"{I1}tl.store(p_dinit__m + {self._partial((), '_nseq')}i_n * H + i_h, _fhead * 0.0)")
        # the tile loop: this program's blocks of the tile dim (one in the walks, which keep one
        # block's d_<state>; the tiles kernel launched with one program along axis 1 takes all)
        tile_loop = []
        if self.tile is not None:
            t = self.tile
            tile_loop = sums_init + [
                f"{I2}for _tv in range(tl.program_id(1), _N_TILES, tl.num_programs(1)):",
                f"{I3}_offs_{t} = _tv * _BLOCK_{t} + tl.arange(0, _BLOCK_{t})",
                f"{I3}_mask_{t} = _offs_{t} < _size_{t}"]
            for st in self.states:
                tile_loop += self.tile_io(st, I3, "_tv")
        loop = "\n".join
        if self.tile is not None:
            loop = lambda lines: textwrap.indent("\n".join(lines), "    ")     # noqa: E731 (inside the tile loop)
        return {
            "init_grads": "\n".join(init),
            "tile_loop": "\n".join(tile_loop),
            "load_checkpoint": loop(load_ckpt),
            "load_inputs": loop(fb["loads"]),
            "chunk_backward": loop(body),
            "store_sums": "\n".join(sums_store),
            "store_grads": "\n".join(final),
        }

    # ---- helpers ----
    def _segment_correction(self, st: P.StatePlan, slot: str) -> list[str]:
        """The tiles kernel of the segmented walk (standalone/segments.py, SEGMENTED): the walk's
        dL/dS at this chunk's end was carried back from its segment's end at zero; dL/dS at the
        segment's end (seg_start, row i_n: the segments are the stream's sequences), decayed per
        key row by exp(seg_decay[slot]) (the log decay from the chunk's end to the segment's end),
        added: the true dL/dS, as unsegmented. A key row's index is its offset // the value dims'
        size (the scalar and key-diagonal classes, key dims leading: segments.unsupported)."""
        n = st.name
        keys = " * ".join(f"_size_{d}" for d in st.key_dims) or "1"
        values = " * ".join(f"_size_{d}" for d in st.value_dims) or "1"
        ptr, msk = self.state_ptr(st, f"p_segstart_{n}", "(i_n * H + i_h)")
        decay = (f"tl.load(p_segdecay_{n} + ({slot} * H + i_h) * ({keys}) + _ok_{n} // ({values}), "
                 f"mask=_mk_{n}, other=0.0)")
        return [f"{I2}if SEGMENTED:     # the segment's end dL/dS, decayed to this chunk's end, added",
                f"{I3}d_{n} = d_{n} + tl.exp({decay})[:, None] * tl.load({ptr}, mask={msk}, other=0.0)"]

    def _lacks_tile(self, shape) -> bool:
        return self.tile is not None and self.tile not in shape

    def _partial(self, shape, rows: str) -> str:
        """The row offset of this program's partial for a gradient of something without the
        tile dim ("" for what has it): every tile block adds the part of the gradient that its
        values carry (the backward is linear in dL/do), summed on the host as in the recurrent
        kernels (Launcher.backward). `rows`: rows of one partial per head (_ntok or _nseq)."""
        return f"tl.program_id(1).to(tl.int64) * {rows} * H + " if self._lacks_tile(shape) else ""

    def _blocks(self, dims) -> str:
        return " * ".join(f"_BLOCK_{d}" for d in dims)

    def _value_matrix(self, var: str, dims, vd) -> str:
        """A readout gradient [C, *value dims] (or [C]) as a [C, VF] matrix."""
        want = ("_T",) + tuple(vd)
        full = f"({expand(var, dims, want)} + tl.zeros([_BLOCK__T, {', '.join(f'_BLOCK_{d}' for d in vd)}], "\
               f"dtype=tl.float32))"
        mask = " & ".join([expand("_mask__T", ("_T",), want)] + [expand(f"_mask_{d}", (d,), want) for d in vd])
        out = f"tl.where({mask}, {full}, 0.0)"
        return out if len(vd) == 1 else f"tl.reshape({out}, [_BLOCK__T, {self._blocks(vd)}])"

    def unflat(self, var: str, dims) -> str | None:
        """A [C, flat] gradient matrix back to the axes of `dims` (the key or value dims)."""
        if not var:
            return None
        axes = dims[1:]
        if len(axes) <= 1:
            return var
        return f"tl.reshape({var}, [_BLOCK__T, {', '.join(f'_BLOCK_{d}' for d in axes)}])"

    def query_side(self, st, db: str, prev: bool) -> list[str]:
        """_dbq, the gradient of the query rows' b, into db (b_{i-1} for prev: row i - 1)."""
        I = I2
        if not prev:
            return [f"{I}{db} = {db} + _dbq"]
        back = "(_offs__T[None, :] - 1 == _offs__T[:, None])"
        if g_is_vector(st):
            return [f"{I}{db} = {db} + tl.sum(tl.where({back}, _dbq[None, :], 0.0), axis=1)"]
        return [f"{I}{db} = {db} + tl.sum(tl.where({back}[:, :, None], _dbq[None, :, :], 0.0), axis=1)"]

    def readout_backward(self, st: P.StatePlan, dR: str, Q: str, K: str, V: str, prev: bool, dQ: str,
                         G: dict) -> list[str]:
        """dQ (assigned), and contributions to dK, dV, db and dS0 of one readout term."""
        return self.stage(st, "readout_backward",
                          classes.unit(st.transition).chunk_readout_backward(self, st, dR, Q, K, V, prev, dQ, G))

    def advance_backward(self, st: P.StatePlan, parts, G: dict) -> list[str]:
        """Contributions of S_C = f(S0, K, V, b) given d_<state> = dL/dS_C."""
        return self.stage(st, "advance_backward", classes.unit(st.transition).chunk_advance_backward(self, st, parts, G))


def chunk_bwd_hooks(plan: Plan, kernel_stage: str, reads_staged: bool = False) -> dict:
    """The texts of one stage's backward kernel that chunk_ir.backward_kernel places (reads_staged:
    the walk's variant that reads the rank-1 inverses the intra kernel staged)."""
    return ChunkBackward(plan, kernel_stage, reads_staged).hooks()


def split_backward(plan: Plan, source: str, kernel: str) -> tuple[str, str | None]:
    """The rendered tiles kernel `kernel` with its tile loop split (codegen/tile_split.py), and
    its keyblocks variant or None. Its cotangents: the output's gradient and each state's dL/dS."""
    code = ChunkBackward(plan)
    cotangents = {"_do"} | {f"d_{st.name}" for st in code.states}
    aliases = {d.name: plan.ir.root_dim(d.name) for d in plan.ir.dims if d.alias_of}
    flags = {f"_bad_{st.name}" for st in code.states} | {f"_badv_{st.name}" for st in code.states}
    return split_tiles(source, kernel, plan.layout.tile, cotangents, aliases, key_dim(plan), flags)

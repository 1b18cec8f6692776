"""The fused chunked forward kernel of the linear classes (prefix sum, scalar, key- and
value-diagonal decay). One program per (sequence, head) walks the chunks of C tokens in
order with every state in registers as a [key, value] matrix; in each chunk it computes
the readouts of all C tokens with matmuls (the inter-chunk term from the state, the
intra-chunk term from a causal matrix) and advances the states:

    O   = (Q * exp(b)) S0 + [ sum_d q_id k_jd exp(b_id - b_jd), i >= j ] V
    S_C = exp(b_C) * S0 + (K * exp(b_C - b))^T V

with b the cumulative log decay inside the chunk. Only exponents b_i - b_j (i >= j) and
b_C - b_j are formed, none positive for a decay <= 1, so strong decay cannot overflow. The
state at each chunk start is kept as the recurrent backward's checkpoint (CK = C).

Key dims of a state flatten into one matrix axis (based's S2[K, J, V] is a [K*J, V] matrix),
value dims too; a state without key (or value) dims gets a unit axis "_1".

What a class computes in a chunk (its readout, its state advance, the rank-1 class's setup)
is its unit's chunk_* hooks (mixc/classes/<class>.py): built as kernel IR with the builder
`builder(st)` hands them (codegen/chunk_stage.py) and printed into lines; this module keeps
what every class shares: the loads, the sanitizing
of non-finite keys, the cumulative log decay and its resets, the stabilizer, the combine, the
stores."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from .. import classes
from ..derive import plan as P
from ..derive.plan import Plan
from ..derive.stabilize import M_EMPTY
from ..dsl import ir
from .recurrent import I2, input_row, numel
from .chunk_stage import ChunkStage
from .recurrent_ir import base_env
from .triton_expr import Emitter, canon, expand

UNIT = "_1"


def _axes(st: P.StatePlan, order) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kd = canon(order, st.key_dims) or (UNIT,)
    vd = canon(order, st.value_dims) or (UNIT,)
    return kd, vd


class IntraSlot(NamedTuple):
    """A staged intra-chunk matrix's place: p_intra holds `count` [C, C] matrices per chunk,
    row-major per token row ([rows, H, count, C]); this one is `index`."""
    index: int
    count: int


def _block(dims) -> str:
    return " * ".join(f"_BLOCK_{d}" for d in dims)


class ChunkCode:
    """Builds the hook texts of the chunked forward's kernels (chunk_ir.forward_kernel places
    them in its IR) for one plan: the generic parts here,
    each state's class stages from its unit (mixc/classes: its chunk_* hooks)."""

    indent = I2                 # the chunk loop's body

    def __init__(self, plan: Plan, kernel_stage: str = "fused", reads_staged: bool = False):
        self.plan = plan
        # the kernel this renders (module.py: one kernel per stage; forward: fused, walk,
        # output, refill, intra; backward: fused, walk, tiles): its code only, chosen here
        self.kernel_stage = kernel_stage
        # the walk's and output kernel's staged variant: it reads the intra kernel's matrices
        # where the other variant computes them (codegen/chunk_kernels.py)
        self.reads_staged = reads_staged
        self.m = plan.ir
        self.dims = self.m.dim_names
        self.order = ("_T",) + self.dims + (UNIT,)
        self.n = 0
        self.stab = plan.stabilizer
        self.states = tuple(self._stabilized(st) for st in plan.states)
        self.extra: dict[str, dict[str, str]] = {}      # state -> its class's own matrices (rank-1: L, R)
        self.row_vectors: set[str] = set()               # of those, the [C] vectors (row_vector)
        self.g_axes: dict[str, tuple[str, ...] | None] = {}      # state -> its log decay's axes
        self.tile = plan.layout.tile
        # the forward stages its intra-chunk matrices (the intra kernel -> the output kernel: hooks sets it; the
        # backward, which reuses forward_body, computes them): intra_slot hands out their places
        self.staged = False
        self.n_intra = 0
        # the backward tests values apart from keys (_badv_<S>) in its tiles kernel, whose tile loop
        # is split (codegen/tile_split.py): a key zeroed by one block's values would differ
        # between the blocks that the statements after the loop read once (ChunkBackward)
        self.values_apart = False
        self.badv: set[str] = set()          # the states given a _badv_<S>

    def _stabilized(self, st: P.StatePlan) -> P.StatePlan:
        """A state of the stabilizer's group as the kernels see it: its key and value without
        the gate, and a scalar decay (a prefix sum's log decay is 0)."""
        if self.stab is None or st.name not in self.stab.states:
            return st
        key, value = self.stab.key_value(st.name)
        pieces = replace(st.ir_pieces, key=key, value=value, log_decay=self.stab.log_decay)
        return replace(st, transition=classes.STABILIZED_CLASS, ir_pieces=pieces)

    def builder(self, st: P.StatePlan) -> ChunkStage:
        """A builder for one class stage of a state, in kernel IR (codegen/chunk_stage.py)."""
        return ChunkStage(self, st)

    def intra_slot(self) -> IntraSlot | None:
        """The place of the next staged intra-chunk matrix in p_intra's rows (index of count);
        None where the kernel computes it (the backward, or a class that does not stage)."""
        if not self.staged:
            return None
        self.n_intra += 1
        return IntraSlot(self.n_intra - 1, self.plan.layout.intra_matrices)

    def state(self, name: str) -> P.StatePlan:
        return next(s for s in self.states if s.name == name)

    def stabilized(self, st: P.StatePlan) -> bool:
        return self.stab is not None and st.name in self.stab.states

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"_{stem}{self.n}"

    # ---- flat matrix axes over several dims, in the declared layout of a state ----
    def flat_axis(self, name: str, dims: tuple[str, ...], decl: tuple[str, ...], indent: str,
                  tile_block: str = "tl.program_id(1)") -> list[str]:
        """_f<name> over the product of dims' blocks; its offset in a state laid out as `decl`
        and its mask. tile_block: the block of the tile dim (this program's, or the backward's
        tile loop variable)."""
        lines = [f"{indent}_f{name} = tl.arange(0, {_block(dims)})"]
        offs, masks = [], []
        for i, d in enumerate(dims):
            inner = " * ".join(f"_BLOCK_{x}" for x in dims[i + 1:])
            idx = f"(_f{name} // ({inner}))" if inner else f"_f{name}"
            idx = f"({idx} % _BLOCK_{d})" if i else idx
            if d == self.tile:         # this program's block of the tile dim (grid axis 1)
                idx = f"({tile_block} * _BLOCK_{d} + {idx})"
            # named by the dim's position, not its name: `_ik_S_K_V` could be state S_K's dim V
            # or state S's dim K_V; `_ik_S_K_1` is only ever state S_K's second dim
            index = f"_i{name}_{i}"
            lines.append(f"{indent}{index} = {idx}    # {d}")
            if d == UNIT:
                masks.append(f"({index} < 1)")
                continue
            stride = " * ".join(f"_size_{x}" for x in decl[decl.index(d) + 1:])
            offs.append(index + (f" * {stride}" if stride else ""))
            masks.append(f"({index} < _size_{d})")
        lines.append(f"{indent}_o{name} = {' + '.join(offs) or '0 * _f' + name}")
        lines.append(f"{indent}_m{name} = {' & '.join(masks)}")
        return lines

    def state_io(self, st: P.StatePlan, indent: str) -> list[str]:
        kd, vd = _axes(st, self.order)
        decl = self.m.state(st.name).shape
        return self.flat_axis(f"k_{st.name}", kd, decl, indent) + self.flat_axis(f"v_{st.name}", vd, decl, indent)

    def tile_io(self, st: P.StatePlan, indent: str, tile_block: str) -> list[str]:
        """state_io's lines again for the state's axis that holds the tile dim, at `tile_block`
        (none where the state lacks the tile dim)."""
        kd, vd = _axes(st, self.order)
        decl = self.m.state(st.name).shape
        return [line for name, dims in ((f"k_{st.name}", kd), (f"v_{st.name}", vd)) if self.tile in dims
                for line in self.flat_axis(name, dims, decl, indent, tile_block)]

    def state_ptr(self, st: P.StatePlan, ptr: str, base: str) -> tuple[str, str]:
        n = st.name
        decl = self.m.state(n).shape
        return (f"{ptr} + {base} * {numel(decl)} + _ok_{n}[:, None] + _ov_{n}[None, :]",
                f"_mk_{n}[:, None] & _mv_{n}[None, :]")

    # ---- per-token values of a chunk as matrices ----
    def row_vector(self, em: Emitter, value: tuple[str, tuple[str, ...]]) -> str:
        """A [C] vector of a per-token scalar (padded rows zeroed)."""
        var, dims = value
        row, _ = em.emit(f"tl.where(_mask__T, {expand(var, dims, ('_T',))} + tl.zeros([_BLOCK__T], "
                         "dtype=tl.float32), 0.0)", ("_T",))
        self.row_vectors.add(row)
        return row

    def matrix(self, em: Emitter, value: tuple[str, tuple[str, ...]], axes: tuple[str, ...]) -> str:
        """A [C, prod(axes)] block of a per-token value (broadcast, padded lanes zeroed)."""
        var, dims = value
        want = ("_T",) + tuple(axes)
        full = f"({expand(var, dims, want)} + tl.zeros([_BLOCK__T, {', '.join(f'_BLOCK_{d}' for d in axes)}], "\
               f"dtype=tl.float32))"
        masked, _ = em.emit(f"tl.where({em.mask(want)}, {full}, 0.0)", want)
        if len(axes) == 1:
            return masked
        flat, _ = em.emit(f"tl.reshape({masked}, [_BLOCK__T, {_block(axes)}])", ("_T", "_flat"))
        return flat

    def forward_body(self, advance_first: bool = False) -> dict:
        """The per-chunk forward code (inputs, lets, keys, values, log decays, readouts, the
        output's value) and the names of everything the backward needs again."""
        m, order = self.m, self.order
        env = base_env(self.plan)
        # params are per head: no token axis
        loads = []
        for d in m.inputs:
            cd = canon(order, d.shape)
            offs = self._offsets(d.shape)
            mask = " & ".join([expand("_mask__T", ("_T",), ("_T",) + cd)]
                              + [expand(f"_mask_{x}", (x,), ("_T",) + cd) for x in cd])
            rows = expand("_rows", ("_T",), ("_T",) + cd)
            loads.append(f"{I2}v_{d.name} = tl.load(p_{d.name} + {input_row(d.name, rows)} * {numel(d.shape)}"
                         f"{' + ' + offs if offs else ''}, mask={mask}, other=0.0).to(tl.float32)")
            env[d.name] = (f"v_{d.name}", ("_T",) + cd)
        em = Emitter(m, env, indent=I2, prefix="_c", order=order)
        for let in m.lets:
            env[let.name] = em(let.expr)
            em.env[let.name] = env[let.name]
        body = list(em.lines)
        mark = len(em.lines)
        per_state = {}
        for st in self.states:
            pieces = st.ir_pieces
            kd, vd = _axes(st, order)
            K = V = None            # the rank-r class's B_t, m outer products: its unit's (chunk_inputs)
            if pieces.key is not None:
                K = self.matrix(em, em(pieces.key), kd)
                V = self.matrix(em, em(pieces.value) if pieces.value is not None else ("1.0", ()), vd)
            g = None
            unit = classes.unit(st.transition)
            self.extra[st.name] = unit.chunk_inputs(self, st, em, kd)
            g_axes = self.g_axes[st.name] = unit.decay_axes(st, kd, vd)
            if g_axes is not None:                # the log decay: [C] or [C, key or value axes]
                gv = em(pieces.log_decay)
                if not g_axes:
                    g = self.row_vector(em, gv)
                else:
                    g = self.matrix(em, gv, g_axes)
            per_state[st.name] = (K, V, g, kd, vd)
        body += em.lines[mark:]
        mark = len(em.lines)
        for st in self.states:
            body += self.sanitize(st, per_state)

        # cumulative log decays
        for st in self.states:
            K, V, g, kd, vd = per_state[st.name]
            if g is not None:
                body += self.cumulative_decay(st, g)
        if self.stab is not None:
            body += self.stabilizer_rows(em)
            mark = len(em.lines)
        for st in self.states:      # what the class's readouts and update share (rank-1: U)
            body += self.stage(st, "setup", classes.unit(st.transition).chunk_setup(self, st, per_state[st.name]))
        if advance_first:
            body += self.advances(per_state)

        # readouts: per term the query matrix, the scale and the unscaled value
        out_env = dict(env)
        readouts = []
        for r in self.plan.output.readouts:
            st = self.state(r.state)
            K, V, g, kd, vd = per_state[st.name]
            total, terms = None, []
            for t in r.terms_ir:
                Q = self.matrix(em, em(t.proj) if t.proj is not None else ("1.0", ()), kd)
                body += em.lines[mark:]
                mark = len(em.lines)
                core = self.fresh("r")
                body += self.readout(st, core, Q, K, V, r.prev)
                R, sc = core, None
                if t.scale is not None:
                    sc = self.matrix(em, em(t.scale), vd)
                    body += em.lines[mark:]
                    mark = len(em.lines)
                    R = self.fresh("r")
                    body.append(f"{I2}{R} = {core} * {sc}")
                terms.append((t, Q, sc, core))
                total = R if total is None else self._add(body, total, R)
            if len(vd) > 1:         # value dims flattened into one matrix axis: unflatten
                v = self.fresh("r")
                body.append(f"{I2}{v} = tl.reshape({total}, [_BLOCK__T, {', '.join(f'_BLOCK_{d}' for d in vd)}])")
                out_env[r.name] = (v, ("_T",) + vd)
            elif st.value_dims:
                out_env[r.name] = (total, ("_T",) + vd)
            else:
                v = self.fresh("r")
                body.append(f"{I2}{v} = tl.sum(tl.where(_mask__1[None, :], {total}, 0.0), axis=1)")
                out_env[r.name] = (v, ("_T",))
            readouts.append((r, st, terms))
            # the output rows at or after a token whose key-side values are not finite (hooks)
            seen = f"tl.cumsum(_bad_{st.name}, axis=0){f' - _bad_{st.name}' if r.prev else ''} > 0"
            body.append(f"{I2}_pz = {seen}" if len(readouts) == 1 else f"{I2}_pz = _pz | ({seen})")
        combine = self.plan.output.combine_ir
        if self.stab is not None:       # readouts of S~: the combine rewritten over them and m
            out_env["_m"] = ("_mrow", ("_T",))
            out_env["_mp"] = ("_mprow", ("_T",))        # prev(S~)'s scale m_{t-1} (stabilizer_rows)
            combine = self.stab.combine_ir
        oem = Emitter(m, out_env, indent=I2, prefix="_co", order=order)
        o_val = oem(combine)
        body += oem.lines
        return {"loads": loads, "body": body, "em": em, "per_state": per_state, "readouts": readouts,
                "oem": oem, "o": o_val, "env": env}

    def hooks(self) -> dict:
        """The chunk's body as text (inputs' lets, the class stages, the output's store): the
        one hook chunk_ir.forward_kernel places in its chunk loop."""
        m, order = self.m, self.order
        self.staged = self.plan.layout.intra_matrices > 0
        fb = self.forward_body(advance_first=True)
        if self.n_intra != self.plan.layout.intra_matrices:
            raise AssertionError(f"staged {self.n_intra} intra-chunk matrices, the layout counts "
                                 f"{self.plan.layout.intra_matrices}")
        body, per_state = fb["body"], fb["per_state"]
        o_var, o_dims = fb["o"]
        o_shape = canon(order, m.output.expr.shape)
        want = ("_T",) + o_shape
        offs = self._offsets(m.output.expr.shape, canonical=True)
        mask = " & ".join([expand("_mask__T", ("_T",), want)] + [expand(f"_mask_{x}", (x,), want) for x in o_shape])
        rows = expand("_rows", ("_T",), want)
        value = expand(o_var, o_dims, want)
        if set(o_dims) != set(want):          # a value constant over tokens or dims: broadcast it
            value = f"({value} + tl.zeros([{', '.join(f'_BLOCK_{d}' for d in want)}], dtype=tl.float32))"
        if self.plan.output.readouts:       # NaN from the first token with non-finite keys on
            value = f"tl.where({expand('_pz', ('_T',), want)}, float('nan'), {value})"
        if self.kernel_stage in ("fused", "output"):
            body.append(f"{I2}tl.store(p_out + ({rows} * H + i_h) * {numel(m.output.expr.shape)}"
                    f"{' + ' + offs if offs else ''}, {value}.to(p_out.dtype.element_ty), mask={mask})")

        # the states at the chunk's end (forward_body computed them before the readouts)
        for st in self.states:
            body.append(f"{I2}s_{st.name} = _snew_{st.name}")
        if self.stab is not None:
            body.append(f"{I2}s__m = _mnew")

        # the kernel's scaffolding (programs, lanes, params, the states' loads and stores, the
        # checkpoints, the inputs' loads, the chunk loop) is kernel IR: chunk_ir.forward_kernel
        return {"chunk_body": "\n".join(body)}

    def sanitize(self, st: P.StatePlan, per_state: dict) -> list[str]:
        """_bad_<S> [C]: nonzero at the tokens whose key-side values (key, value, the rank-1
        vectors) hold an inf or a NaN (the count of such entries); those rows are zeroed before any matmul (a 0/1 mask after a
        matmul is too late: 0 * inf is NaN in every row the matmul mixes them into, earlier
        tokens included). The readouts from such a token on are NaN (hooks: the store), the
        state after its chunk too, as the recurrence would give."""
        K, V, g, kd, vd = per_state[st.name]
        n, I = st.name, I2
        parts = [(role, x) for role, x in [("K", K), ("V", V)] + list(self.extra[n].items()) if x is not None]
        # counts, not 0/1: a count sums over the key dim's blocks (codegen/key_split.py)
        checks = [f"tl.where(tl.abs({x}) < float('inf'), 0.0, 1.0)" if x in self.row_vectors else
                  f"tl.sum(tl.where(tl.abs({x}) < float('inf'), 0.0, 1.0), axis=1)" for _, x in parts]
        if g is not None:
            # a NaN or +inf log decay (-inf is a reset) makes its token bad as a key does, and is
            # 0 in b: its NaN in b_C or a reference row reached the earlier rows (issue 30)
            checks.append(f"tl.where({g} < float('inf'), 0.0, 1.0)" if g in self.row_vectors else
                          f"tl.sum(tl.where({g} < float('inf'), 0.0, 1.0), axis=1)")
            parts = parts + [("V" if set(self.g_axes[n]) & set(vd) else "G", g)]
        if self.staged and any(role == "V" for role, _ in parts) and len(parts) > 1:
            # the intra kernel (the intra-chunk matrices of every tile block at once) zeroes the
            # keys that are not finite only: one tile block's values must not zero another's
            # keys (mixc/classes/key_diag.py _staged_pairs)
            keys = [c for c, (role, _) in zip(checks, parts) if role != "V"]
            values = [c for c, (role, _) in zip(checks, parts) if role == "V"]
            lines = [f"{I}_bad_{n} = {' + '.join(keys)}"]
            if self.kernel_stage != "intra":
                lines.append(f"{I}_bad_{n} = _bad_{n} + {' + '.join(values)}")
        elif self.values_apart and self._value_side(parts, vd) and len(parts) > 1:
            # the backward's tiles kernel: keys zeroed by their own entries only, the block's
            # values by both (a value's gradient is zeroed alike: ChunkBackward); the walks
            # zero keys by the block's values too, as the forward does
            keys = [c for c, (role, _) in zip(checks, parts) if role != "V"]
            values = [c for c, (role, _) in zip(checks, parts) if role == "V"]
            lines = [f"{I}_bad_{n} = {' + '.join(keys)}",
                     f"{I}_badv_{n} = _bad_{n} + {' + '.join(values)}"]
            if self.kernel_stage != "tiles":
                lines.append(f"{I}_bad_{n} = _badv_{n}")
            self.badv.add(n)
        else:
            lines = [f"{I}_bad_{n} = {' + '.join(checks)}"]
        clean = {}
        if g is not None:
            parts.pop()
            lines.append(f"{I}_gc_{n} = tl.where({g} < float('inf'), {g}, 0.0)")
            g = f"_gc_{n}"
        for role, x in parts:
            clean[role] = f"_{role}c_{n}"
            bad = f"_badv_{n}" if role == "V" and n in self.badv else f"_bad_{n}"
            rows = "" if x in self.row_vectors else "[:, None]"
            lines.append(f"{I}{clean[role]} = tl.where({bad}{rows} > 0, 0.0, {x})")
        per_state[n] = (clean.get("K"), clean.get("V"), g, kd, vd)
        self.extra[n] = {role: clean[role] for role in self.extra[n]}
        return lines

    def _value_side(self, parts, vd) -> bool:
        """Whether the state has values and they carry the tile dim (the blocks of a split loop)."""
        return self.tile is not None and self.tile in vd and any(role == "V" for role, _ in parts)

    def cumulative_decay(self, st: P.StatePlan, g: str) -> list[str]:
        """_b_<S>: the cumulative log decay in the chunk, with a log decay of -inf (a decay of 0:
        a state reset) counted apart in _z_<S> (resets at or before each token) and taken as 0
        in b: b_i - b_j would be -inf - -inf = NaN, and a finite floor in its place would cost
        b its precision. A pair (i, j) spans a reset where z_i > z_j (pair_ok masks it out);
        the weights from the chunk's start (_b0_<S>, _bl0_<S>) and into S_C (_kw_<S>) likewise.
        b and z at the chunk's last token are read off b and z themselves: a separate sum would
        round differently, and exp(b_C - b_last) must be exactly 1.

        A scalar decay's b is also kept as a compensated sum (compensated, below)."""
        n, k = st.name, self.builder(st)
        ax = k.decay_axes()
        g, last = k.block(g, "i", *ax), k.offs.eq(k.n_valid - 1)
        r = k.let(f"_r_{n}", g.eq(-k.INF), "i", *ax)
        z = f"_z_{n}"
        if self.compensated(st):
            g0 = k.let(f"_g_{n}", k.where(r, 0.0, g), "i", *ax)
            # g on a grid of 2**-10: hi's sums are exact
            gh = k.let(f"_gh_{n}", (g0 + 16384.0) - 16384.0, "i", *ax)
            bh = k.let(f"_bh_{n}", k.cumsum(gh, "i"), "i", *ax)
            bc = k.let(f"_bc_{n}", k.cumsum(g0 - gh, "i"), "i", *ax)
            b = k.let(f"_b_{n}", bh + bc, "i", *ax)
            z = k.let(z, k.cumsum(k.where(r, 1.0, 0.0), "i"), "i", *ax)
            bl = k.let(f"_bl_{n}", k.sum(k.where(last, bh, 0.0), "i"), *ax)
            blc = k.let(f"_blc_{n}", k.sum(k.where(last, bc, 0.0), "i"), *ax)
            zl = k.let(f"_zl_{n}", k.sum(k.where(last, z, 0.0), "i"), *ax)
            k.let(f"_b0_{n}", k.where(z > 0, -k.INF, b), "i", *ax)
            k.let(f"_bl0_{n}", k.where(zl > 0, -k.INF, bl + blc), *ax)
            k.let(f"_kw_{n}", k.where(z < zl, -k.INF, (bl - bh) + (blc - bc)), "i", *ax)
            return k.lines()
        b = k.let(f"_b_{n}", k.cumsum(k.where(r, 0.0, g), "i"), "i", *ax)
        z = k.let(z, k.cumsum(k.where(r, 1.0, 0.0), "i"), "i", *ax)
        bl = k.let(f"_bl_{n}", k.sum(k.where(last, b, 0.0), "i"), *ax)
        zl = k.let(f"_zl_{n}", k.sum(k.where(last, z, 0.0), "i"), *ax)
        k.let(f"_b0_{n}", k.where(z > 0, -k.INF, b), "i", *ax)
        k.let(f"_bl0_{n}", k.where(zl > 0, -k.INF, bl), *ax)
        k.let(f"_kw_{n}", k.where(z < zl, -k.INF, bl - b), "i", *ax)
        return k.lines()

    def compensated(self, st: P.StatePlan) -> bool:
        """Whether b is kept as hi + lo (_bh_<S> + _bc_<S>) for its pair differences (a scalar
        decay, not stabilized). In fp32 a cumulative sum b near -1280 (64 tokens at -20) has a
        grid of 1.2e-4: exp(b_i - b_j) of neighbours, the pairs that make dg at strong decay,
        would be off by that much. hi sums g rounded to a grid of 2^-10 ((g + 2^14) - 2^14,
        exact while |g| < 2^13), so every partial sum is exact whatever order tl.cumsum adds
        in, while |b| < 2^14 (C = 128 at a log decay of -88, past which exp(g) is 0 in fp32);
        lo sums the remainders g - gh (exact, each below 2^-11), whose rounding is relative to
        lo's own size. A pair's log weight is then (hi_i - hi_j) + (lo_i - lo_j): exact hi
        differences, rounded once. This relies on the compiler keeping (g + 2^14) - 2^14 as two
        rounded adds (Triton sets no reassociation flag on fadd; the PTX keeps both): were it
        folded to g, lo would be 0 and hi the plain sum, as precise as before, no worse."""
        return classes.unit(st.transition).compensated_sum and not self.stabilized(st)

    def _offsets(self, decl: tuple[str, ...], canonical: bool = False) -> str:
        """Offsets of a per-token block [C, *canonical dims] laid out in `decl` order."""
        order = self.order
        layout = canon(order, decl) if canonical else decl
        cd = ("_T",) + canon(order, decl)
        terms = []
        for i, d in enumerate(layout):
            stride = " * ".join(f"_size_{x}" for x in layout[i + 1:])
            term = expand(f"_offs_{d}", (d,), cd)
            terms.append(f"{term} * {stride}" if stride else term)
        return " + ".join(terms)

    def _add(self, body, a, b) -> str:
        v = self.fresh("r")
        body.append(f"{I2}{v} = {a} + {b}")
        return v

    def query_decay(self, st: P.StatePlan, prev: bool) -> tuple[list[str], str]:
        """(lines, name) of the cumulative log decay at each query row: b itself, or for a
        readout of S_{t-1} b_{i-1}: b shifted by one row, selected exactly (b_i - g_i would
        round, and exp(b_{i-1} - b_{i-1}) weighs the newest token of the state). The lines
        also give the query rows' resets and weight from the chunk's start (query_z,
        query_b0)."""
        n = st.name
        if not prev:
            return [], f"_b_{n}"
        if self.compensated(st):      # hi and lo shifted apart (_bph, _bpc: scalar_logs' pairs)
            return [self.shifted(st, f"_bh_{n}", "_bph"), self.shifted(st, f"_bc_{n}", "_bpc"),
                    f"{I2}_bp = _bph + _bpc", self.shifted(st, f"_z_{n}", "_zp"),
                    f"{I2}_bp0 = tl.where(_zp > 0, float('-inf'), _bp)"], "_bp"
        return [self.shifted(st, f"_b_{n}", "_bp"), self.shifted(st, f"_z_{n}", "_zp"),
                f"{I2}_bp0 = tl.where(_zp > 0, float('-inf'), _bp)"], "_bp"

    def shifted(self, st: P.StatePlan, x: str, name: str) -> str:
        """The line name = x one row down (x_{i-1}; 0 in row 0), x [C] or [C, the decay's axes]."""
        k = self.builder(st)
        ax = k.decay_axes()
        k.let(name, k.sum(k.where((k.row_i - 1).eq(k.key_j), k.at_keys(k.block(x, "i", *ax)), 0.0), "j"), "i", *ax)
        (line,) = k.lines()
        return line

    def query_z(self, st: P.StatePlan, prev: bool) -> str:
        return "_zp" if prev else f"_z_{st.name}"

    def query_b0(self, st: P.StatePlan, prev: bool) -> str:
        return "_bp0" if prev else f"_b0_{st.name}"

    def grad_names(self, G: dict, stem: str, with_db: bool) -> tuple[str, ...]:
        """Fresh names for one term's dK, dV, dS0 (and db), registered in the state's lists."""
        t = self.fresh(stem)
        names = {"dK": f"_dK{t}", "dV": f"_dV{t}", "dS0": f"_dS0{t}"} | ({"db": f"_db{t}"} if with_db else {})
        for k, v in names.items():
            G[k].append(v)
        return tuple(names.values())

    # ---- the stabilizer (derive/stabilize.py) in a chunk ----
    def stabilizer_rows(self, em: Emitter) -> list[str]:
        """_gi: the gate's exponent per token; _mrow: m at each token, the largest log weight
        of its readout; _mnew: m at the chunk's end. _M0: m at the chunk's start. _mprow (where
        a readout of the group reads prev(S~)): m_{t-1}, _mrow a row down, _M0 in row 0."""
        n = self.stab.states[0]                  # the group shares its decay, so b
        st = self.state(n)
        prev = any(r.prev and r.state in self.stab.states for r in self.plan.output.readouts)
        start = len(em.lines)
        gv = em(self.stab.log_gate)
        causal = f"(_offs__T[:, None] >= _offs__T[None, :]) & _mask__T[None, :] & (_z_{n}[:, None] == _z_{n}[None, :])"
        gbad = [f"{I2}_bad_{x} = _bad_{x} + tl.where(tl.abs(_gi) < float('inf'), 0.0, 1.0)" for x in self.stab.states]
        return em.lines[start:] + [
            f"{I2}_gi = tl.where(_mask__T, {expand(gv[0], gv[1], ('_T',))} + tl.zeros([_BLOCK__T], dtype=tl.float32), "
            "0.0)"] + gbad + [f"{I2}_gi = tl.where(tl.abs(_gi) < float('inf'), _gi, 0.0)",
            f"{I2}_M0 = s__m",
            # padded rows get m = 0: their readouts are 0, and the combine must not divide 0 by 0
            f"{I2}_mrow = tl.where(_mask__T, tl.maximum(tl.max(tl.where({causal}, _b_{n}[:, None] - _b_{n}[None, :] "
            f"+ _gi[None, :], float('-inf')), axis=1), _b0_{n} + _M0), 0.0)",
            f"{I2}_mnew = tl.maximum(_bl0_{n} + _M0, tl.max(tl.where(_mask__T, _kw_{n} + _gi, float('-inf')), "
            "axis=0))",
        ] + ([self.shifted(st, "_mrow", "_mprow"),       # padded rows: an empty state's m (their
              # prev readouts are 0, so the output's other terms set the scale: no 0 / 0)
              f"{I2}_mprow = tl.where(_mask__T, tl.where(_offs__T == 0, _M0, _mprow), {M_EMPTY})"] if prev else [])

    def scalar_logs(self, st: P.StatePlan, prev: bool) -> tuple[list[str], str | tuple, str | tuple, str]:
        """(lines, bq, bk, b0) of a scalar-decay readout: the query rows' and the key columns'
        log weights of the intra-chunk term, exp(bq_i - bk_j), and the query rows' log weight
        of the inter-chunk term S0 (stabilized: m subtracted per row, the gate on the keys).
        bq and bk are names, or (hi, lo) pairs of names where b is compensated (the scalar
        decay's pair_logs forms (hi_i - hi_j) + (lo_i - lo_j): mixc/classes/scalar.py)."""
        pre, bq = self.query_decay(st, prev)
        b0 = self.query_b0(st, prev)
        if self.compensated(st):
            n = st.name
            return pre, ("_bph", "_bpc") if prev else (f"_bh_{n}", f"_bc_{n}"), (f"_bh_{n}", f"_bc_{n}"), b0
        if not self.stabilized(st):
            return pre, bq, f"_b_{st.name}", b0
        # padded query rows weigh nothing (their m is 0, so exp(b - m) could overflow there); a
        # readout of S~_{t-1} is relative to m_{t-1}, its own scale (derive/stabilize.py)
        m = "_mprow" if prev else "_mrow"
        return pre + [f"{I2}_bq = tl.where(_mask__T, {bq} - {m}, float('-inf'))", f"{I2}_bk = _b_{st.name} - _gi",
                      f"{I2}_b0 = tl.where(_mask__T, {b0} + _M0 - {m}, float('-inf'))"], "_bq", "_bk", "_b0"

    def readout(self, st: P.StatePlan, R: str, Q: str, K: str, V: str, prev: bool) -> list[str]:
        """R = the readout of S_t (or S_{t-1}) for the C query rows Q: the class's stage."""
        return self.stage(st, "readout", classes.unit(st.transition).chunk_readout(self, st, R, Q, K, V, prev))

    def advances(self, per_state: dict) -> list[str]:
        """Every state's advance into _snew_<S> (S_C, NaN after a non-finite key), s_<S> left
        at S0 for the readouts. Emitted before the readouts: the keys and S0 die there, not
        after the output (where the output kernel walks several chunks, readouts then advance held Q, K,
        S0 and the readout's products at once: sm_90 spilled 28-460 B; this order 0-148 B:
        bench/README.md)."""
        body = []
        for st in self.states:
            n = st.name
            body.append(f"{I2}_s0_{n} = s_{n}")
            advance = self.advance(st, per_state[n]) + [
                f"{I2}_snew_{n} = tl.where(tl.max(_bad_{n}, axis=0) > 0, float('nan'), s_{n})"]
            if self.kernel_stage == "intra":     # no state (a loop-carried advance is not compiled away)
                advance = [f"{I2}_snew_{n} = s_{n}"]
            body += advance
            body.append(f"{I2}s_{n} = _s0_{n}")
        return body

    def advance(self, st: P.StatePlan, parts) -> list[str]:
        """s_<S> = S_C, the state at the chunk's end: the class's stage."""
        return self.stage(st, "advance", classes.unit(st.transition).chunk_advance(self, st, parts))

    def stage(self, st: P.StatePlan, name: str, lines: list[str]) -> list[str]:
        """A class stage's lines under a comment naming the state, its class, the stage and the
        file of its stages (whose docstrings or template header give the notation)."""
        if not lines:
            return lines
        unit = classes.unit(st.transition)
        stab = " (stabilized)" if self.stabilized(st) else ""
        return [f"{I2}# {st.name}: {unit.name}{stab}, {name} (mixc/classes/{unit.stages_file})"] + lines


def g_is_vector(st: P.StatePlan) -> bool:
    """A scalar decay's per-token log decay is a [C] vector; the diagonal ones are [C, dim]."""
    return classes.unit(st.transition).decay_is_vector(st)


def chunk_fwd_hooks(plan: Plan, kernel_stage: str, reads_staged: bool = False) -> dict:
    """The texts of one stage's forward kernel that chunk_ir.forward_kernel places (reads_staged:
    its variant that reads the staged intra-chunk matrices)."""
    return ChunkCode(plan, kernel_stage, reads_staged).hooks()

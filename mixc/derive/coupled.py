"""Coupled states: updates that read other states, as one block-affine system.

The checker writes a state's new value out where a later update reads it (dsl/check.py
read_in_update), so in the IR every update reads the previous values of the states: the
token's transition is S_t = F(S_{t-1}, x_t) over all states at once. States whose updates read
one another (directly or through a chain) form a system; when F is linear in all of its
states, the stacked state (X_1, ..., X_n) follows

    X_i,t = sum_j A_ij,t(X_j,t-1) + B_i,t

with n x n blocks A_ij: each a diagonal part (a scale, over some of X_j's dims) and projection
terms left * (right @ X_j), read off the update as for one state (affine.py). Titans'
memory with momentum is a 2x2 system, its diagonal parts scalar per head, with a rank-1
projection over K in the blocks that read the memory.

The recurrent and step forms run any such system (they evaluate the updates as written, one
token at a time, and their backward is the adjoint of the same code). A 2x2 system with
triangular scalar gates and one rank-1 read (Titans') also has the torch backend's chunked
form: system_chunk.py says which, classes/block_affine.py runs it; no chunked Triton kernels
are generated for a system."""
from __future__ import annotations

from dataclasses import dataclass

from ..dsl import ir
from ..dsl.errors import SpecError
from . import affine


@dataclass(frozen=True)
class Block:
    """A_ij of a system: how the update of `of` reads the previous value of `wrt`: its
    diagonal part (None: none) and its projection terms, on the IR."""

    of: str
    wrt: str
    diagonal: ir.Expr | None
    projections: tuple[affine.LinTerm, ...]
    # the same as sympy expressions (the plan's symbols): the diagonal (0 where none) and each
    # projection's (left, right, over)
    diagonal_sym: object = 0
    projections_sym: tuple = ()

    def kind(self) -> str:
        """'scalar', 'diagonal over K', 'rank-1 over K', 'scalar + rank-1 over K', ..."""
        parts = []
        if self.diagonal is not None:
            parts.append("diagonal over " + ", ".join(self.diagonal.shape) if self.diagonal.shape else "scalar")
        if self.projections:
            over = sorted({d for t in self.projections for d in t.over})
            parts.append(f"rank-{len(self.projections)} over {', '.join(over)}")
        return " + ".join(parts)


@dataclass(frozen=True)
class System:
    """States whose updates read one another, and the blocks of its transition (those not 0)."""

    states: tuple[str, ...]
    blocks: tuple[Block, ...]
    # the chunked form's pieces (derive/system_chunk.py SystemChunk), or why it has none
    chunk: object = None
    chunk_unsupported: str | None = None

    def block(self, of: str, wrt: str) -> Block | None:
        return next((b for b in self.blocks if b.of == of and b.wrt == wrt), None)

    def describe(self) -> str:
        """'mom, mem: a 2x2 block-affine system, scalar per head, with rank-1 projections over K'."""
        n = len(self.states)
        diag = [b.diagonal for b in self.blocks if b.diagonal is not None]
        dims = sorted({d for e in diag for d in e.shape})
        per = "scalar per head" if not dims else f"diagonal per head over {', '.join(dims)}"
        proj = [b for b in self.blocks if b.projections]
        ranks = sorted({len(b.projections) for b in proj})
        over = sorted({d for b in proj for t in b.projections for d in t.over})
        tail = (f", with rank-{'/'.join(map(str, ranks))} projections over {', '.join(over)}" if proj else "")
        return f"{', '.join(self.states)}: a {n}x{n} block-affine system, {per}{tail}"


def _reads(upd: ir.Update) -> set[str]:
    """The other states an update reads (all of them previous values in the IR)."""
    return {n for n in ir.refs(upd.expr, "state") if n != upd.state}


def systems(spec: ir.MixerIR) -> tuple[tuple[str, ...], ...]:
    """The groups of two or more states whose updates read one another (the connected parts of
    'reads'), each in the spec's order of states."""
    group = {s.name: {s.name} for s in spec.states}
    for u in spec.updates:
        for other in _reads(u):
            merged = group[u.state] | group[other]
            for name in merged:
                group[name] = merged
    out, seen = [], set()
    for s in spec.states:
        g = group[s.name]
        if len(g) > 1 and s.name not in seen:
            seen |= g
            out.append(tuple(x.name for x in spec.states if x.name in g))
    return tuple(out)


def check_linear(spec: ir.MixerIR, states: tuple[str, ...]) -> None:
    """Every update of the system is linear in all of its states at once (a product of two of
    them, or a function of one, is refused at its place)."""
    names = set(states)

    def is_state(n):
        return (isinstance(n, ir.Ref) and n.kind == "state" and n.name in names) or \
            (isinstance(n, ir.Prev) and n.state in names)
    for name in states:
        upd = spec.update(name)
        try:
            affine._Affine(spec, is_state, spec.state(name).shape).form(upd.expr)
        except affine.NotAffine as err:
            read = sorted(_reads(upd))
            why = err.message.replace("the state", "a state of the system")      # which one: the quoted text says
            raise SpecError(f"the update of {name} is not linear in the states {', '.join(states)}: {why}",
                            spec.source, err.node.span or upd.expr.span,
                            (f"the update of {name} reads {', '.join(read) if read else 'no other state'}; "
                             "mixc compiles states that read one another when the token's transition is linear "
                             "in all of them (one block-affine system)",)) from None


def system(spec: ir.MixerIR, states: tuple[str, ...], conv, same=None) -> System:
    """The blocks of a system (after check_linear): for each update and each state it reads
    (conv: IR -> sympy, the plan's)."""
    blocks = []
    for of in states:
        upd = spec.update(of)
        for wrt in states:
            if wrt != of and wrt not in _reads(upd):
                continue
            form = affine.merge_projections(affine.affine_in(spec, upd.expr, wrt), same)
            diag = [t for t in form.terms if t.proj is None]
            proj = tuple(t for t in form.terms if t.proj is not None)
            scale = affine.total([t.scale or affine.num(1) for t in diag])
            if scale is not None or proj:
                blocks.append(Block(of, wrt, scale, proj, conv(scale) if scale is not None else 0,
                                    tuple((conv(t.scale or affine.num(1)), conv(t.proj), t.over) for t in proj)))
    return System(states, tuple(blocks))


def input_term(spec: ir.MixerIR, of: str, states: tuple[str, ...]) -> ir.Expr:
    """B_t of a state of a system: its update with every state of the system taken as 0."""
    names = set(states)

    def is_state(n):
        return (isinstance(n, ir.Ref) and n.kind == "state" and n.name in names) or \
            (isinstance(n, ir.Prev) and n.state in names)
    form = affine._Affine(spec, is_state, spec.state(of).shape).form(spec.update(of).expr)
    return form.const if form.const is not None else affine.num(0)

"""Whether a block-affine system (coupled.py) has the chunked form, and its pieces where it has.

The chunked form (docs/design-notes.md, "Coupled states are one block-affine system"; the
torch form in classes/block_affine.py) takes two states X1, X2 of one shape whose transition
per token is

    X_i,t = sum_j D_t[i, j] X_j,t-1 + u_i,t (w_t . X_*,t-1) + sum_m kin_im,t vin_im,t^T

with D_t = [[a, 0], [c, d]] scalars per head (in some order of the two states), a and d
provably >= 0 (their logs are summed per pair of tokens; 0 is a reset), one right w reading
one state X_* through a rank-1 projection over the key dims in every block that reads it (or
no projection at all), and each input term a sum of outer
products key (x) value. Titans' memory with momentum is this shape. Anything else (three
states, a gate over a dim, both off-diagonal parts, a projection reading both states) keeps
the token loop: `chunk_form` says why in the user's names."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..dsl import ir
from . import affine, coupled
from .bounds import lower_bound


@dataclass(frozen=True)
class SystemChunk:
    """The pieces of the chunked form of a 2x2 system, on the IR (printed as torch code by
    codegen/torch_module.py). `states` in the order where D is lower triangular."""

    states: tuple[str, str]
    a: ir.Expr                      # D[0, 0]: the first state's own scale (>= 0)
    c: ir.Expr | None               # D[1, 0]: the second reads the first (None: 0)
    d: ir.Expr                      # D[1, 1]: the second state's own scale (>= 0)
    read: str | None                # X_*: the state the projection reads (None: no projection)
    right: ir.Expr | None           # w over the key dims
    lefts: tuple[ir.Expr | None, ir.Expr | None]            # u_i per state (None: no projection)
    # per state, its input term as outer products (kin, vin), () where it is 0
    inputs: tuple[tuple[tuple[ir.Expr, ir.Expr], ...], tuple[tuple[ir.Expr, ir.Expr], ...]]
    key_dims: tuple[str, ...]
    value_dims: tuple[str, ...]


def chunk_form(spec: ir.MixerIR, system: coupled.System, conv, table, outer_terms,
               readout_keys: dict[str, set[str]]) -> tuple[SystemChunk | None, str | None]:
    """(the pieces, None) where the system has the chunked form, else (None, why). conv: IR ->
    sympy (the plan's); outer_terms(expr, key dims, value dims) -> ((key, value), ...), () where
    a summand does not factor (plan._outer_terms); readout_keys: the dims each state's readouts contract."""
    names = system.states
    if len(names) != 2:
        return None, f"it has {len(names)} states (the chunked form takes two)"
    shapes = {spec.state(n).shape for n in names}
    if len(shapes) != 1:
        return None, "its states have different shapes"
    proj_blocks = [b for b in system.blocks if b.projections]
    reads = {b.wrt for b in proj_blocks}
    read, right = None, None
    if len(reads) > 1:
        return None, "its projections read both states (the chunked form takes one state read through them)"
    if reads:
        (read,) = reads
        if any(len(b.projections) != 1 for b in proj_blocks):
            return None, "a block has more than one projection term (the chunked form takes rank 1)"
        rights = [b.projections[0].proj for b in proj_blocks]
        over = {tuple(sorted(b.projections[0].over)) for b in proj_blocks}
        if len(over) != 1 or any(sp.expand(conv(r) - conv(rights[0])) != 0 for r in rights[1:]):
            return None, "its projections read the state through different vectors"
        right, keys = rights[0], set(next(iter(over)))
    else:                       # no projection: the dims the output contracts are the key dims
        read_keys = {tuple(sorted(readout_keys[n])) for n in names if readout_keys.get(n)}
        if len(read_keys) != 1:
            return None, ("the output reads its states whole or contracting different dims (the chunked form "
                          "contracts the same key dims in every read)")
        keys = set(next(iter(read_keys)))
    key_dims = tuple(d for d in spec.state(names[0]).shape if d in keys)
    value_dims = tuple(d for d in spec.state(names[0]).shape if d not in key_dims)
    for b in proj_blocks:
        t = b.projections[0]
        if not set(t.proj.shape) <= set(key_dims) or (t.scale is not None and not set(t.scale.shape) <= set(key_dims)):
            return None, f"the projection in the update of {b.of} varies over a value dim"
    for n in names:
        if readout_keys.get(n) and set(readout_keys[n]) != set(key_dims):
            return None, f"the output reads {n} contracting other dims than its projection ({', '.join(key_dims)})"
    diag = {(b.of, b.wrt): b.diagonal for b in system.blocks if b.diagonal is not None}
    if any(e.shape for e in diag.values()):
        return None, "a block's diagonal part varies over a dim (the chunked form takes scalars per head)"
    first, second = names
    if (first, second) in diag:
        if (second, first) in diag:
            return None, "each state's update scales the other state (the 2x2 gates are not triangular)"
        first, second = second, first
    a, d = diag.get((first, first)), diag.get((second, second))
    for n, e in ((first, a), (second, d)):
        if e is None or not lower_bound(conv(e), table) >= 0:
            return None, f"the scale of {n} in its own update is not provably >= 0 (its log is summed)"
    lefts = []
    for n in (first, second):
        b = system.block(n, read) if read is not None else None
        t = b.projections[0] if b is not None and b.projections else None
        lefts.append(None if t is None else (t.scale if t.scale is not None else affine.num(1)))
    inputs = []
    for n in (first, second):
        const = coupled.input_term(spec, n, names)
        if isinstance(const, ir.Num) and const.value == 0:
            inputs.append(())
            continue
        pairs = outer_terms(const, key_dims, value_dims)
        if not pairs:
            return None, f"the input term of {n} is not a sum of outer products key (x) value"
        inputs.append(pairs)
    return SystemChunk((first, second), a, diag.get((second, first)), d, read, right, tuple(lefts),
                       tuple(inputs), key_dims, value_dims), None


def kernel_unsupported(plan) -> str | None:
    """Why the chunked Triton kernels of a system (runtime/system_kernels.py) do not serve the
    plan, or None: they take one 2x2 system holding every state in its chunked form, one rank-1
    read, at most one outer product per state's input term and one readout term."""
    if not plan.systems or len(plan.systems) != 1:
        return "not one block-affine system"
    sy = plan.systems[0]
    if sy.chunk is None:
        return f"the block-affine system {', '.join(sy.states)} has no chunked form: {sy.chunk_unsupported}"
    if len(plan.states) != len(sy.states):
        return "the spec has states beside its block-affine system"
    if plan.stabilizer is not None:
        return "the block-affine system has an exponential-gate stabilizer"
    if sy.chunk.read is None:
        return "the system has no projection (the kernels take one rank-1 read)"
    if any(len(pairs) > 1 for pairs in sy.chunk.inputs):
        return "a state's input term is a sum of several outer products (the kernels take one per state)"
    if len(plan.output.readouts) != 1 or len(plan.output.readouts[0].terms_ir) != 1:
        return "the output reads the states in more than one term (the kernels take one readout)"
    return None

"""Which kernels a plan gets and how they are laid out: a fact of the derivation, carried by
the Plan (plan.layout) so that code generation renders from it and the runtime launches from
it without asking the code generator (the generated module's METADATA carries the same).

- chunk_unsupported: why the chunked kernels cannot serve the plan (None: they can);
- torch_chunk_unsupported: why the torch backend has no chunked form (None: it has);
- tile, split: the dims the recurrent kernels split into blocks, one program each (grid axes
  1 and 2; fla's BV and BK blocks);
- chunk_size: the default chunk C of the chunked kernels and of the torch backend's form;
- intra_matrices: how many intra-chunk matrices [C, C] the chunked forward's intra kernel stores for
  its output kernel to read (one per readout term of a class that stages them: classes/<unit>.py
  stages_intra); 0: the output kernel computes every one itself;
- kernel_args: each kernel form's argument list (standalone/kernel_args.py), from which the
  template signature, the launch call and the ahead-of-time signature are made."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl import ir
from .. import classes
from .decay_sign import negative_decay
from ..standalone.kernel_args import KernelArgs, plan_kernel_args

__all__ = ["KernelLayout", "kernel_layout", "chunk_supported", "torch_chunk_supported", "chunk_size", "intra_matrices",
           "tile_dim", "split_dim"]


@dataclass(frozen=True)
class KernelLayout:
    chunk_unsupported: str | None
    torch_chunk_unsupported: str | None
    tile: str | None
    split: str | None
    chunk_size: int
    intra_matrices: int = 0
    # the chunked form may round to bf16/fp16 inputs' dtype its states (checkpoints and dL/dS at
    # chunk ends: half the bytes, as fla stores h: half_states) and its matmuls' operands (tensor
    # cores: half_matmuls) only where the output is linear in the state readouts: a normalized
    # or nonlinear output (aft_simple's num / den, rwkv4, based) divides sums that cancel, and
    # rounding a chunk-end state to bf16 cost aft_simple 0.1 relative error in the output and
    # 0.2-0.3 in the gradients (the 2026-12-04 H200 run and the dry run). A class may keep fp32
    # checkpoints (classes/base.py half_checkpoints: the rank-r class). fp32 matmuls (tf32x3: three
    # TF32 products on tensor cores, fp32's accuracy) where no state has a key dim (aft_simple,
    # rwkv4: their products run over the chunk's tokens only, small); a normalized output over
    # [K, V] states (based, performer, linear_transformer, mlstm) keeps bf16 matmuls: fp32 operands
    # took based's output kernel past sm_90's shared memory (340 KB) and no run showed it needed
    half_states: bool = True
    half_matmuls: bool = True
    kernel_args: dict[str, KernelArgs] = field(default_factory=dict, compare=False)

    @property
    def chunked(self) -> bool:
        """The chunked kernels exist."""
        return self.chunk_unsupported is None

    @property
    def torch_chunked(self) -> bool:
        """The torch backend has its chunked form."""
        return self.torch_chunk_unsupported is None


def kernel_layout(plan) -> KernelLayout:
    """The layout of a recurrence's plan (derive() stores it as plan.layout)."""
    chunked = chunk_supported(plan)
    forms = ("recurrent_fwd", "recurrent_bwd") + (("chunk_fwd", "chunk_bwd") if chunked is None else ())
    return KernelLayout(chunked, torch_chunk_supported(plan), tile_dim(plan.kernel_ir),
                        split_dim(plan), chunk_size(plan), intra_matrices(plan) if chunked is None else 0,
                        plan.output.kind == "linear" and all(classes.unit(st.transition).half_checkpoints
                                                             for st in plan.states),
                        plan.output.kind == "linear" or any(st.key_dims for st in plan.states),
                        plan_kernel_args(plan, forms))


def chunk_supported(plan) -> str | None:
    """Why the chunked kernel cannot serve this plan, or None when it can."""
    for st in plan.states:
        unit = classes.unit(st.transition)
        if unit.parallel_form != "chunk":
            return f"state {st.name} is a {st.transition}"
        if unit.term_axes:              # the rank-r class: B_t as m outer products (StateIR.inputs)
            if st.ir_pieces is None or not st.ir_pieces.inputs:
                return f"the input term of state {st.name} is not a sum of outer products key (x) value"
        elif st.ir_pieces is None or st.ir_pieces.key is None:
            return f"the input term of state {st.name} is not an outer product key (x) value"
    for r in plan.output.readouts:
        st = plan.state(r.state)
        for t in r.terms_ir:
            # in the user's words: which dims each read of the state contracts (a sum over a
            # readout, as layer_norm(C @ S, P) writes, contracts one more than C @ S does)
            keys = ", ".join(st.key_dims)
            if t.proj is not None and set(t.over) != set(st.key_dims):
                return (f"the output reads state {r.state} contracting {', '.join(t.over)} in one place and "
                        f"{keys} in all; the chunked kernels contract the same key dims in every read of a state")
            if t.proj is None and st.key_dims:
                return (f"the output reads state {r.state} whole in one place and contracting {keys} in another; "
                        "the chunked kernels contract the same key dims in every read of a state")
    return scale_outside_values(plan) or negative_decay(plan)        # tanh(g): no real log (decay_sign.py)


def torch_chunk_supported(plan) -> str | None:
    """Why the torch backend has no chunked form for this plan, or None: the kernels' classes,
    the elementwise one (Mamba: exp(b_i - b_j) per element of the state) and the rank-r one
    (DeltaProduct: its B_t a sum of outer products)."""
    if plan.systems:            # a block-affine system: its own chunked form (derive/system_chunk.py)
        return system_chunk_supported(plan)
    if all(classes.unit(st.transition).parallel_form == "chunk" for st in plan.states):
        return chunk_supported(plan)
    for st in plan.states:      # the elementwise and rank-r classes (no kernels: torch only)
        unit = classes.unit(st.transition)
        if not unit.torch_chunked:
            return f"state {st.name} is a {st.transition}"
        if unit.term_axes:              # B_t as m outer products (the plan's StateIR.inputs)
            if st.ir_pieces is None or not st.ir_pieces.inputs:
                return f"the input term of state {st.name} is not a sum of outer products key (x) value"
        elif st.ir_pieces is None or st.ir_pieces.key is None:
            return f"the input term of state {st.name} is not an outer product key (x) value"
    for r in plan.output.readouts:
        for t in r.terms_ir:
            if t.proj is None or set(t.over) != set(plan.state(r.state).key_dims):
                return f"readout {r.name} does not contract the key dims of {r.state}"
    return scale_outside_values(plan) or negative_decay(plan)


def system_chunk_supported(plan) -> str | None:
    """Why the torch backend has no chunked form for a plan with a block-affine system, or None:
    one system holding every state, of the shape derive/system_chunk.py takes, no stabilizer."""
    in_system = {n for sy in plan.systems for n in sy.states}
    for sy in plan.systems:
        if sy.chunk is None:
            return f"the block-affine system {', '.join(sy.states)} has no chunked form: {sy.chunk_unsupported}"
    if len(plan.systems) > 1 or any(st.name not in in_system for st in plan.states):
        return "the spec has states beside its block-affine system (the chunked form runs one system alone)"
    if plan.stabilizer is not None:
        return "the block-affine system has an exponential-gate stabilizer"
    keys = set(plan.systems[0].chunk.key_dims)
    for r in plan.output.readouts:
        for t in r.terms_ir:
            if t.proj is None or set(t.over) != keys:
                return f"readout {r.name} of {r.state} does not contract the key dims {', '.join(sorted(keys))}"
    return scale_outside_values(plan)


def scale_outside_values(plan) -> str | None:
    """A read of a state scaled by a value over a dim the state does not hold as a value dim
    (`(k @ z) * sum(P, K)` with z[K]: a [V] scale of a read with no value dims): the chunked
    forms scale each read over its state's value dims only (the readout's [C, VF] block), so
    they refuse it and the recurrent forms, which take the output whole, serve it."""
    for r in plan.output.readouts:
        values = set(plan.state(r.state).value_dims)
        for t in r.terms_ir:
            extra = [d for d in (t.scale.shape if t.scale is not None else ()) if d not in values]
            if extra:
                # named by the output (r.name is the plan's own _r<n>)
                return (f"the output scales its read of state {r.state} by a value over "
                        f"{', '.join(extra)}, which {r.state} does not hold as a value dim")
    return None


def intra_matrices(plan) -> int:
    """The intra-chunk matrices the chunked forward stages (KernelLayout.intra_matrices): one per
    term of each readout of a state whose class computes its [C, C] matrix apart from the state
    (stages_intra: the key-diagonal decay's, whose sub-chunk loops cost an output program more
    registers and exps than its matmuls do), and one per state whose class can stage its setup's
    inverse (stages_solve: the rank-1 class's (I - M)^-1, staged where launch.STAGE_SOLVE asks).
    A stabilized state is a scalar decay in the kernels (codegen/chunk.py): none."""
    stabilized = set(plan.stabilizer.states) if plan.stabilizer is not None else set()
    return sum(len(r.terms_ir) for r in plan.output.readouts
               if r.state not in stabilized and classes.unit(plan.state(r.state).transition).stages_intra) + \
        sum(1 for st in plan.states if st.name not in stabilized and classes.unit(st.transition).stages_solve)


def chunk_size(plan) -> int:
    """C: the smallest of its states' classes' policies (classes/<unit>.py chunk_size: 16 where
    the intra-chunk term is a [C, C, dim] block, 32 for the rank-1 class, 64 otherwise). The
    torch backend takes the same C."""
    return min((classes.unit(s.transition).chunk_size(s) for s in plan.states), default=64)


def tile_dim(m: ir.MixerIR) -> str | None:
    """A dim of the output that every expression treats pointwise (no contraction, reduction
    or rename touches it, no alias names it): the recurrent kernels split it into blocks, one
    program each (fla's BV blocks; Mamba's P). None where no dim qualifies."""
    touched = {d.alias_of for d in m.dims if d.alias_of} | {d.name for d in m.dims if d.alias_of}
    exprs = [x.expr for x in m.lets] + [u.expr for u in m.updates] + [m.output.expr]
    for e in exprs:
        for node in ir.walk(e):
            if isinstance(node, (ir.Contract, ir.Reduce)):
                touched |= set(node.over)
            elif isinstance(node, ir.Rename):
                touched |= {x for pair in node.mapping for x in pair}
    free = [d for d in m.output.expr.shape if d not in touched]
    return free[-1] if free else None


def split_dim(plan) -> str | None:
    """A dim every state has, that the lets and updates treat pointwise and the output only
    contracts in terms linear in the states (Mamba's N, the key dim K of the linear
    classes): the recurrent kernels also split it into blocks (grid axis 2). Block j's output
    is out(S_j) - out(0) for j > 0 and out(S_0) for j = 0; out is affine in the states, so the
    blocks' outputs sum to out(S) (fla's fused recurrent kernels sum NK partial outputs the
    same way). None where no dim qualifies (an exponential-gate stabilizer, a normalized or
    nonlinear readout, a dim some expression reduces or renames)."""
    m = plan.kernel_ir
    if plan.stabilizer is not None or plan.output.kind != "linear" or not m.states:
        return None
    tile = tile_dim(m)
    touched = {d.alias_of for d in m.dims if d.alias_of} | {d.name for d in m.dims if d.alias_of}
    for e in [x.expr for x in m.lets] + [u.expr for u in m.updates]:
        for node in ir.walk(e):
            if isinstance(node, (ir.Contract, ir.Reduce)):
                touched |= set(node.over)
            elif isinstance(node, ir.Rename):
                touched |= {x for pair in node.mapping for x in pair}
    for node in ir.walk(m.output.expr):
        if isinstance(node, ir.Reduce):
            touched |= set(node.over)
        elif isinstance(node, ir.Rename):
            touched |= {x for pair in node.mapping for x in pair}
        elif isinstance(node, ir.Contract):
            # each block contracts its own slice: only a contraction that vanishes with the
            # states (a state-free value @ a value proportional to the states) is exact;
            # r @ (S + u k v) would count r @ (u k v) once per block and keep only block 0's
            pair = (node.left, node.right)
            if not any(_vanishes_with_states(x) and not _reads_state(y) for x, y in (pair, pair[::-1])):
                touched |= set(node.over)
    every_state = set.intersection(*[set(s.shape) for s in m.states])
    free = [d for d in m.dim_names if d in every_state and d not in touched and d != tile
            and d not in m.output.expr.shape]
    return free[0] if free else None


def _vanishes_with_states(e: ir.Expr) -> bool:
    """e is 0 whenever every state is 0 (a conservative, structural check)."""
    if isinstance(e, ir.Prev) or (isinstance(e, ir.Ref) and e.kind == "state"):
        return True
    if isinstance(e, ir.Neg):
        return _vanishes_with_states(e.x)
    if isinstance(e, ir.BinOp) and e.op in "+-":
        return _vanishes_with_states(e.left) and _vanishes_with_states(e.right)
    if isinstance(e, ir.BinOp) and e.op == "*":
        return _vanishes_with_states(e.left) or _vanishes_with_states(e.right)
    if isinstance(e, ir.BinOp) and e.op == "/":
        return _vanishes_with_states(e.left)
    if isinstance(e, ir.Contract):
        return _vanishes_with_states(e.left) or _vanishes_with_states(e.right)
    return False


def _reads_state(e: ir.Expr) -> bool:
    return any(isinstance(n, ir.Prev) or (isinstance(n, ir.Ref) and n.kind == "state") for n in ir.walk(e))

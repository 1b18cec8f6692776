"""MixerIR -> Plan: the transition class of every state, its log-space decay, the split of
the output into readouts and token terms, and the derivatives the backward pass needs."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import sympy as sp

from ..dsl import ir
from ..dsl.errors import SpecError
from . import affine, coupled, stabilize, system_chunk
from .stabilize import Stabilizer
from .budget import Budget
# the transition classes (one unit each: mixc/classes/), named here too for the users of
# plan.PREFIX_SUM, plan.SCALAR, ...
from .. import classes
from ..classes import (CHUNK_CLASSES, ELEMENTWISE, GENERAL, KEY_DIAG, PREFIX_SUM, RANK1, SCALAR,  # noqa: F401
                       VALUE_DIAG)
from .functions import log_of
from .decay_sign import negative_decay
from .layout import KernelLayout, kernel_layout
from .logspace import log_ir
from .sequence import derive_sequence
from .symbolic import NodeDef, SymbolTable, ToSympy, bounded_simplify, node_partial



@dataclass(frozen=True)
class Partial:
    """d(of)/d(wrt), elementwise by dim name."""

    of: str
    wrt: str
    expr: sp.Expr


@dataclass(frozen=True)
class LetPlan:
    name: str
    shape: ir.Shape
    expr: sp.Expr                      # elementwise lets inlined; reductions are node symbols
    partials: tuple[Partial, ...]      # with respect to each input, param and node it reads


@dataclass(frozen=True)
class NodePlan:
    node: NodeDef
    partials: tuple[Partial, ...]      # the node with respect to each operand's leaves


@dataclass(frozen=True)
class Rank1:
    """A term left * (right @ S) over `over` (the delta rule: left = -beta k, right = k)."""

    left: sp.Expr
    right: sp.Expr
    over: ir.Shape


@dataclass(frozen=True)
class StatePlan:
    name: str
    shape: ir.Shape
    transition: str                    # one of the classes above
    gated: bool                        # a rank-1 class with a decay besides the identity
    decay: sp.Expr                     # A_t's diagonal part a_t (1 for a prefix sum)
    decay_dims: ir.Shape
    log_decay: sp.Expr                 # log a_t, rewritten so that no exp is taken first
    log_decay_partials: tuple[Partial, ...]
    rank1: tuple[Rank1, ...]
    input_term: sp.Expr                # B_t: the part of the update free of the state
    key: sp.Expr | None                # B_t = key (x) value when it factors so
    value: sp.Expr | None
    key_dims: ir.Shape                 # dims the output contracts (K of S[K, V])
    value_dims: ir.Shape
    time_invariant: bool
    forms: tuple[str, ...]
    ir_pieces: "StateIR | None" = None   # the same pieces on the IR, for code generation


@dataclass(frozen=True)
class StateIR:
    """decay, log decay, key and value of a state as IR expressions (None: 1 / not factored)."""

    decay: ir.Expr
    log_decay: ir.Expr
    key: ir.Expr | None
    value: ir.Expr | None
    left: ir.Expr | None = None        # a rank-1 term left * (right @ S): left, right over the key dims
                                       # (left over the value dims too: the per-value-column class)
    right: ir.Expr | None = None
    # c with left = c * key, c a per-token scalar (the delta rules' -beta, gated -a beta), else
    # None: the rank-1 chunk then carries the corrected values V + c U (classes/rank1.py)
    left_scale: ir.Expr | None = None
    # the rank-r class (its unit's term_axes): its r terms (left, right), and B_t as m outer
    # products (key, value), its top-level sum split (() where a summand does not factor)
    terms: tuple[tuple[ir.Expr, ir.Expr], ...] = ()
    inputs: tuple[tuple[ir.Expr, ir.Expr], ...] = ()


@dataclass(frozen=True)
class ReadoutPlan:
    name: str                          # its symbol in the combine expression
    state: str
    prev: bool                         # reads S_{t-1} (prev(S)) instead of S_t
    terms: tuple[tuple[sp.Expr, sp.Expr | None, ir.Shape], ...]   # (scale, proj, over)
    shape: ir.Shape
    terms_ir: tuple[affine.LinTerm, ...] = ()


@dataclass(frozen=True)
class OutputPlan:
    name: str
    shape: ir.Shape
    readouts: tuple[ReadoutPlan, ...]
    combine: sp.Expr                   # over readout symbols and per-token values
    kind: str                          # how readouts combine: linear, normalized, nonlinear
    partials: tuple[Partial, ...]
    combine_ir: ir.Expr | None = None  # the combine expression on the IR (readouts as Refs)


@dataclass(frozen=True)
class Plan:
    ir: ir.MixerIR
    flags: tuple[tuple[str, bool], ...]
    lets: tuple[LetPlan, ...]
    nodes: tuple[NodePlan, ...]
    states: tuple[StatePlan, ...]
    output: OutputPlan
    forms: tuple[str, ...]             # recurrent, step, and chunk / scan / conv where they exist
    notes: tuple[str, ...]
    table: SymbolTable
    stabilizer: "Stabilizer | None" = None   # exponential input gates (derive/stabilize.py)
    sequence: "SequencePlan | None" = None   # a sequence mixer (conv, mix, attend): derive/sequence.py
    layout: KernelLayout | None = None      # which kernels exist, tile/split dims, chunk size (derive/layout.py)
    systems: tuple[coupled.System, ...] = ()  # states that read one another (derive/coupled.py)

    @property
    def name(self) -> str:
        return self.ir.name

    # A plan pickles as its spec and flags and is derived again on load: its symbol table
    # holds read-only mappings (and sympy's caches), which do not pickle. It is immutable,
    # so a copy is the plan itself.
    def __reduce__(self):
        return derive, (self.ir, dict(self.flags))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    @property
    def kernel_ir(self) -> ir.MixerIR:
        """The spec the recurrent kernels run: with a stabilizer, over S~ and the extra state _m."""
        return self.stabilizer.kernel_ir if self.stabilizer is not None else self.ir

    @property
    def transition(self) -> str:
        """The class of the spec: its states' classes, hardest first."""
        if self.sequence is not None:
            return self.sequence.kind
        return max((s.transition for s in self.states), key=lambda name: classes.unit(name).hardness)

    def state(self, name: str) -> StatePlan:
        return next(s for s in self.states if s.name == name)


def _partials(of: str, expr: sp.Expr, table: SymbolTable, kinds=("input", "param", "node", "let")) -> tuple[Partial, ...]:
    out = []
    for s in sorted(expr.free_symbols, key=str):
        if table.kinds.get(s) in kinds:
            out.append(Partial(of, str(s), sp.diff(expr, s)))
    return tuple(out)


def _time_invariant(exprs, table: SymbolTable) -> bool:
    return not any(table.leaves(e, ("input",)) for e in exprs)


def _factor(e: ir.Expr) -> list[ir.Expr]:
    if isinstance(e, ir.BinOp) and e.op == "*":
        return _factor(e.left) + _factor(e.right)
    if isinstance(e, ir.Neg):
        return [affine.num(-1)] + _factor(e.x)
    if isinstance(e, ir.BinOp) and e.op == "/" and not e.right.shape:
        return _factor(e.left) + [affine.recip(e.right)]
    return [e]


def _key_scale(left: ir.Expr | None, key: ir.Expr | None) -> ir.Expr | None:
    """c with left = c * key, c a per-token scalar, or None: the left's factors less the key's,
    matched structurally."""
    if left is None or key is None:
        return None
    rest = _factor(left)
    for f in _factor(key):
        if f not in rest:
            return None
        rest.remove(f)
    if any(f.shape for f in rest):
        return None
    return functools.reduce(affine.mul, rest) if rest else affine.num(1)


def _key_value(const: ir.Expr, key_dims, value_dims):
    """Split B_t into key (over key dims) times value (the rest, scalars included)."""
    key, value = [], []
    for f in _factor(const):
        if f.shape and set(f.shape) <= set(key_dims):
            key.append(f)
        elif set(f.shape) <= set(value_dims):
            value.append(f)
        else:
            return None, None
    def prod(fs):
        return functools.reduce(affine.mul, fs) if fs else affine.num(1)
    return prod(key), prod(value)


def _outer_terms(const: ir.Expr, key_dims, value_dims) -> tuple[tuple[ir.Expr, ir.Expr], ...]:
    """B_t as a sum of m outer products key (x) value: its top-level + and - split, each summand
    factored by _key_value (DeltaProduct's B_t has one per step); () where one does not factor."""
    def summands(e: ir.Expr, negate: bool) -> list[ir.Expr]:
        if isinstance(e, ir.BinOp) and e.op in ("+", "-"):
            return summands(e.left, negate) + summands(e.right, negate != (e.op == "-"))
        if isinstance(e, ir.Neg):
            return summands(e.x, not negate)
        return [affine.neg(e) if negate else e]
    out = []
    for e in summands(const, False):
        key, value = _key_value(e, key_dims, value_dims)
        if key is None:
            return ()
        out.append((key, value))
    return tuple(out)


def derive(mixer: ir.MixerIR, flags: dict[str, bool] | None = None) -> Plan:
    """The Plan of a checked spec, specialized for the given flag values (defaults otherwise)."""
    flags = dict(flags or {})
    for name in flags:
        if name not in {o.name for o in mixer.flags}:
            known = ", ".join(o.name for o in mixer.flags) or "none"
            raise SpecError(f"'{name}' is not a flag of mixer '{mixer.name}' (flags: {known})")
    if mixer.is_sequence:            # conv, mix, attend: no recurrence to classify
        seq, forms, notes = derive_sequence(mixer, flags)
        values = {o.name: o.default for o in mixer.flags} | flags
        out = OutputPlan(mixer.output.name, mixer.output.expr.shape, (), sp.S.Zero, "sequence", ())
        return Plan(mixer, tuple(sorted(values.items())), (), (), (), out, forms, notes,
                    SymbolTable(mixer).freeze(), None, seq)
    values = {o.name: (flags[o.name] if o.name in flags else o.default) for o in mixer.flags}
    spec = affine.specialize(mixer, values)
    table = SymbolTable(spec)
    conv = ToSympy(table, inline_lets=True)
    notes: list[str] = []
    budget = Budget(spec)

    lets = []
    for let in spec.lets:
        e = conv(let.expr)
        budget.check(let.span, f"let '{let.name}'", e)
        lets.append(LetPlan(let.name, let.expr.shape, e, _partials(let.name, e, table)))
        budget.check(let.span, f"the derivatives of let '{let.name}'", *(p.expr for p in lets[-1].partials))

    # Output readouts first: they say which dims of each state are keys.
    combine_ir, readouts = affine.split_output(spec, spec.output.expr)
    mixed = _mixed_key_dims(readouts)
    if mixed:       # reads of a state that contract different dims: take the fewest in the readouts
        combine_ir, readouts = affine.split_output(spec, spec.output.expr, mixed)
    key_dims: dict[str, set[str]] = {s.name: set() for s in spec.states}
    read: set[str] = set()
    r_plans = []
    for r in readouts:
        read.add(r.state)
        terms = []
        for t in r.terms:
            key_dims[r.state] |= set(t.over)
            terms.append((conv(t.scale) if t.scale is not None else sp.S.One,
                          conv(t.proj) if t.proj is not None else None, t.over))
        r_plans.append(ReadoutPlan(r.name, r.state, r.prev, tuple(terms), r.shape, r.terms))
    groups = coupled.systems(spec)
    same = lambda a, b: sp.expand(conv(a) - conv(b)) == 0      # noqa: E731 (two projections' sympy forms)
    for g in groups:
        coupled.check_linear(spec, g)
    systems = tuple(coupled.system(spec, g, conv, same) for g in groups)
    systems = tuple(replace(sy, chunk=form, chunk_unsupported=why) for sy in systems
                    for form, why in [system_chunk.chunk_form(spec, sy, conv, table, _outer_terms, key_dims)])
    # a state read by a state the output reads is read too (through the system)
    for _ in spec.states:
        read |= {n for u in spec.updates if u.state in read for n in ir.refs(u.expr, "state")}
    for s in spec.states:
        if s.name not in read:
            notes.append(f"state {s.name} is never read by the output")

    budget.check(spec.output.span, "the output's readouts", *(x for r in r_plans for t in r.terms for x in t[:2]))

    states = []
    system_of = {name: sy for sy in systems for name in sy.states}
    for u in spec.updates:
        if u.state in system_of:
            states.append(_system_state_plan(spec, system_of[u.state], u, key_dims[u.state], conv, table))
        else:
            states.append(_state_plan(spec, u, key_dims[u.state], conv, table))
        st = states[-1]
        budget.check(u.span, f"the update of {u.state}", st.decay, st.log_decay, st.input_term,
                     *(p.expr for p in st.log_decay_partials))

    combine = conv(combine_ir)
    budget.check(spec.output.span, "the output", combine)
    readout_syms = {sp.Symbol(r.name, real=True) for r in r_plans}
    kind = _combine_kind(combine, readout_syms, table.nodes)
    out = OutputPlan(spec.output.name, spec.output.expr.shape, tuple(r_plans), combine, kind,
                     _partials(spec.output.name, combine, table, ("input", "param", "node", "let", "readout")),
                     combine_ir)

    nodes = []
    for sym, nd in table.nodes.items():
        parts = []
        for i, operand in enumerate(nd.operands):
            parts.append(Partial(str(sym), f"operand {i}", bounded_simplify(node_partial(nd, i))))
        nodes.append(NodePlan(nd, tuple(parts)))
        budget.check(spec.output.span, f"the derivatives of {nd.describe()[:60]}", *(p.expr for p in parts))

    parallel = {classes.unit(s.transition).parallel_form for s in states}
    if not parallel <= {"chunk", "scan"}:       # the classes without a parallel form say why (their note)
        notes += [n for s in states if (n := classes.unit(s.transition).no_parallel_note(s)) is not None]
    stab = stabilize.find(spec, states, combine_ir, r_plans, notes)
    plan = Plan(spec, tuple(sorted(values.items())), tuple(lets), tuple(nodes), tuple(states), out,
                ("recurrent", "step"), tuple(notes), table.freeze(), stab, systems=systems)
    layout = kernel_layout(plan)
    forms = runnable_forms(plan, layout)
    for sy in systems:
        notes.append(f"states {sy.describe()}: mode='chunk' runs its chunked kernels (the system's own, over the "
                     "per-token pieces torch computes), mode='torch' runs its chunked form, and the recurrent and "
                     "step kernels run it too" if "chunk" in forms else
                     f"states {sy.describe()}: no chunked kernels are generated for it; the recurrent and step "
                     "kernels run it, and mode='torch' runs its chunked form" if layout.torch_chunked else
                     f"states {sy.describe()}: no parallel form: {layout.torch_chunk_unsupported}; the recurrent "
                     "and step forms run it")
    if parallel <= {"chunk", "scan"} and not ({"chunk", "scan"} & set(forms)) and negative_decay(plan) is None:
        # the classes have a parallel form that this spec's pieces do not fit (the lint speaks
        # for a decay that can be negative)
        why = layout.chunk_unsupported if parallel == {"chunk"} else layout.torch_chunk_unsupported
        notes.append(f"no chunked form: {why}")
    return replace(plan, layout=layout, forms=forms, notes=tuple(notes))


def runnable_forms(plan: Plan, layout: KernelLayout) -> tuple[str, ...]:
    """The forms a call can run, decided as the runtime decides them (runtime/op.py): "chunk"
    where the chunked kernels exist (layout.chunk_unsupported is None), "scan" where the classes'
    parallel form is an associative scan that the torch backend runs (layout.torch_chunked),
    "conv" where every transition is time-invariant and its decay has a real log, and always
    "recurrent" and "step"."""
    parallel = {classes.unit(s.transition).parallel_form for s in plan.states}
    forms = ["recurrent", "step"]
    if parallel == {"chunk"} and layout.chunked:
        forms.insert(0, "chunk")
    elif plan.systems and system_chunk.kernel_unsupported(plan) is None:     # runtime/system_kernels.py
        forms.insert(0, "chunk")
    elif parallel <= {"chunk", "scan"} and "scan" in parallel and layout.torch_chunked:
        forms.insert(0, "scan")
    if all(s.time_invariant for s in plan.states) and negative_decay(plan) is None:
        forms.append("conv")
    return tuple(forms)


def _combine_kind(combine: sp.Expr, readout_syms, nodes=None) -> str:
    """linear, normalized or nonlinear in the readouts. A node over the readouts (a sum, a
    max, a norm, a dot) is a symbol to sp.diff, which took `r / max(abs(r), P)` and a softmax
    over a readout for linear (issue 30: the recurrent kernels then split a dim into blocks
    and summed out(S_j) - out(0), 0/0). A linear node of readouts (a sum, a rename, a dot
    with a readout-free side) counts as one more readout; any other makes the combine
    nonlinear."""
    nodes = nodes or {}
    syms = set(readout_syms)

    def reads(e: sp.Expr) -> bool:
        return any(x in readout_syms or (x in nodes and any(reads(o) for o in nodes[x].operands))
                   for x in e.free_symbols)
    for x in combine.free_symbols:
        if x in nodes and reads(x):
            nd = nodes[x]
            over = [o for o in nd.operands if reads(o)]
            if nd.kind not in ("sum", "rename", "dot") or len(over) > 1 or \
                    _combine_kind(over[0], readout_syms, nodes) != "linear":
                return "nonlinear"
            syms.add(x)
    if all(sp.diff(combine, r, 2) == 0 for r in syms):
        cross = any(sp.diff(combine, a, b) != 0 for a in syms for b in syms if a != b)
        if not cross:
            return "linear"
    num, den = sp.fraction(sp.together(combine))
    if all(sp.diff(num, r, 2) == 0 for r in syms) and den.free_symbols & syms:
        return "normalized"
    return "nonlinear"


def _mixed_key_dims(readouts) -> dict[str, frozenset[str]]:
    """{state: the dims some of its readouts' terms contract and others do not}: a sum over a
    readout (mean(C @ S, P) beside C @ S) contracts one dim more than the readout itself. The
    chunked kernels contract the same key dims in every read of a state, so these dims are
    left to the combine (affine.split_output's keep) where the reads share the rest."""
    overs: dict[str, list[set[str]]] = {}
    for r in readouts:
        overs.setdefault(r.state, []).extend(set(t.over) for t in r.terms)
    out = {}
    for state, sets in overs.items():
        common = set.intersection(*sets)
        extra = set.union(*sets) - common
        if extra and common:
            out[state] = frozenset(extra)
    return out


def _state_plan(spec: ir.MixerIR, upd: ir.Update, key_dims: set[str], conv: ToSympy,
                table: SymbolTable) -> StatePlan:
    decl = spec.state(upd.state)
    # one term per distinct projection, equal as written or as sympy expressions (lets inlined)
    form = affine.update_form(spec, upd, same=lambda a, b: sp.expand(conv(a) - conv(b)) == 0)
    if not form.terms:
        raise SpecError(f"the update of {upd.state} does not read {upd.state}: a state carries over from "
                        f"one token to the next (write e.g. `update {upd.state} = {upd.state} + ...`)",
                        spec.source, upd.expr.span)
    diag = [t for t in form.terms if t.proj is None]
    proj = [t for t in form.terms if t.proj is not None]
    decay = sp.Add(*[conv(t.scale) if t.scale is not None else sp.S.One for t in diag]) if diag else sp.S.Zero
    decay = bounded_simplify(decay)
    decay_dims = tuple(d for d in decl.shape if any(d in (t.scale.shape if t.scale is not None else ())
                                                    for t in diag))
    kdims = tuple(d for d in decl.shape if d in key_dims)
    vdims = tuple(d for d in decl.shape if d not in key_dims)

    rank1 = tuple(Rank1(conv(t.scale) if t.scale is not None else sp.S.One, conv(t.proj), t.over) for t in proj)
    if decay == 0 and not proj:
        raise SpecError(f"the update of {upd.state} multiplies the state by 0", spec.source, upd.expr.span)

    const = form.const if form.const is not None else affine.num(0)
    key, value = _key_value(const, kdims, vdims)
    pieces = _outer_terms(const, kdims, vdims) if key is None else ()
    shape = classes.UpdateShape(
        decl.shape, kdims, vdims, decay == 1, decay_dims,
        tuple(classes.Projection(t.scale.shape if t.scale is not None else None, t.proj.shape, t.over) for t in proj),
        len(pieces) if len(pieces) >= 2 else 0)
    unit = classes.classify(shape)
    transition = unit.name
    gated = unit.keyed_left and decay != 1

    log_decay = log_of(decay) if decay != 0 else sp.S.NegativeInfinity
    log_partials = _partials(f"log decay of {upd.state}", log_decay, table) if decay != 0 else ()

    input_term = conv(const)
    coefs = [decay] + [r.left for r in rank1] + [r.right for r in rank1]
    ti = _time_invariant(coefs, table)
    forms = ("recurrent", "step")
    parallel = classes.unit(transition).parallel_form
    terms = inputs = ()
    if unit.term_axes:                  # the rank-r and outer-sum classes: r terms, B_t's m outer products
        terms = tuple((t.scale or affine.num(1), t.proj) for t in proj)
        inputs = _outer_terms(const, kdims, vdims)
    if parallel == "chunk" and (key is not None or inputs):
        forms = ("chunk",) + forms
    elif parallel == "scan":
        forms = ("scan",) + forms
    if ti:
        forms = forms + ("conv",)
    decay_ir = functools.reduce(lambda a, b: affine.add(a, b), [t.scale or affine.num(1) for t in diag]) \
        if diag else affine.num(0)
    left = right = None
    if unit.single_projection:      # one term left * (right @ S)
        left, right = proj[0].scale or affine.num(1), proj[0].proj
    scale = _key_scale(left, key) if unit.keyed_left else None
    pieces = StateIR(decay_ir, log_ir(spec, decay_ir), key, value, left, right, terms=terms, inputs=inputs,
                     left_scale=scale)
    return StatePlan(upd.state, decl.shape, transition, gated, decay, decay_dims, log_decay, log_partials,
                     rank1, input_term, conv(key) if key is not None else None,
                     conv(value) if value is not None else None, kdims, vdims, ti, forms, pieces)


def _system_state_plan(spec: ir.MixerIR, system: coupled.System, upd: ir.Update, key_dims: set[str],
                       conv: ToSympy, table: SymbolTable) -> StatePlan:
    """A state of a block-affine system: its own block as its decay and projection terms, its
    input term free of every state of the system, the class block-affine (no parallel form,
    no convolution form: the blocks that read the other states are not in these pieces)."""
    decl = spec.state(upd.state)
    own = system.block(upd.state, upd.state)
    diag = own.diagonal if own is not None else None
    decay = bounded_simplify(conv(diag)) if diag is not None else sp.S.Zero
    decay_dims = tuple(d for d in decl.shape if diag is not None and d in diag.shape)
    proj = own.projections if own is not None else ()
    rank1 = tuple(Rank1(conv(t.scale) if t.scale is not None else sp.S.One, conv(t.proj), t.over) for t in proj)
    log_decay = log_of(decay) if decay != 0 else sp.S.NegativeInfinity
    log_partials = _partials(f"log decay of {upd.state}", log_decay, table) if decay != 0 else ()
    const = coupled.input_term(spec, upd.state, system.states)
    kdims = tuple(d for d in decl.shape if d in key_dims)
    vdims = tuple(d for d in decl.shape if d not in key_dims)
    decay_ir = diag if diag is not None else affine.num(0)
    pieces = StateIR(decay_ir, log_ir(spec, decay_ir) if diag is not None else affine.num(0), None, None)
    return StatePlan(upd.state, decl.shape, classes.SYSTEM_CLASS, False, decay, decay_dims, log_decay, log_partials,
                     rank1, conv(const), None, None, kdims, vdims, False, ("recurrent", "step"), pieces)

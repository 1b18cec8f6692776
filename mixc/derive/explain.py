"""Plan -> readable text: the class, the shapes, the recurrent and parallel forms and the
backward equations, with the spec's own expressions substituted."""
from __future__ import annotations

import json

import sympy as sp

from .. import classes
from ..dsl.unparse import const_values_text, dim_text, expr_text
from . import plan as P
from .convform import conv_form_lines
from .sequence import explain_sequence


_FOLD: list[tuple[sp.Expr, sp.Symbol]] = []


def s(e) -> str:
    """An expression as text, with each let's inlined expression shown by the let's name."""
    if e is None:
        return "1"
    if isinstance(e, sp.Basic):
        for inlined, name in _FOLD:
            e = e.subs(inlined, name)
    return sp.sstr(e, full_prec=False)


def _set_fold(plan: P.Plan) -> None:
    """Lets to fold back, the biggest first (a let may contain a smaller one)."""
    pairs = [(x.expr, sp.Symbol(x.name)) for x in plan.lets if not x.expr.is_Symbol]
    _FOLD[:] = sorted(pairs, key=lambda p: -sp.count_ops(p[0]))


def _shape(shape) -> str:
    return "[" + ", ".join(shape) + "]"


def _lead(kind: str) -> str:
    return {"input": "B, T, H", "param": "H"}[kind]


def _readout_text(r: P.ReadoutPlan) -> str:
    S = f"{r.state}_{{t-1}}" if r.prev else f"{r.state}_t"
    parts = []
    for scale, proj, over in r.terms:
        core = S if proj is None else (f"({s(proj)}) @ {S}" if set(over) else f"({s(proj)}) * {S}")
        if proj is not None and over and scale == 1:
            parts.append(core)
        elif scale == 1:
            parts.append(core)
        else:
            parts.append(f"({s(scale)}) * ({core})")
    return " + ".join(parts)


def _update_text(st: P.StatePlan) -> str:
    S = st.name
    terms = []
    if st.decay != 0:
        terms.append(f"{S}_{{t-1}}" if st.decay == 1 else f"({s(st.decay)}) * {S}_{{t-1}}")
    for r in st.rank1:
        terms.append(f"({s(r.left)}) * (({s(r.right)}) @ {S}_{{t-1}})")
    if st.input_term != 0:
        terms.append(f"({s(st.input_term)})")
    return f"{S}_t = " + " + ".join(terms)


def _block_text(b, S: str) -> str:
    """A block of a system applied to the previous value of S: a * S + (l) * ((r) @ S) ..."""
    parts = []
    if b.diagonal is not None:
        parts.append(f"({s(b.diagonal_sym)}) * {S}")
    for left, right, _ in b.projections_sym:
        parts.append(f"({s(left)}) * (({s(right)}) @ {S})")
    return " + ".join(parts)


def _system_update_text(plan: P.Plan, st: P.StatePlan) -> str:
    sy = _system(plan, st.name)
    terms = [_block_text(b, f"{b.wrt}_{{t-1}}") for b in sy.blocks if b.of == st.name]
    if st.input_term != 0:
        terms.append(f"({s(st.input_term)})")
    return f"{st.name}_t = " + " + ".join(terms)


def _system(plan: P.Plan, name: str):
    return next((sy for sy in plan.systems if name in sy.states), None)


def _system_lines(plan: P.Plan, sy) -> list[str]:
    out = [f"system {sy.describe()}",
           "  the stacked state X_t = A_t X_{t-1} + B_t, A_t in blocks (the update of the row's state reads "
           "the column's previous value):"]
    for b in sy.blocks:
        out.append(f"  {b.of} <- {b.wrt}: {b.kind()}: {_block_text(b, b.wrt + '_{t-1}')}")
    for name in sy.states:
        st = plan.state(name)
        out.append(f"  input of {name}: B_t = {s(st.input_term)}")
    if sy.chunk is None or not plan.layout.torch_chunked:
        why = plan.layout.torch_chunk_unsupported
        out.append(f"  parallel form: none ({why}); the recurrent and step forms run it")
        return out
    return out + _system_chunk_lines(plan, sy)


def _system_chunk_lines(plan: P.Plan, sy) -> list[str]:
    """The chunked form of a 2x2 system (derive/system_chunk.py; design-notes has the derivation)."""
    f = sy.chunk
    X1, X2 = f.states

    def diag(of, wrt):
        b = sy.block(of, wrt)
        return s(b.diagonal_sym) if b is not None and b.diagonal is not None else "0"

    def left(of):
        b = sy.block(of, f.read)
        return s(b.projections_sym[0][0]) if b is not None and b.projections else "0"
    B = f"B = ({s(plan.state(X1).input_term)}; {s(plan.state(X2).input_term)})"
    where = ("mode='chunk': the system's Triton kernels over the per-token pieces, and mode='torch'"
             if "chunk" in plan.forms else "mode='torch' only: no chunked kernels serve this system")
    out = [f"  chunked form ({where}), C tokens a chunk, "
           f"X = ({X1}, {X2}), X_0 the states at the chunk's start:"]
    if f.read is None:
        out.append(f"    X_t = (D_t (x) I) X_{{t-1}} + B_t,  D_t = [[a, 0], [c, d]] with a = {diag(X1, X1)}, "
                   f"c = {diag(X2, X1)}, d = {diag(X2, X2)};  {B}")
    else:
        i = f.states.index(f.read)
        right = s(next(b for b in sy.blocks if b.projections).projections_sym[0][1])      # one w for every block
        out.append(f"    X_t = (D_t (x) I) X_{{t-1}} + u_t r_t^T + B_t,  D_t = [[a, 0], [c, d]] with a = {diag(X1, X1)}, "
                   f"c = {diag(X2, X1)}, d = {diag(X2, X2)};  r_t = {f.read}_{{t-1}}^T w_t, w = {right}, "
                   f"u = ({left(X1)}; {left(X2)}), {B}")
    out.append("    P[m, n] = D_m ... D_{n+1} (2x2, lower triangular, boundaries m, n = 0..C): P00 = exp(per-pair sum of "
               "log a), P11 = exp(per-pair sum of log d), P10[m, n] = sum_{n<r<=m} P11[m, r] c_r P00[r-1, n] "
               "(no exp(-b) is formed)")
    if f.read is not None:
        out.append(f"    (I - M) R = sum_j P[t-1, 0][{i}, j] (w_t . X_j,0) + sum_l N_l Vin_l   the [C, C] unit "
                   f"lower-triangular solve, M[t, s] = sum_l P[t-1, s][{i}, l] (w_t . u_l,s), N_l[t, s] = "
                   f"P[t-1, s][{i}, l] (w_t . kin_l,s), s < t")
    ru = "(q_t . u_l,s) r_s + " if f.read is not None else ""
    uR = " (U_l * P[C, s][i, l])^T R +" if f.read is not None else ""
    return out + [
        f"    q_t . X_i,t = sum_j P[t, 0][i, j] (q_t . X_j,0) + sum_{{s<=t}} sum_l P[t, s][i, l] ({ru}"
        "(q_t . kin_l,s) vin_l,s)    (prev(X_i): t-1, s < t)",
        f"    X_i,C = sum_j P[C, 0][i, j] X_j,0 + sum_l{uR} (Kin_l * P[C, s][i, l])^T Vin_l"]


def _chunk_lines(st: P.StatePlan, queries: list[str]) -> list[str]:
    """The chunked equations of one state, C tokens per chunk, S0 its state at the chunk start."""
    S = st.name
    key = s(st.key) if st.key is not None else None
    value = s(st.value) if st.value is not None else None
    Q = " , ".join(queries) if queries else "(none)"
    unit = classes.unit(st.transition)
    if unit.term_axes and key is None:      # the rank-r class: B_t's m outer products (its lines)
        rows = [f"rows are the tokens of one chunk; Q = readout queries {Q}; K_m, V_m = rows of B_t's outer products"]
    else:
        rows = [f"rows are the tokens of one chunk; Q = readout queries {Q}; K = rows of {key}; V = rows of {value}"]
    if key is None and not unit.term_axes:
        rows.append(f"the input term {s(st.input_term)} is not an outer product key (x) value: "
                    "the chunked form takes it as a full-rank term per token")
    if unit.parallel_form == "chunk":
        rows += unit.explain_chunk(st, s)
    else:           # no matmul form: the class's own lines say which parallel form (if any)
        rows = unit.explain_chunk(st, s)
    if st.time_invariant:
        rows.append("time-invariant transition: also a convolution form (mode=\"conv\", below)")
    return rows


def _no_parallel_lines(plan: P.Plan, st: P.StatePlan) -> list[str]:
    """Why a state has no parallel form that runs: its class knows none (the class's own
    words), or the plan's pieces do not fit the class's (the reason the runtime refuses it)."""
    unit = classes.unit(st.transition)
    if unit.parallel_form is None:
        return ["  parallel form: none generated"] + ["    " + line for line in unit.explain_chunk(st, s)]
    why = plan.layout.torch_chunk_unsupported if unit.parallel_form == "scan" else plan.layout.chunk_unsupported
    return [f"  parallel form: none generated ({why})" if why else "  parallel form: none generated"]


def explain(plan: P.Plan) -> str:
    if plan.sequence is not None:
        return explain_sequence(plan)
    _set_fold(plan)
    try:
        return _explain(plan)
    finally:
        _FOLD.clear()


def _explain(plan: P.Plan) -> str:
    m = plan.ir
    why = plan.layout.chunk_unsupported
    if plan.systems and "chunk" in plan.forms:      # the system's own kernels (runtime/system_kernels.py)
        why = None
    kernels = "recurrent forward + backward, step" + (", chunked forward + backward" if why is None
                                                     else f" (no chunked kernel: {why})")
    out = [f"mixer {m.name}    ({m.source.filename}, spec hash {m.spec_hash})",
           f"class: {plan.transition}" + "".join(f" ({sy.describe()})" for sy in plan.systems),
           f"forms: {', '.join(plan.forms)}",
           f"kernels: {kernels}"]
    if plan.flags:
        out.append("flags: " + ", ".join(f"{k}={str(v).lower()}" for k, v in plan.flags))
    out.append("")
    out.append("shapes (per call; dims bind from the tensors)")
    out.append("  dims     " + ", ".join(dim_text(d) for d in m.dims))
    for kind, decls in (("input", m.inputs), ("param", m.given_params)):
        for d in decls:
            promised = f" in {d.range.text()}" if d.range is not None else ""
            sh = m.shift_of(d.name) if kind == "input" else None
            carried = (f" = prev({sh.source}): {sh.source} one token back (0 at a sequence's start), computed by the "
                       f"op; the state carries {sh.source}'s last token as '{d.name}'") if sh is not None else ""
            out.append(f"  {kind:8} {d.name}[{_lead(kind)}{''.join(', ' + x for x in d.shape)}]{promised}{carried}")
    for c in m.consts:        # the spec's values, the same for every head: no argument
        values = const_values_text(c, tuple(m.fixed_size(d) for d in c.shape))
        values = values if len(values) <= 80 else values[:76] + " ..."
        out.append(f"  const    {c.name}[{', '.join(c.shape)}] = {values}  (fixed by the spec; not an argument)")
    for o in m.options:
        default = str(o.default).lower() if o.kind == "bool" else expr_text(o.default)
        out.append(f"  option   {o.name} = {default}")
    for st in m.states:
        out.append(f"  state    {st.name}[B, H{''.join(', ' + x for x in st.shape)}]")
    for sh in m.shifted:
        out.append(f"  state    {sh.name}[B, H{''.join(', ' + x for x in m.input(sh.source).shape)}]"
                   f"  ({sh.source} at the last token: prev({sh.source}) of the next)")
    out.append(f"  output   {m.output.name}[B, T, H{''.join(', ' + x for x in m.output.expr.shape)}]")
    if plan.lets:
        out.append("")
        out.append("lets (inlined; reductions and contractions are their own nodes)")
        for let in plan.lets:
            out.append(f"  {let.name}{_shape(let.shape)} = {sp.sstr(let.expr, full_prec=False)}")
    out.append("")
    out.append("recurrent form (per token t, per head)")
    for st in plan.states:
        out.append(f"  {_system_update_text(plan, st) if _system(plan, st.name) else _update_text(st)}")
    for r in plan.output.readouts:
        out.append(f"  {r.name} = {_readout_text(r)}")
    out.append(f"  {plan.output.name}_t = {s(plan.output.combine)}    ({plan.output.kind} in the readouts)")
    for sy in plan.systems:
        out.append("")
        out += _system_lines(plan, sy)
    for st in plan.states:
        if _system(plan, st.name):
            continue
        out.append("")
        dims = f" over {', '.join(st.decay_dims)}" if st.decay_dims else ""
        gated = " (gated)" if st.gated else ""
        out.append(f"state {st.name}{_shape(st.shape)}: {st.transition}{gated}{dims}")
        out.append(f"  decay       a_t = {s(st.decay)}")
        out.append(f"  log decay   log a_t = {s(st.log_decay)}")
        if st.key is not None:
            out.append(f"  input       B_t = key (x) value,  key = {s(st.key)}{_shape(st.key_dims)},  "
                       f"value = {s(st.value)}{_shape(st.value_dims)}")
        else:
            out.append(f"  input       B_t = {s(st.input_term)}")
        # the state's forms that run: those of the whole plan (a form runs for every state or none)
        forms = [f for f in st.forms if f in plan.forms]
        out.append(f"  time-invariant: {'yes' if st.time_invariant else 'no'}; forms: {', '.join(forms)}")
        if "chunk" in forms or "scan" in forms:
            out.append("  parallel form (chunk of C tokens, S0 the state at the chunk start)")
            queries = [s(proj) for r in plan.output.readouts if r.state == st.name for _, proj, _ in r.terms
                       if proj is not None]
            out += ["    " + line for line in _chunk_lines(st, queries)]
        else:
            out += _no_parallel_lines(plan, st)
    if plan.stabilizer is not None:
        out.append("")
        out += _stabilizer_lines(plan.stabilizer)
    conv_lines = conv_form_lines(plan, s)
    if conv_lines:
        out += [""] + conv_lines
    out.append("")
    out += ["backward"] + ["  " + line for line in _backward_lines(plan)]
    if plan.notes:
        out.append("")
        out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def _stabilizer_lines(st) -> list[str]:
    names = ", ".join(st.states)
    g, a = expr_text(st.log_gate), expr_text(st.log_decay)
    return [f"max-stabilizer (the exponential input gate exp({g}) of {names}; derive/stabilize.py)",
            f"  the kernels keep S~ = S exp(-m) for {names}, m_0 = 0:",
            f"  m_t   = max({a} + m_{{t-1}}, {g})",
            f"  S~_t  = exp({a} + m_{{t-1}} - m_t) S~_{{t-1}} + exp({g} - m_t) key (x) value",
            f"  {expr_text(st.combine_ir)}    (the output over the readouts of S~)",
            "  chunked: m_t is the largest log weight of row t (the state's and the intra-chunk ones);",
            "  the backward holds m constant (the output does not depend on it); states in and out are S"]


def _backward_lines(plan: P.Plan) -> list[str]:
    lines = []
    for st in plan.states:
        S = st.name
        sy = _system(plan, S)
        if sy is not None:
            # the transposed blocks: the previous value of S reaches every state whose update reads it
            terms = []
            for b in sy.blocks:
                if b.wrt != S:
                    continue
                if b.diagonal is not None:
                    terms.append(f"({s(b.diagonal_sym)}) * d{b.of}_t")
                for left, right, _ in b.projections_sym:
                    terms.append(f"({s(right)}) (x) (({s(left)}) @ d{b.of}_t)")
            lines += [f"d{S}_{{t-1}} = " + (" + ".join(terms) or "0"),
                      f"  the reverse recurrence of the system {', '.join(sy.states)}, started from the final "
                      f"states' gradients; d{S}_t also takes the gradient of the readouts of {S}_t"]
            continue
        rows = [f"d{S}_{{t-1}} = " + (f"({s(st.decay)}) * d{S}_t" if st.decay != 1 else f"d{S}_t")]
        for r in st.rank1:
            rows[0] += f" + ({s(r.right)}) (x) (({s(r.left)}) @ d{S}_t)"
        reads_prev = [r for r in plan.output.readouts if r.state == S and r.prev]
        if reads_prev:
            rows[0] += " + (gradient of the prev() readouts at token t)"
        rows.append(f"  the reverse recurrence, started from the final state's gradient; d{S}_t also takes the "
                    f"gradient of the readouts of {S}_t")
        if st.key is not None:
            rows.append(f"d(key) = d{S}_t @ value,   d(value) = key @ d{S}_t")
        if st.decay not in (0, 1):
            rows.append(f"d(log a_t) = sum over the other dims of ({S}_{{t-1}} * a_t * d{S}_t)  "
                        "(a reverse cumulative sum in the chunked form)")
            for p in st.log_decay_partials:
                rows.append(f"  d(log a)/d{p.wrt} = {s(p.expr)}")
        lines += rows
    for p in plan.output.partials:
        lines.append(f"d{plan.output.name}/d{p.wrt} = {s(p.expr)}")
    for let in plan.lets:
        for p in let.partials:
            lines.append(f"d{let.name}/d{p.wrt} = {s(p.expr)}")
    for node in plan.nodes:
        for p in node.partials:
            lines.append(f"d[{s(node.node.symbol)}]/d[{p.wrt}: {s(node.node.operands[int(p.wrt.split()[-1])])}]"
                         f" = {s(p.expr)}")
    return lines


def plan_dict(plan: P.Plan) -> dict:
    """The Plan as plain data (sympy expressions as strings) for --dump plan."""
    if plan.sequence is not None:
        return {"mixer": plan.name, "flags": dict(plan.flags), "class": plan.transition, "forms": list(plan.forms),
                "sequence_ops": [{"name": op.name, "kind": op.kind, "op": op.text, "in": op.where,
                                  "causal": op.causal, "tap": op.tap, "filter": op.filter,
                                  "window": expr_text(op.window) if op.window is not None else None,
                                  "cache": [k for k, _ in op.cache], "algorithm": list(op.algorithm)}
                                 for op in plan.sequence.ops],
                "step": plan.sequence.no_step is None, "notes": list(plan.notes)}
    return {
        "mixer": plan.name,
        "flags": dict(plan.flags),
        "class": plan.transition,
        "forms": list(plan.forms),
        "lets": [{"name": x.name, "shape": list(x.shape), "expr": s(x.expr),
                  "partials": {p.wrt: s(p.expr) for p in x.partials}} for x in plan.lets],
        "nodes": [{"symbol": s(n.node.symbol), "kind": n.node.kind, "over": list(n.node.over),
                   "operands": [s(o) for o in n.node.operands],
                   "partials": [s(p.expr) for p in n.partials]} for n in plan.nodes],
        "states": [{"name": x.name, "shape": list(x.shape), "class": x.transition, "gated": x.gated,
                    "decay": s(x.decay), "decay_dims": list(x.decay_dims), "log_decay": s(x.log_decay),
                    "log_decay_partials": {p.wrt: s(p.expr) for p in x.log_decay_partials},
                    "rank1": [{"left": s(r.left), "right": s(r.right), "over": list(r.over)} for r in x.rank1],
                    "input_term": s(x.input_term), "key": s(x.key) if x.key is not None else None,
                    "value": s(x.value) if x.value is not None else None, "key_dims": list(x.key_dims),
                    "value_dims": list(x.value_dims), "time_invariant": x.time_invariant,
                    "forms": [f for f in x.forms if f in plan.forms]} for x in plan.states],
        "output": {"name": plan.output.name, "shape": list(plan.output.shape), "kind": plan.output.kind,
                   "combine": s(plan.output.combine),
                   "readouts": [{"name": r.name, "state": r.state, "prev": r.prev,
                                 "terms": [{"scale": s(a), "proj": s(b) if b is not None else None,
                                            "over": list(c)} for a, b, c in r.terms]}
                                for r in plan.output.readouts],
                   "partials": {p.wrt: s(p.expr) for p in plan.output.partials}},
        "stabilizer": ({"states": list(plan.stabilizer.states), "log_gate": expr_text(plan.stabilizer.log_gate),
                        "log_decay": expr_text(plan.stabilizer.log_decay),
                        "combine": expr_text(plan.stabilizer.combine_ir)}
                       if plan.stabilizer is not None else None),
        "notes": list(plan.notes),
    }


def plan_json(plan: P.Plan) -> str:
    return json.dumps(plan_dict(plan), indent=2)

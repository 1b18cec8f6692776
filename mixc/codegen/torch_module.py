"""Plan -> the hooks of templates/torch_chunk.py.j2: the torch backend of a spec with a chunked
form. The spec's expressions (lets, each state's key, value and log decay, each readout's
query and scale, the stabilizer's gate, the output's combine) are printed as torch code by
torch_expr.py; the chunk loop is the template's, the same for every spec."""
from __future__ import annotations

import pprint
import re

from .. import classes
from ..derive import affine
from ..derive.logspace import log_ir
from ..derive.plan import Plan, _key_value
from .chunk import ChunkCode
from .torch_expr import TorchEmitter, input_loads
from .triton_expr import canon

I1 = "    "


def _element_log_decay(em, log_decay, kd, vd, order) -> str:
    """A log decay per state element: [B, T, H, KF, VF], key dims first, then value dims (any
    expression over the state's dims: the per-value-column class's left too)."""
    kv = canon(order, kd + vd)
    var, have = em(log_decay)
    ksz = " * ".join(f"_sizes[{d!r}]" for d in kd) or "1"
    vsz = " * ".join(f"_sizes[{d!r}]" for d in vd) or "1"
    perm = ""
    if kv != kd + vd:                     # the flat layout is key dims first, then value dims
        perm = f".permute(0, 1, 2, {', '.join(str(3 + kv.index(d)) for d in kd + vd)})"
    return (f"_t({em.expand(var, have, kv)}).to(_x0.dtype).expand(_B, _T, _H, "
            f"{', '.join(f'_sizes[{d!r}]' for d in kv)}){perm}.reshape(_B, _T, _H, {ksz}, {vsz})")


def _env_lines(plan: Plan) -> tuple[list[str], dict, set]:
    """Loads of the inputs [B, T, H, *canonical dims], params [1, 1, H, *dims] and options
    (torch_expr.input_loads), and the head index."""
    lines, env, scalars = input_loads(plan.ir, 3, I1)
    lines.insert(1, f"{I1}_head = torch.arange(_H, dtype=_x0.dtype, device=_x0.device).reshape(1, 1, _H)")
    return lines, env, scalars


def _sizes(dims) -> str:
    return "[" + ", ".join(f"_sizes[{d!r}]" for d in dims) + "]"


def torch_hooks(plan: Plan) -> dict:
    m, order = plan.ir, plan.ir.dim_names
    chunk = ChunkCode(plan)                  # its states: the stabilizer's group as the kernels see it
    lines, env, scalars = _env_lines(plan)
    em = TorchEmitter(m, env, scalars, indent=I1, prefix="_p")

    def full(expr, dims) -> str:
        if expr is None:
            return f"_full(1.0, _B, _T, _H, {_sizes(dims)}).to(_x0.dtype)"
        var, have = em(expr)
        return f"_full({em.expand(var, have, dims)}, _B, _T, _H, {_sizes(dims)}).to(_x0.dtype)"

    out = [f"{I1}_K, _V, _g, _Q, _L, _R, _Lc, _Sys = {{}}, {{}}, {{}}, {{}}, {{}}, {{}}, {{}}, {{}}"]
    states, systems = {}, {}
    for sy in plan.systems:     # a block-affine system's pieces (derive/system_chunk.py, classes/block_affine.py)
        form = sy.chunk
        kd, vd = canon(order, form.key_dims), canon(order, form.value_dims)
        a, d = (f"_t({em(log_ir(m, e))[0]}).to(_x0.dtype).expand(_B, _T, _H)" for e in (form.a, form.d))
        c = f"_t({em(form.c)[0]}).to(_x0.dtype).expand(_B, _T, _H)" if form.c is not None else "None"
        lefts = ", ".join(full(u, kd) if u is not None else "None" for u in form.lefts) + ","
        # the input terms as (state index, kin, vin), one per outer product
        kin = ", ".join(f"({i}, {full(k, kd)}, {full(v, vd)})" for i, pairs in enumerate(form.inputs)
                        for k, v in pairs)
        out.append(f"{I1}_Sys[{'+'.join(sy.states)!r}] = {{'log_a': {a}, 'c': {c}, 'log_d': {d}, "
                   f"'w': {full(form.right, kd) if form.right is not None else None}, 'u': ({lefts}), "
                   f"'inputs': [{kin}]}}")
        systems['+'.join(sy.states)] = {"states": list(form.states), "read": form.read, "kd": list(kd), "vd": list(vd)}
        for name in sy.states:
            states[name] = {"class": classes.SYSTEM_CLASS, "decay": None, "kd": list(kd), "vd": list(vd),
                            "decl": list(m.state(name).shape)}
    for st in chunk.states:
        if st.name in states:   # a state of a system: above
            continue
        kd, vd = canon(order, st.key_dims), canon(order, st.value_dims)
        p = st.ir_pieces
        unit = classes.unit(st.transition)
        if unit.term_axes:      # r terms l_i (r_i @ S) and B_t = sum_m k_m v_m^T: axis 3 (mixc/classes/rank_r.py)
            for part, pairs, i, dims in (("K", p.inputs, 0, kd), ("V", p.inputs, 1, vd),
                                         ("L", p.terms, 0, kd), ("R", p.terms, 1, kd)):
                if not pairs:       # the outer-sum class: no projection terms (mixc/classes/outer_sum.py)
                    continue
                rows = ",\n".join(f"{I1}    {full(pair[i], dims)}" for pair in pairs)
                out.append(f"{I1}_{part}[{st.name!r}] = torch.stack([\n{rows}], 3)")
        else:
            out.append(f"{I1}_K[{st.name!r}] = {full(p.key, kd)}")
            out.append(f"{I1}_V[{st.name!r}] = {full(p.value, vd)}")
        axis = unit.decay_axis(st)                # what the log decay g runs over
        if p.left is not None and unit.left_per_value:    # a left per value column (mixc/classes/value_column.py)
            lk, lv = _key_value(p.left, st.key_dims, st.value_dims)
            if lk is not None:                    # left = lk (x) lv: L [.., KF + VF], the two factors side by side
                out.append(f"{I1}_L[{st.name!r}] = torch.cat([{full(lk, kd)}, {full(lv, vd)}], -1)")
            else:                                 # no such factors: L [.., KF, VF]
                out.append(f"{I1}_L[{st.name!r}] = {_element_log_decay(em, p.left, kd, vd, order)}")
            out.append(f"{I1}_R[{st.name!r}] = {full(p.right, kd)}")
        elif p.left is not None:                  # left * (right @ S): the WY/UT chunk (mixc/classes/rank1.py)
            out.append(f"{I1}_L[{st.name!r}] = {full(p.left, kd)}")
            out.append(f"{I1}_R[{st.name!r}] = {full(p.right, kd)}")
            c = p.left_scale
            if c is not None:                     # left = c * key (the delta rules' -beta k): the batched form's
                out.append(f"{I1}_Lc[{st.name!r}] = _t({em(c)[0]}).to(_x0.dtype).expand(_B, _T, _H)")
        g = {None: lambda: "None",
             "scalar": lambda: f"_t({em(p.log_decay)[0]}).to(_x0.dtype).expand(_B, _T, _H)",
             "key": lambda: full(p.log_decay, kd),
             "value": lambda: full(p.log_decay, vd),
             "element": lambda: _element_log_decay(em, p.log_decay, kd, vd, order)}[axis]()
        out.append(f"{I1}_g[{st.name!r}] = {g}")
        states[st.name] = {"class": unit.name, "decay": axis, "diagonal_segments": unit.diagonal_segments,
                           "kd": list(kd), "vd": list(vd),
                           "decl": list(m.state(st.name).shape)}
    readouts = {}
    for r in plan.output.readouts:
        kd, vd = (states[r.state][x] for x in ("kd", "vd"))
        terms = [f"({full(t.proj, kd)}, {full(t.scale, vd) if t.scale is not None else 'None'})"
                 for t in r.terms_ir]
        out.append(f"{I1}_Q[{r.name!r}] = [{', '.join(terms)}]")
        readouts[r.name] = {"state": r.state, "prev": r.prev}
    gate = "None"
    if plan.stabilizer is not None:
        var, _ = em(plan.stabilizer.log_gate)
        gate = f"_t({var}).to(_x0.dtype).expand(_B, _T, _H)"
    out.append(f'{I1}return {{"K": _K, "V": _V, "g": _g, "Q": _Q, "L": _L, "R": _R, "Lc": _Lc, "Sys": _Sys, "gate": {gate}}}')
    pieces = lines + em.lines + out

    # the combine, over the readouts (and m)
    lines, env, scalars = _env_lines(plan)
    for r in plan.output.readouts:
        vd = tuple(states[r.state]["vd"])
        env[r.name] = (f"_r[{r.name!r}]", vd)
    combine_ir = plan.output.combine_ir
    if plan.stabilizer is not None:     # _mstab: (m_t, m_{t-1}) per token, the scales of S~_t, S~_{t-1}
        lines.append(f"{I1}_mstab, _mstab_prev = _mstab")
        env["_m"] = ("_mstab", ())
        env["_mp"] = ("_mstab_prev", ())
        combine_ir = plan.stabilizer.combine_ir
    cem = TorchEmitter(m, env, scalars, indent=I1, prefix="_c")
    var, have = cem(combine_ir)
    want = canon(order, m.output.expr.shape)
    value = cem.expand(var, have, want)
    combine = lines + cem.lines + [
        f"{I1}return _t({value}).to(_x0.dtype).expand(_B, _T, _H, {', '.join(f'_sizes[{d!r}]' for d in want)})"
        if want else f"{I1}return _t({value}).to(_x0.dtype).expand(_B, _T, _H)"]
    decays, decay_inputs = _log_decay_lines(plan, chunk, order)
    return {
        "log_decays": "\n".join(decays),
        "log_decay_inputs": repr(decay_inputs),
        "states": pprint.pformat(states, width=100, sort_dicts=False),
        "readouts": pprint.pformat(readouts, width=100, sort_dicts=False),
        "systems": pprint.pformat(systems, width=100, sort_dicts=False),
        "stabilized": repr(tuple(plan.stabilizer.states) if plan.stabilizer is not None else ()),
        "pieces": "\n".join(pieces),
        "combine": "\n".join(combine),
    }


def _log_decay_lines(plan: Plan, chunk: ChunkCode, order) -> tuple[list[str], tuple[str, ...]]:
    """The body of torch_log_decays: per state its log decay g alone (what a segmented walk's
    summaries read, mixc/standalone/segments.py), in the dtype it is computed in (no cast to the
    inputs' dtype: mamba2's softplus(dt + dt_bias) * A stays float32 as the kernels compute it),
    and the inputs it reads. Only the loads g uses are printed, so a caller passes those inputs
    alone (no copy of q, k or v is made)."""
    lines, env, scalars = _env_lines(plan)
    em = TorchEmitter(plan.ir, env, scalars, indent=I1, prefix="_p")
    out = [f"{I1}_g = {{}}"]
    for st in chunk.states:
        kd, vd = canon(order, st.key_dims), canon(order, st.value_dims)
        axis, expr = classes.unit(st.transition).decay_axis(st), st.ir_pieces.log_decay
        if axis is None or expr is None:
            g = "None"
        elif axis == "scalar":
            g = f"_t({em(expr)[0]}).expand(_B, _T, _H)"
        elif axis in ("key", "value"):
            dims = kd if axis == "key" else vd
            var, have = em(expr)
            g = f"_full({em.expand(var, have, dims)}, _B, _T, _H, {_sizes(dims)})"
        else:                                     # per element: not summarized (segments.py refuses it)
            g = "None"
        out.append(f"{I1}_g[{st.name!r}] = {g}")
    out.append(f"{I1}return _g")
    body = em.lines + out
    used = "\n".join(body)
    kept, inputs = [], []
    names = {d.name for d in plan.ir.inputs}
    for line in lines:
        m = re.match(r"\s*v_(\w+) = ", line)
        if m is None or re.search(rf"\bv_{m.group(1)}\b", used):
            kept.append(line)
            if m is not None and m.group(1) in names:
                inputs.append(m.group(1))
    if "_head" not in used:
        kept = [ln for ln in kept if not ln.lstrip().startswith(f"{I1.strip()}_head") and "_head =" not in ln]
    return kept + body, tuple(inputs)

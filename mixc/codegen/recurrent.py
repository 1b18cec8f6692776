"""The fused recurrent forward kernel: one program per (sequence, head), states in registers,
tokens in order. It is also the decode step (T = 1 with a state in and out). The template
(templates/recurrent_fwd.py.j2) is plain Triton; this module fills its hooks from the IR."""
from __future__ import annotations

from ..derive.plan import Plan
from ..dsl import ir
from .triton_expr import Emitter, canon, expand


def _offsets(decl_dims: tuple[str, ...], order: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """Offsets of a block laid out in declared order, as a block in canonical order."""
    cd = canon(order, decl_dims)
    terms = []
    for i, d in enumerate(decl_dims):
        stride = " * ".join(f"_size_{x}" for x in decl_dims[i + 1:])
        term = expand(f"_offs_{d}", (d,), cd)
        terms.append(f"{term} * {stride}" if stride else term)
    return " + ".join(terms), cd


def _numel(dims) -> str:
    return " * ".join(f"_size_{d}" for d in dims) or "1"


def _mask(dims: tuple[str, ...]) -> str:
    return " & ".join(expand(f"_mask_{d}", (d,), dims) for d in dims) or "True"


def _load(ptr: str, base: str, decl: tuple[str, ...], order, indent: str, var: str) -> list[str]:
    if not decl:
        return [f"{indent}{var} = tl.load({ptr} + {base}).to(tl.float32)"]
    offs, cd = _offsets(decl, order)
    return [f"{indent}{var} = tl.load({ptr} + {base} * {_numel(decl)} + {offs}, mask={_mask(cd)}, "
            f"other=0.0).to(tl.float32)"]


def _store(ptr: str, base: str, decl: tuple[str, ...], order, indent: str, value: str, cast: str = "") -> list[str]:
    if not decl:
        return [f"{indent}tl.store({ptr} + {base}, {value}{cast})"]
    offs, cd = _offsets(decl, order)
    return [f"{indent}tl.store({ptr} + {base} * {_numel(decl)} + {offs}, {value}{cast}, mask={_mask(cd)})"]


def recurrent_hooks(plan: Plan) -> dict[str, object]:
    """Values for the template's hooks and names."""
    m: ir.MixerIR = plan.ir
    order = m.dim_names
    I1, I2, I3 = "    ", "        ", "            "
    env: dict[str, tuple[str, tuple[str, ...]]] = {}

    params = []
    for d in m.params:
        params += _load(f"p_{d.name}", "i_h", d.shape, order, I1, f"v_{d.name}")
        env[d.name] = (f"v_{d.name}", canon(order, d.shape))
    for o in m.options:
        if o.kind == "float":
            env[o.name] = (f"v_{o.name}", ())

    init = []
    for s in m.states:
        cs = canon(order, s.shape)
        zeros = f"tl.zeros([{', '.join(f'_BLOCK_{d}' for d in cs)}], dtype=tl.float32)" if cs else "_head_f * 0.0"
        init.append(f"{I1}s_{s.name} = {zeros}")
        init.append(f"{I1}if USE_INITIAL_STATE:")
        init += _load(f"p_init_{s.name}", "(i_n * H + i_h)", s.shape, order, I2, f"s_{s.name}")

    loads = []
    for d in m.inputs:
        loads += _load(f"p_{d.name}", "_row", d.shape, order, I2, f"v_{d.name}")
        env[d.name] = (f"v_{d.name}", canon(order, d.shape))

    lets = Emitter(m, env, indent=I2, prefix="_l")
    for let in m.lets:
        env[let.name] = lets(let.expr)
        lets.env[let.name] = env[let.name]

    upd_env = dict(env)
    for s in m.states:
        upd_env[s.name] = upd_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
    upd = Emitter(m, upd_env, indent=I2, prefix="_u")
    new = {}
    for u in m.updates:
        var, dims = upd(u.expr)
        want = canon(order, m.state(u.state).shape)
        assert set(dims) == set(want)
        new[u.state] = var
    out_env = dict(env)
    for s in m.states:
        out_env["prev " + s.name] = (f"s_{s.name}", canon(order, s.shape))
        out_env[s.name] = (new[s.name], canon(order, s.shape))
    out = Emitter(m, out_env, indent=I2, prefix="_o")
    o_var, o_dims = out(m.output.expr)
    o_shape = m.output.expr.shape
    o_lines = out.lines + _store("p_out", "_row", o_shape, order, I2, expand(o_var, o_dims, canon(order, o_shape)),
                                 ".to(p_out.dtype.element_ty)")
    # the states advance after the output has read both the old and the new ones
    assign = [f"{I2}s_{s} = {v}" for s, v in new.items()]

    store = []
    for s in m.states:
        store += _store(f"p_final_{s.name}", "(i_n * H + i_h)", s.shape, order, I2, f"s_{s.name}")

    return {
        "inputs": [d.name for d in m.inputs],
        "params": [d.name for d in m.params],
        "options": [o.name for o in m.options if o.kind == "float"],
        "states": [s.name for s in m.states],
        "dims": list(order),
        "load_params": "\n".join(params) or f"{I1}pass",
        "init_states": "\n".join(init),
        "load_inputs": "\n".join(loads),
        "lets": "\n".join(lets.lines) or f"{I2}pass",
        "updates": "\n".join(upd.lines),
        "output": "\n".join(o_lines + assign),
        "store_states": "\n".join(store),
    }

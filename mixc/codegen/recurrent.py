"""Text helpers of the chunked kernels' templates (codegen/chunk.py, chunk_bwd.py): loads of
named-dim blocks, the params and grouped heads every kernel opens with. The fused
recurrent kernels are built as kernel IR instead (recurrent_ir.py, recurrent_bwd_ir.py); these
helpers go when the chunked kernels do too (docs/design-notes.md, "Kernel IR")."""
from __future__ import annotations

from ..derive.plan import Plan
from .triton_expr import canon, expand

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


def zeros(dims: tuple[str, ...]) -> str:
    return f"tl.zeros([{', '.join(f'_BLOCK_{d}' for d in dims)}], dtype=tl.float32)" if dims else "_fhead * 0.0"


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

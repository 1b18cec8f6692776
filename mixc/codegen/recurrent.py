"""Text helpers of the chunked kernels' templates (codegen/chunk.py, chunk_bwd.py): sizes, zeros,
an input's row, and the hooks every chunked kernel shares (its params and grouped heads, built
as kernel IR and printed). The fused recurrent kernels are built as kernel IR throughout
(recurrent_ir.py, recurrent_bwd_ir.py); these helpers go when the chunked kernels are too
(docs/design-notes.md, "Kernel IR")."""
from __future__ import annotations

from ..derive.plan import Plan
from .kir import printer
from .recurrent_ir import params_and_heads

I1, I2, I3 = "    ", "        ", "            "


def numel(dims) -> str:
    return " * ".join(f"_size_{d}" for d in dims) or "1"


def zeros(dims: tuple[str, ...]) -> str:
    return f"tl.zeros([{', '.join(f'_BLOCK_{d}' for d in dims)}], dtype=tl.float32)" if dims else "_fhead * 0.0"


def input_row(name: str, token: str) -> str:
    """The row of an input at a token (or a block of tokens): [B, T, H_x, *dims] read at head
    _head_x of its _heads_x (common_hooks; H and i_h where it has every head)."""
    return f"({token} * _heads_{name} + _head_{name})"


def common_hooks(plan: Plan) -> dict[str, object]:
    """What the chunked templates share: the dims, the tile and split dims, and the params and
    grouped heads, built as kernel IR and printed by its printer (recurrent_ir.params_and_heads)."""
    # the arguments are not hooks: plan.layout.kernel_args (standalone/kernel_args.py)
    return {
        "dims": list(plan.kernel_ir.dim_names),
        "tile": plan.layout.tile,
        "split": plan.layout.split,
        "load_params": "\n".join(printer.block(params_and_heads(plan), I1, comments=False)),
    }

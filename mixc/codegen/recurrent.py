"""Text helpers of the chunked kernels' hooks (codegen/chunk.py, chunk_bwd.py): sizes, zeros,
an input's row. The fused recurrent kernels are built as kernel IR throughout (recurrent_ir.py,
recurrent_bwd_ir.py), the chunked kernels' scaffolding too (chunk_ir.py); these helpers go when
the hooks' texts are (docs/design-notes.md, "Kernel IR")."""
from __future__ import annotations

I1, I2, I3 = "    ", "        ", "            "


def numel(dims) -> str:
    return " * ".join(f"_size_{d}" for d in dims) or "1"


def zeros(dims: tuple[str, ...]) -> str:
    return f"tl.zeros([{', '.join(f'_BLOCK_{d}' for d in dims)}], dtype=tl.float32)" if dims else "_fhead * 0.0"


def input_row(name: str, token: str) -> str:
    """The row of an input at a token (or a block of tokens): [B, T, H_x, *dims] read at head
    _head_x of its _heads_x (recurrent_ir.params_and_heads; H and i_h where it has every head)."""
    return f"({token} * _heads_{name} + _head_{name})"


"""Functions over a dim in the generated kernels: softmax's max and sum over a dim whose block
is padded (M = 5 slots in a block of 8) reduce over the valid lanes only (the max's padding is
-inf, the sum's 0), in the recurrent, step and chunked kernels alike; and the passes that split
a dim into blocks leave the dim a function works over whole (gsa: the tile is V, never M)."""
from __future__ import annotations

import re

from mixc import pipeline
from mixc.codegen.module import generate

MAX_M = re.compile(r"tl\.max\(tl\.where\([^\n]*_mask_M[^\n]*float\('-inf'\)\), axis=\d\)")
SUM_M = re.compile(r"tl\.sum\(tl\.where\([^\n]*_mask_M[^\n]*, 0\.0\), axis=\d\)")


def _kernel(src: str, name: str) -> str:
    start = src.index(f"def {name}(")
    nxt = src.find("\n@triton.jit", start)
    return src[start:nxt if nxt > 0 else len(src)]


def test_softmax_reduces_over_valid_slots_only():
    plan = pipeline.compile("gsa")
    src = generate(plan)
    for kernel in ("gsa_recurrent_fwd", "gsa_chunk_fwd_fused", "gsa_chunk_fwd_output"):
        body = _kernel(src, kernel)
        assert MAX_M.search(body), f"{kernel}: no masked max over M"
        assert SUM_M.search(body), f"{kernel}: no masked sum over M"


def test_no_pass_splits_the_softmax_dim():
    plan = pipeline.compile("gsa")
    assert plan.layout.tile == "V" and plan.layout.split is None
    src = generate(plan)
    assert "# the tile loop split (codegen/tile_split.py)" in _kernel(src, "gsa_chunk_bwd_tiles")

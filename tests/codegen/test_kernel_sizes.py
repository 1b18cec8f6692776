"""Issue 31's must-hold on the generated modules: one kernel per stage and variant the launcher
picks (no constexpr branch chooses among variants), each at most MAX_LINES long and under its
header (which kernel, the variant, the classes, the notation)."""
from __future__ import annotations

import re

from mixc import pipeline
from mixc.codegen.module import generate
from mixc.dsl import library_names

# The honest numbers reached (docs/design-notes.md, "One kernel per variant"): the largest
# kernels are backward walks and tile loops written out by the class macros and the spec's
# adjoint (gated_delta_product's fused backward, 431 lines with the segmented walk's arguments;
# based's walk, 420); the output
# kernel walking chunks with its state in static key blocks (key_walk.py: the chunk body once per
# block, up to 8) is the exception, at 563 lines for rwkv6, until the key blocks are a loop of
# kernel IR over the class macros as IR.
MAX_LINES = 440
MAX_STATIC_WALK = 580
SWITCHES = re.compile(r"^\s*(if|elif) (.* and )?(CKPT_EVERY (==|>)|STAGED_INTRA|KEY_BLOCK <)")


def _kernels(src: str):
    """(name, header lines, body lines) of each @triton.jit kernel but the helpers (_mixc_*)."""
    lines = src.split("\n")
    for i, line in enumerate(lines):
        if line == "@triton.jit" and not lines[i + 1].startswith("def _mixc_"):
            name = lines[i + 1][4:].split("(")[0]
            j = i
            while j > 0 and lines[j - 1].startswith("#"):
                j -= 1
            end = i + 2
            while end < len(lines) and (not lines[end] or lines[end][0] in " )"):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            yield name, lines[j:i], lines[i + 1:end]


def test_every_kernel_is_short_and_has_its_header():
    sizes = {}
    for spec in library_names():
        plan = pipeline.compile(spec)
        if plan.sequence is not None:
            continue
        for name, header, body in _kernels(generate(plan)):
            sizes[name] = len(body)
            assert header and header[0].startswith(f"# ---- {name}: "), (name, header[:1])
            assert any(h.startswith("# notation: ") for h in header), name
            if name.endswith(("_output", "_rewalk", "_staged", "_keyblocks", "_intra", "_tiles")) and "_chunk_" in name:
                assert any(h.startswith("# variant: ") for h in header), name
            switches = [ln for ln in body if SWITCHES.match(ln)]
            assert not switches, (name, switches[:2])
            limit = MAX_STATIC_WALK if name.endswith("_output_rewalk_staged_keyblocks") else MAX_LINES
            assert len(body) <= limit, (name, len(body))
    big = sorted(sizes.items(), key=lambda x: -x[1])[:3]
    print("largest kernels:", big)
    assert max(n for k, n in sizes.items() if not k.endswith("_rewalk_staged_keyblocks")) > MAX_LINES - 20   # honest N

"""The backward tiles kernel's tile loop split (mixc/codegen/tile_split.py): where it applies,
what lands inside and outside the loop, and its refusals. The split kernels' numbers are checked
against float64 by every chunked spec's two-launch tests (tests/ops/test_kernel_shapes.py runs
the tiles kernel over three tile blocks) and tests/runtime/test_backward_split.py (non-finite
values)."""
from __future__ import annotations

import ast
import textwrap

import pytest

from mixc import pipeline
from mixc.codegen.module import generate, metadata
from mixc.dsl import library_names
from mixc.codegen.block_shapes import Shapes, UnknownShape
from mixc.codegen.block_split import split_iteration
from mixc.codegen.block_statements import _block
from mixc.codegen.tile_split import split_tiles

SPLIT_NOTE = "# the tile loop split (codegen/tile_split.py)"
KEPT_NOTE = "# the walk's tile loop kept"


def _chunked_library_specs():
    out = []
    for name in library_names():
        plan = pipeline.compile(name)
        if plan.sequence is None and "chunk_bwd" in metadata(plan)["kernels"] and plan.layout.tile is not None:
            out.append(name)
    return out


def _kernel(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)


def _split_body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The tiles kernel's chunk body as the tile split made it (past the key blocks' branch,
    tests/codegen/test_key_split.py: its else)."""
    chunk_loop = next(n for n in fn.body if isinstance(n, ast.For) and n.target.id == "_cc")
    first = chunk_loop.body[0]
    if isinstance(first, ast.If) and "KEY_BLOCK <" in ast.unparse(first.test):
        return first.orelse
    return chunk_loop.body


def test_every_chunked_library_spec_is_split():
    """Every library spec with a chunked backward and a tile dim gets the split tiles kernel (none
    keeps the rendered loop): the eight issue 16 measures among them."""
    names = _chunked_library_specs()
    assert {"simple_gla", "gla", "rwkv6", "delta_rule", "gated_delta_rule", "mamba2", "retention",
            "linear_attn"} <= set(names)
    sources = {n: generate(pipeline.compile(n)) for n in names}
    assert [n for n, s in sources.items() if SPLIT_NOTE not in s or KEPT_NOTE in s] == []


def test_simple_gla_loop_holds_only_what_carries_the_block():
    """simple_gla: q, k and g are loaded before and after the loop, never in it; the loop loads
    V's block, dO's, S0's and dL/dS's, adds the four contractions over V (dO V^T, dO S0^T,
    V dh^T, sum(S0 * dh)) and stores dv; dq, dk, dg are stored once, after the loop."""
    src = generate(pipeline.compile("simple_gla"))
    body = _split_body(_kernel(src, "simple_gla_chunk_bwd_tiles"))
    loop = next(n for n in body if isinstance(n, ast.For) and n.target.id == "_tv")
    before = body[:body.index(loop)]
    after = body[body.index(loop) + 1:]
    loop_text = "\n".join(ast.unparse(s) for s in loop.body)
    for x in ("p_q", "p_k", "p_g", "p_dq", "p_dk", "p_dg"):
        assert x not in loop_text, x
    for x in ("p_v", "p_do", "p_ckpt_S", "p_dh_S", "p_dv"):
        assert x in loop_text, x
    sums = [ast.unparse(s.target) for s in loop.body if isinstance(s, ast.AugAssign)]
    assert set(sums) == {"_dA_sum", "_Gq_sum", "_dKw_sum", "_dbl_S_sum"} and len(sums) == 4
    after_text = "\n".join(ast.unparse(s) for s in after)
    for x in ("p_dq", "p_dk", "p_dg", "p_q", "p_k"):
        assert x in after_text, x
    assert any(isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "_dA_sum" for s in before)
    # the walks keep the rendered loop: the chunk's body inside it
    for stage in ("walk", "fused"):
        walk = _kernel(src, f"simple_gla_chunk_bwd_{stage}")
        chunk_loop = next(n for n in walk.body if isinstance(n, ast.For) and n.target.id == "_cc")
        tiles = [s for s in chunk_loop.body if isinstance(s, ast.For) and s.target.id == "_tv"]
        assert len(tiles) == 1 and "tl.load(p_q" in ast.unparse(tiles[0]), stage


def _iteration(text: str):
    return _block(textwrap.dedent(text))


def test_split_iteration_sums_a_contraction_and_finishes_after():
    """A toy iteration: g lacks the block, the product with dO contracts it; the scale by a
    block-free value happens once after the loop."""
    body = _iteration("""
        _offs_V = _tv * _BLOCK_V + tl.arange(0, _BLOCK_V)
        a = tl.load(p_a + _offs__T)
        x = tl.load(p_x + _offs__T[:, None] * 8 + _offs_V[None, :])
        _do = tl.load(p_do + _offs__T[:, None] * 8 + _offs_V[None, :])
        c = tl.sum(_do * x, axis=1) * tl.exp(a)
        _sum_dx = _sum_dx + c
        tl.store(p_dx + _offs__T[:, None] * 8 + _offs_V[None, :], _do * a[:, None])
        tl.store(p_da + _offs__T, _sum_dx)
    """)
    shapes = Shapes({"_offs__T": ("_BLOCK__T",), "_sum_dx": ("_BLOCK__T",), "_tv": (), "_BLOCK_V": (), "p_a": (), "p_x": (),
                     "p_do": (), "p_dx": (), "p_da": ()})
    sp = split_iteration(body, tile="V", shapes=shapes, outer=set(shapes.env), cotangents={"_do"})
    assert "a = tl.load(p_a + _offs__T)" in sp.before
    assert any(x.startswith("c_sum += tl.sum(_do * x, axis=1)") for x in sp.loop)
    assert "c = c_sum * tl.exp(a)" in sp.after
    assert sp.after[-1].startswith("tl.store(p_da")
    assert any(x.startswith("tl.store(p_dx") for x in sp.loop)


def test_a_forward_reduction_over_the_block_stays_per_block():
    """A max over the block (a forward value, no cotangent): what reads it is added per block
    in the loop, as rendered (the sum over blocks of per-block terms), never hoisted."""
    body = _iteration("""
        _offs_V = _tv * _BLOCK_V + tl.arange(0, _BLOCK_V)
        x = tl.load(p_x + _offs__T[:, None] * 8 + _offs_V[None, :])
        _do = tl.load(p_do + _offs__T[:, None] * 8 + _offs_V[None, :])
        m = tl.max(x, axis=1)
        c = tl.sum(_do * x, axis=1) * m
        _sum_dx = _sum_dx + c
        tl.store(p_da + _offs__T, _sum_dx)
    """)
    shapes = Shapes({"_offs__T": ("_BLOCK__T",), "_sum_dx": ("_BLOCK__T",), "_tv": (), "_BLOCK_V": (), "p_x": (), "p_do": (),
                     "p_da": ()})
    sp = split_iteration(body, tile="V", shapes=shapes, outer=set(shapes.env), cotangents={"_do"})
    assert "_sum_dx = _sum_dx + c" in sp.loop and "c = tl.sum(_do * x, axis=1) * m" in sp.loop
    assert not any("_sum +=" in x for x in sp.loop)


def test_an_unknown_construct_keeps_the_rendered_loop():
    """Where the pass cannot read a statement's shape, the kernel keeps its loop and says why."""
    src = textwrap.dedent("""
        @triton.jit
        def k_chunk_bwd_tiles(p_x, p_dx, _BLOCK_V: tl.constexpr):
            _offs__T = tl.arange(0, 16)
            for _cc in range(0, 2):
                _rows = _offs__T + _cc
                for _tv in range(0, 2):
                    _offs_V = _tv * _BLOCK_V + tl.arange(0, _BLOCK_V)
                    x = tl.load(p_x + _rows[:, None] * 8 + _offs_V[None, :])
                    y = tl.mystery(x)
                    tl.store(p_dx + _rows[:, None] * 8 + _offs_V[None, :], y)
    """)
    out, keyed = split_tiles(src, "k_chunk_bwd_tiles", "V", {"_do"})
    assert keyed is None
    assert KEPT_NOTE in out and "no shape rule for tl.mystery" in out
    assert out.replace(next(ln for ln in out.splitlines() if KEPT_NOTE in ln) + "\n", "") == src


def test_shapes_refuse_blocks_that_do_not_broadcast():
    shapes = Shapes({"a": ("_BLOCK_K",), "b": ("_BLOCK_V",)})
    with pytest.raises(UnknownShape):
        shapes.of(ast.parse("a + b", mode="eval").body)
    aliased = Shapes({"a": ("_BLOCK_K",), "b": ("_BLOCK_J",)}, {"J": "K"})
    aliased.env["b"] = (aliased.canon("_BLOCK_J"),)
    assert aliased.of(ast.parse("a + b", mode="eval").body) == ("_BLOCK_K",)


def test_ssa_gives_each_assignment_its_own_name_and_keeps_sums():
    """A name assigned twice gets a fresh name for the second (and the reads after it follow);
    `x = x + ...` adds to the sum the latest tl.zeros began, and to one from outside the body."""
    from mixc.codegen.block_split import _ssa
    stmts = _ssa(_iteration("""
        a = tl.zeros([_BLOCK__T], dtype=tl.float32)
        a = tl.zeros([_BLOCK__T], dtype=tl.float32)
        a = a + b
        c = a * 2.0
        c = c + 1.0
        dp_x = dp_x + c
    """), {"b", "dp_x"})
    assert [s.src for s in stmts] == [
        "a = tl.zeros([_BLOCK__T], dtype=tl.float32)", "a__2 = tl.zeros([_BLOCK__T], dtype=tl.float32)",
        "a__2 = a__2 + b", "c = a__2 * 2.0", "c__2 = c + 1.0", "dp_x = dp_x + c__2"]
    assert [s.kind for s in stmts] == ["", "", "ACC", "", "", "ACC"]


@pytest.mark.parametrize("test,want", [
    ("CKPT_EVERY == 2", True), ("CKPT_EVERY != 1", True), ("CKPT_EVERY < 2", False),
    ("CKPT_EVERY >= 2 and CKPT_EVERY != 4", True), ("not CKPT_EVERY == 2", False),
    ("CKPT_EVERY == 2 or IS_VARLEN", True), ("CKPT_EVERY == 4 and IS_VARLEN", False),
    ("CKPT_EVERY == 2 and IS_VARLEN", None), ("CKPT_EVERY.bit_length() == 2", None)])
def test_constexpr_tests_fold_without_running_the_kernels_text(test, want):
    """`if CKPT_EVERY ...:` folds to the branch a launch takes only where the test is the
    constexpr against integers (an `and` / `or` that one such operand decides is decided)."""
    from mixc.codegen.block_statements import _constexpr_test
    assert _constexpr_test(ast.parse(test, mode="eval").body, {"CKPT_EVERY": 2}) is want

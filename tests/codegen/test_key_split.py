"""The chunked forward's intra and output kernels over the key dim's blocks (mixc/codegen/key_split.py):
where it applies, what lands inside and outside the loop, and its refusals. The split kernels'
numbers against float64: tests/runtime/test_key_split.py (three key blocks, five specs)."""
from __future__ import annotations

import ast
import re
import textwrap

import pytest

from mixc import pipeline
from mixc.codegen.block_shapes import Shapes
from mixc.codegen.block_split import split_iteration
from mixc.codegen.block_statements import NoSplit, _block
from mixc.codegen.key_split import key_dim
from mixc.codegen.module import generate, metadata
from mixc.dsl import library_names

SPLIT = "# the key dim in blocks of KEY_BLOCK (codegen/key_split.py)"
KEPT = "# the whole key dim kept (codegen/key_split.py"


def _chunk_loop(fn: ast.FunctionDef) -> ast.For:
    """A forward kernel's chunk loop (with its key loops in a _keyblocks variant)."""
    for n in fn.body:
        if isinstance(n, ast.For) and n.target.id == "_chunk":
            return n
    raise AssertionError(f"{fn.name}: no chunk loop")


def _kernel(src: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)


def _branch(name: str, kernel: str) -> ast.For:
    """The chunk loop of the spec's forward kernel variant `kernel` (intra_keyblocks ...): the
    key split's before, key loop and after."""
    fn = _kernel(generate(pipeline.compile(name)), f"{name}_chunk_fwd_{kernel}")
    return _chunk_loop(fn)


def _parts(branch: ast.If) -> tuple[str, str, str]:
    loop = next(n for n in branch.body if isinstance(n, ast.For) and n.target.id == "_kb")
    i = branch.body.index(loop)
    return ("\n".join(map(ast.unparse, branch.body[:i])), "\n".join(map(ast.unparse, loop.body)),
            "\n".join(map(ast.unparse, branch.body[i + 1:])))


def test_every_library_spec_with_one_key_dim_is_split():
    """Every chunked library spec whose states share one key dim gets the output kernel's loop (and where
    it stages intra-chunk matrices, the intra kernel's and the output kernel's that computes them, launch.
    STAGE_INTRA or STAGE_SOLVE off, besides the one that reads them): the six issue 16 measures
    among them; gated_delta_product keeps the whole dim (a reduction over its keys is read by
    each key row), and says so."""
    split, kept = [], {}
    for name in library_names():
        plan = pipeline.compile(name)
        if plan.sequence is not None or "chunk_fwd" not in metadata(plan)["kernels"] or key_dim(plan) is None:
            continue
        src = generate(plan)
        n = src.count(SPLIT)
        if n == (3 if plan.layout.intra_matrices else 1) and KEPT not in src:
            split.append(name)
        else:
            kept[name] = next((ln.strip() for ln in src.splitlines() if KEPT in ln), "")
    assert {"simple_gla", "gla", "rwkv6", "delta_rule", "gated_delta_rule", "mamba2"} <= set(split)
    assert set(kept) == {"gated_delta_product"}
    # Triton's loops keep a variable's type: nothing assigned in a key loop (a block) may rebind a
    # name from before the chunk loop (the whole dim's _offs_K, the states)
    for name in split:
        plan = pipeline.compile(name)
        src = generate(plan)
        for stage in ("output", "intra") if plan.layout.intra_matrices else ("output",):
            fn = _kernel(src, f"{name}_chunk_fwd_{stage}_keyblocks")
            at = next(i for i, n in enumerate(fn.body) if isinstance(n, (ast.For, ast.If)) and "_chunk" in ast.unparse(n))
            top = {t.id for n in fn.body[:at] for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            loops = [n for n in ast.walk(_chunk_loop(fn)) if isinstance(n, ast.For) and n.target.id == "_kb"]
            assert loops, (name, stage)
            assigned = {t.id for lp in loops for t in ast.walk(lp) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            assert not assigned & top, (name, stage, assigned & top)
        # no other kernel of the module has a key loop
        others = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name.startswith(f"{name}_chunk_fwd_")
                  and not n.name.endswith("_keyblocks")]
        assert others and not any(isinstance(x, ast.For) and x.target.id == "_kb" for n in others for x in ast.walk(n))
    assert "reduces over the blocks but is read within the loop" in kept["gated_delta_product"]


def test_gla_intra_kernel_sums_A_over_the_key_blocks():
    """gla's intra kernel: q, k and g load per block, both sub-chunk loops add into A, zeroed
    before the loop and stored once after it."""
    branch = _branch("gla", "intra_keyblocks")
    before, loop, after = _parts(branch)
    assert "_A = tl.zeros([_BLOCK__T, _BLOCK__T]" in before
    for x in ("v_q = tl.load(p_q", "v_k = tl.load(p_k", "v_g = tl.load(p_g", "for _I in tl.static_range",
              "for _jj in range(0, 16)", "_offs_K__2 = _kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)"):
        assert x in loop, x
    assert "_A += tl.where(" in loop and "_A += _mixc_dot(" in loop
    assert "tl.store(p_intra" not in loop and "tl.store(_pA, _A" in after
    assert "_BLOCK_K" not in loop


def test_gla_output_kernel_reads_the_state_by_key_block():
    """gla's output kernel (one chunk a program): the state's rows of the block and (Q * exp(b0))
    S0 summed in the loop; A, V and the output after it, from the sum; the whole non-finite test
    NaNs the rows (after), a block's own zeroes nothing here (no key enters its matmuls)."""
    branch = _branch("gla", "output_staged_keyblocks")
    before, loop, after = _parts(branch)
    assert "tl.load(p_ckpt_S" in loop and "_r1_sum += _mixc_dot(" in loop
    assert "_bad_S_sum += tl.sum(" in loop
    assert "v_v = tl.load(p_v" in after and "_A = tl.load(_pA" in after and "_r1 = _r1_sum + _mixc_dot(_A" in after
    assert "tl.store(p_out" in after and "_bad_S = _bad_S_sum" in after
    assert "tl.load(p_q" not in after and "tl.load(p_k" not in after


def _iteration(text: str):
    return _block(textwrap.dedent(text))


SHAPES = {"_offs__T": ("_BLOCK__T",), "_kb": (), "p_x": (), "p_y": (), "p_o": (), "KEY_BLOCK": ()}


def _forward(body):
    shapes = Shapes(dict(SHAPES))
    return split_iteration(body, shapes=shapes, outer=set(shapes.env), cotangents=None, block="KEY_BLOCK",
                           block_var="_kb", flags=frozenset({"_bad"}))


def test_a_norm_over_the_keys_read_per_key_is_refused():
    """x / |x| over the keys: the norm is a sum over every block, but each block's rows read it
    within the loop, where only the block's share exists: no split."""
    body = _iteration("""
        _offs_K = _kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
        x = tl.load(p_x + _offs__T[:, None] * 64 + _offs_K[None, :])
        n = tl.sqrt(tl.sum(x * x, axis=1))
        xn = x / n[:, None]
        o = tl.sum(xn, axis=1)
        tl.store(p_o + _offs__T, o)
    """)
    with pytest.raises(NoSplit, match="read within the loop"):
        _forward(body)


def test_a_flag_is_read_per_block_and_whole_after():
    """A non-finite count (a flag): each block zeroes its rows by its own; after the loop the
    whole count (the sum) NaNs the output rows."""
    body = _iteration("""
        _offs_K = _kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
        x = tl.load(p_x + _offs__T[:, None] * 64 + _offs_K[None, :])
        _bad = tl.sum(tl.where(tl.abs(x) < float('inf'), 0.0, 1.0), axis=1)
        xc = tl.where(_bad[:, None] > 0, 0.0, x)
        o = tl.sum(xc * xc, axis=1)
        tl.store(p_o + _offs__T, tl.where(_bad > 0, float('nan'), o))
    """)
    sp = _forward(body)
    assert "xc = tl.where(_bad[:, None] > 0, 0.0, x)" in sp.loop
    assert "_bad_sum += tl.sum(tl.where(tl.abs(x) < float('inf'), 0.0, 1.0), axis=1)" in sp.loop
    assert "_bad = _bad_sum" in sp.after and "o = o_sum" in sp.after


def test_a_loop_that_does_not_only_add_is_refused():
    """A sub-chunk loop that scales its accumulator (not a sum of contractions) runs per block
    only if nothing after reads it: here the store does, so no split."""
    body = _iteration("""
        _offs_K = _kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
        x = tl.load(p_x + _offs__T[:, None] * 64 + _offs_K[None, :])
        a = tl.zeros([_BLOCK__T, _BLOCK__T], dtype=tl.float32)
        for _i in range(2):
            a = a * 0.5 + tl.dot(x, tl.trans(x))
        tl.store(p_o + _offs__T[:, None] * 16 + _offs__T[None, :], a)
    """)
    with pytest.raises(NoSplit):
        _forward(body)


def test_gla_backward_sums_its_key_rows_in_a_tile_loop_of_their_own():
    """gla's backward tiles kernel where KEY_BLOCK is less than K: no value of the whole key dim.
    A key loop before the tile loop sums the intra-chunk A; the tile loop keeps dv and the
    [C, C] sum dO V^T, with dv's (K * exp(kw)) dL/dS summed in a key loop of its own, not the
    sums that carry the key dim (dO S0^T, V dh^T, sum(S0 * dh)); after it each key block sums
    its rows of those in a tile loop of its own, then stores its rows of dq, dk, dg; the tile
    split alone stays for a launch with the whole key dim (else)."""
    src = generate(pipeline.compile("gla"))
    fn = _kernel(src, "gla_chunk_bwd_tiles_keyblocks")
    branch = next(n for n in fn.body if isinstance(n, ast.For) and n.target.id == "_cc")
    whole = next(n for n in _kernel(src, "gla_chunk_bwd_tiles").body if isinstance(n, ast.For) and n.target.id == "_cc")
    assert [n.target.id for n in whole.body if isinstance(n, ast.For)].count("_tv") == 1
    assert "_BLOCK_K" not in "\n".join(ast.unparse(n) for n in branch.body)
    loops = [n for n in branch.body if isinstance(n, ast.For)]
    assert [n.target.id for n in loops] == ["_kb", "_tv", "_kb"]
    intra, tiles, keys = loops
    assert "_A__2 += " in ast.unparse(intra) and "tl.store" not in ast.unparse(intra)
    tile_src, key_src = ast.unparse(tiles), ast.unparse(keys)
    assert "_dA_sum += " in tile_src and "tl.store(p_dv" in tile_src
    dv_keys = next(n for n in tiles.body if isinstance(n, ast.For))
    assert dv_keys.target.id == "_kb" and "p_dh_S" in ast.unparse(dv_keys) and "tl.store" not in ast.unparse(dv_keys)
    for x in ("_Gq_sum", "_dKw_sum", "_dbl_S_sum", "p_ckpt_S"):
        assert x not in tile_src, x
    inner = next(n for n in keys.body if isinstance(n, ast.For) and n.target.id == "_tvk")
    assert {"_Gq_sum", "_dKw_sum", "_dbl_S_sum"} <= {t.target.id for t in inner.body if isinstance(t, ast.AugAssign)}
    for x in ("tl.store(p_dq", "tl.store(p_dk", "tl.store(p_dg", "_Gq_sum = tl.zeros([_BLOCK__T, KEY_BLOCK]"):
        assert x in key_src, x


@pytest.mark.parametrize("name", ["gla", "rwkv6", "hgrn2", "simple_gla", "retention", "lightning_attn", "mamba2"])
def test_the_backward_key_branch_holds_no_value_of_the_whole_key_dim(name):
    """The six specs whose backward tiles kernel loops over key blocks: A before the tile loop, dv's
    key contraction inside it and dq, dk, dg after it each in a key loop, so no [C, K] block of
    the whole dim is live in the branch (the spills at C = 64 came from those)."""
    src = generate(pipeline.compile(name))
    fn = _kernel(src, f"{name}_chunk_bwd_tiles_keyblocks")
    branch = next(n for n in fn.body if isinstance(n, ast.For) and n.target.id == "_cc")
    body = "\n".join(ast.unparse(n) for n in branch.body)
    assert "# the whole key dim" not in src
    assert [n.target.id for n in branch.body if isinstance(n, ast.For)] == ["_kb", "_tv", "_kb"]
    key = key_dim(pipeline.compile(name))
    # but a param's gradient over the keys (rwkv6's u), whole before the chunk loop: each block
    # adds its entries at its rows
    whole = [ln for ln in body.splitlines() if f"_BLOCK_{key}" in ln]
    assert all(re.fullmatch(rf"\s*(\w+) = \1 \+ _mixc_key_rows\(.*, _BLOCK_{key}\)", ln) for ln in whole), whole
    assert bool(whole) == (name == "rwkv6")


def test_the_key_diagonal_walk_holds_its_state_in_static_key_blocks():
    """The forward output kernel walking several chunks (CKPT_EVERY > 1): the key-diagonal decay's
    specs (its class's walks_key_blocks) hold the state as one carried block per key block,
    under a constexpr test each past the first, and no value of the whole key dim in the chunk
    loop; the other classes keep the rendered walk (the scalar decay's fits whole: mamba2's
    static walk spilled 12 B on sm_90, its whole one none)."""
    walks = set()
    for name in library_names():
        plan = pipeline.compile(name)
        if plan.sequence is not None or "chunk_fwd" not in metadata(plan)["kernels"]:
            continue
        src = generate(plan)
        if f"def {name}_chunk_fwd_output_rewalk_staged_keyblocks(" not in src:
            continue
        branch = _kernel(src, f"{name}_chunk_fwd_output_rewalk_staged_keyblocks")
        walks.add(name)
        key = key_dim(plan)
        assert f"tl.static_assert(_BLOCK_{key} <= 8 * KEY_BLOCK)" in ast.unparse(branch)
        chunk_loop = next(n for n in branch.body if isinstance(n, ast.For) and n.target.id == "_chunk")
        loop = ast.unparse(chunk_loop)
        assert f"_BLOCK_{key}" not in loop
        guards = [ast.unparse(n.test) for n in chunk_loop.body if isinstance(n, ast.If)]
        assert guards == [f"{i} * KEY_BLOCK < _size_{key}" for i in range(1, 8)]
        for st in plan.states:
            for i in range(8):
                s = f"s_{st.name}"
                assert f"{s}_k{i} = tl.load(p_ckpt_{st.name}" in ast.unparse(branch), i   # loaded before the chunks ...
                assert re.search(rf"\b{s}_k{i} = {s}__\d+", loop), i                  # ... carried through them
    assert walks == {"gla", "rwkv6", "rwkv5", "hgrn2", "s4d"}

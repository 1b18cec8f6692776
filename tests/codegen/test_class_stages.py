"""The class stages built as kernel IR (codegen/kir/build.py, codegen/chunk_stage.py; the prefix
sum's, the scalar and value-diagonal decays' hooks in mixc/classes): broadcasting by dims, the
matrix product and transpose nodes and their verifier rules, a stage verified against the dims
of what it reads, and the text a stage prints."""
import ast

import pytest

from mixc import classes, pipeline
from mixc.codegen.chunk import ChunkCode
from mixc.codegen.kir import build as b
from mixc.codegen.kir import nodes as K
from mixc.codegen.kir import printer
from mixc.codegen.kir.verify import KirError, verify_block

I, J = b.ROWS, b.KEY_ROWS


def _blk(x, *dims):
    return b.Block(K.Name(x, tuple(dims)))


def test_an_operand_whose_dims_the_other_holds_is_broadcast_to_them():
    e = (_blk("Q", I, "K") * b.exp(_blk("b0", I))).e
    assert e.dims == (I, "K")
    assert printer.expr(e) == "Q * tl.exp(b0)[:, None]"


def test_rows_and_key_rows_broadcast_to_their_union_rows_first():
    # a key vector [j] against a row vector [i]: [i, j], whichever side it stands on
    bq, bk = _blk("bq", I), b.rename(_blk("bk", I), I, J)
    assert printer.expr((bk + bq).e) == "bk[None, :] + bq[:, None]"
    assert (bk + bq).dims == (I, J)
    # and the value axis after both: [i, V] - [j, V] is [i, j, V]
    d = _blk("bq", I, "V") - b.rename(_blk("b", I, "V"), I, J)
    assert d.dims == (I, J, "V")
    assert printer.expr(d.e) == "bq[:, None, :] - b[None, :, :]"


def test_dims_in_orders_no_union_keeps_are_an_error():
    with pytest.raises(ValueError, match=r"cannot broadcast \[K, V\] and \[V, K\]"):
        _blk("x", "K", "V") + _blk("y", "V", "K")


def test_a_product_whose_inner_dims_differ_is_an_error():
    Q, K_ = _blk("Q", I, "K"), _blk("K", I, "K")
    defined = {"Q": ((I, "K"), "f32"), "K": ((I, "K"), "f32"), "DOT": ((), "i32")}
    verify_block([b.let("_A", b.dot(Q, b.trans(b.rename(K_, I, J))).e)], defined)       # [i, K] @ [K, j]
    with pytest.raises(KirError, match=r"a matrix product of \[_T, K\] and \[_T, K\]"):
        verify_block([b.let("_A", b.dot(Q, K_).e)], defined)
    with pytest.raises(KirError, match=r"a matrix product of \[_T, K\] and \[K, _T\]"):
        verify_block([b.let("_A", b.dot(Q, b.trans(K_)).e)], defined)     # [i, i]: the key rows not renamed
    with pytest.raises(KirError, match="transposes"):
        verify_block([b.let("_t", b.trans(_blk("v", I)).e)], {"v": ((I,), "f32")})


def test_a_product_reads_the_dot_precision():
    with pytest.raises(KirError, match="reads DOT"):
        verify_block([b.let("_A", b.dot(_blk("Q", I, "K"), _blk("S", "K", "V")).e)],
                     {"Q": ((I, "K"), "f32"), "S": (("K", "V"), "f32")})


def test_a_renamed_or_full_reduction_prints_with_its_operands_binding():
    x = _blk("a", I) + _blk("c", I)
    assert printer.expr((-b.rename(x, I, J)).e) == "-(a + c)"
    assert printer.expr(b.sum(_blk("s", "K", "V") * _blk("d", "K", "V")).e) == "tl.sum(s * d)"
    assert b.sum(_blk("s", "K", "V")).dims == ()


def _text(lines):
    """The stage's lines without their indent and shape comments (`  # [_T, K]`)."""
    return [x.split("  # ")[0].strip() for x in lines]


def _code(spec):
    code = ChunkCode(pipeline.compile(spec))
    code.forward_body()             # names the chunk's per-state decay axes (g_axes)
    return code, code.states[0]


def test_a_stage_is_verified_against_the_dims_of_what_it_reads():
    code, st = _code("linear_attn")
    k = code.builder(st)
    Q, V = k.block("_q", "i", "K"), k.block("_v", "i", "V")
    k.let("_x", k.dot(Q, k.state()), "i", "V")               # [i, K] @ [K, V]
    k.let("_y", V * k.block("_x", "i", "V"), "i", "V")
    assert k.lines() == [f"{code.indent}_x = _mixc_dot(_q, s_S, DOT)  # [_T, V]", f"{code.indent}_y = _v * _x  # [_T, V]"]
    k = code.builder(st)
    with pytest.raises(KirError, match=r"_x = _q\[:, :, None\] \+ _v\[:, None, :\]: a block \[_T, K, V\], "
                                       r"the stage makes \[_T, K\]"):
        k.let("_x", k.block("_q", "i", "K") + k.block("_v", "i", "V"), "i", "K")     # K and V: different axes
    k = code.builder(st)
    k.let("_x", k.block("_q", "i", "K"), "i", "K")
    k.let("_x", k.block("_v", "i", "V"), "i", "V")            # a re-assignment with other dims: the verifier's
    with pytest.raises(KirError, match=r"re-assigns _x as \[_T, V\]"):
        k.lines()
    k = code.builder(st)
    k.block("_q", "i", "K")
    with pytest.raises(KirError, match=r"_q is read as \[_T, V\], elsewhere as \[_T, K\]"):
        k.block("_q", "i", "V")


def test_the_prefix_sums_readout_prints_the_triton_it_is():
    code, st = _code("linear_attn")
    lines = classes.unit(st.transition).chunk_readout(code, st, "_r", "_q", "_Kc_S", "_Vc_S", prev=True)
    assert _text(lines) == [
        "_A = tl.where(_offs__T[:, None] > _offs__T[None, :], _mixc_dot(_q, tl.trans(_Kc_S), DOT), 0.0)",
        "_r = _mixc_dot(_q, s_S, DOT) + _mixc_dot(_A, _Vc_S, DOT)"]


@pytest.mark.parametrize("spec", ["simple_gla", "mlstm", "hgrn", "linear_attn", "gla", "rwkv6", "gated_delta_rule",
                                  "kda", "rwkv7", "gated_delta_product", "mamba3"])
def test_every_stage_of_a_class_built_as_ir_is_valid_triton(spec):
    """Each hook of the class (forward and backward) gives lines that parse as Python, named in
    the generated kernel by the class's module (every class with chunked kernels builds them)."""
    src = pipeline.render(pipeline.compile(spec))
    unit = classes.unit(pipeline.compile(spec).states[0].transition)
    assert unit.stages_file == type(unit).__module__.rpartition(".")[2] + ".py"
    for stage in ("readout", "advance", "readout_backward", "advance_backward") + (
            ("setup", "setup_backward") if unit.stages_solve else ()):
        assert f"{stage} (mixc/classes/{unit.stages_file})" in src
    ast.parse(src)


def test_a_name_the_stage_made_is_read_with_the_dims_it_made():
    code, st = _code("linear_attn")
    k = code.builder(st)
    k.let("_x", k.dot(k.block("_q", "i", "K"), k.state()), "i", "V")
    assert k.block("_x", "i", "V").dims == ("_T", "V")
    with pytest.raises(KirError, match=r"_x is read as \[_T, K\], elsewhere as \[_T, V\]"):
        k.block("_x", "i", "K")


# ---- the key-diagonal decay's pieces: loops, sums into a name, blocks shaped at run time ----

def test_a_loop_carries_a_sum_into_a_name_made_before_it():
    code, st = _code("gla")
    k = code.builder(st)
    Q = k.block("_q", "i", "K")
    A = k.let("_A", k.zeros("i", "j"), "i", "j")
    with k.loop("_I", 1, k.rows_block // 16, static=True) as I:
        lq = k.let("_lq", k.where((k.offs // 16).eq(I), Q, 0.0), "i", "K")
        k.acc(A, k.dot(lq, k.trans(k.at_keys(Q))))
    assert _text(k.lines()) == [
        "_A = tl.zeros([_BLOCK__T, _BLOCK__T], dtype=tl.float32)",
        "for _I in tl.static_range(1, _BLOCK__T // 16):",
        "_lq = tl.where((_offs__T // 16 == _I)[:, None], _q, 0.0)",
        "_A += _mixc_dot(_lq, tl.trans(_q), DOT)"]
    k = code.builder(st)
    A = k.let("_A", k.zeros("i", "j"), "i", "j")
    with pytest.raises(KirError, match=r"\[_T, K\] into \[_T, _T'\]"):
        k.acc(A, k.block("_q", "i", "K"))
    with pytest.raises(KirError, match="adds into _B, which nothing defines before it"):
        verify_block([K.Acc("_B", K.Num(1.0))], {})
    k = code.builder(st)
    with k.loop("_jj", 0, 16):
        k.let("_x", k.block("_q", "i", "K"), "i", "K")
    k.let("_y", k.block("_x", "i", "K"), "i", "K")            # made inside the loop, read after it
    with pytest.raises(KirError, match="reads _x, defined inside the loop over _jj"):
        k.lines()


def test_blocks_shaped_like_another_follow_its_shape_at_run_time():
    """The key split shrinks the key dim's block: zeros, gathers and sub-chunk sums over it read
    the shape of a block (x.shape), never _BLOCK_K."""
    code, st = _code("gla")
    k = code.builder(st)
    Kc, V = k.block("_k", "i", "K"), k.block("_v", "i", "V")
    above = k.maximum(k.offs - 1, 0)
    k.let("_z", k.zeros_like(Kc), "i", "K")
    k.let("_Vx", k.rows_at(V, above), "i", "V")
    k.let("_s", k.subchunk_sum(Kc * 2.0, Kc), "i", "K")
    assert _text(k.lines()) == [
        "_z = tl.zeros(_k.shape, dtype=tl.float32)",
        "_Vx = tl.gather(_v, tl.broadcast_to(tl.maximum(_offs__T - 1, 0)[:, None], _v.shape), 0)",
        "_s = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(_k * 2.0, [_BLOCK__T // 16, 16, _k.shape[1]]), "
        "axis=1)[:, None, :], [_BLOCK__T // 16, 16, _k.shape[1]]), _k.shape)"]
    defined = {"_k": ((I, "K"), "f32"), "_v": ((I, "V"), "f32"), "_i": ((I, "K"), "i32"), "_BLOCK__T": ((), "i32")}
    with pytest.raises(KirError, match=r"gathers \[_T, V\] along axis 0 at an index of \[_T, K\]"):
        verify_block([K.Let("_x", K.Gather(K.Name("_v", (I, "V")), K.Name("_i", (I, "K")), 0), (I, "V"))], defined)
    with pytest.raises(KirError, match=r"sums the sub-chunks of \[_T, V\] shaped as _k \[_T, K\]"):
        verify_block([K.Let("_x", K.SubchunkSum(K.Name("_v", (I, "V")), K.Name("_k", (I, "K")), 16), (I, "K"))], defined)


def test_the_staged_intra_matrix_is_stored_by_the_intra_kernel_and_loaded_by_the_staged_output():
    plan = pipeline.compile("gla")
    st = plan.states[0]
    unit = classes.unit(st.transition)
    lines = {}
    for stage, staged in (("intra", False), ("output", True), ("output", False)):
        code = ChunkCode(plan, stage, staged)
        code.forward_body()
        code.staged = True
        lines[stage, staged] = _text(unit.chunk_readout(code, st, "_r", "_q", "_k", "_v", prev=False))
    address = "_pA = p_intra + (_rows[:, None] * H + i_h) * _BLOCK__T + _offs__T[None, :]"
    assert address in lines["intra", False] and address in lines["output", True]
    assert "tl.store(_pA, _A.to(p_intra.dtype.element_ty), mask=_mask__T[:, None])" in lines["intra", False]
    assert "_A = tl.load(_pA, mask=_mask__T[:, None], other=0.0).to(tl.float32)" in lines["output", True]
    assert not any("for _I" in x for x in lines["output", True])           # read, not computed
    assert any("for _I" in x for x in lines["output", False]) and not any("_pA" in x for x in lines["output", False])


def test_no_class_is_left_without_its_stages():
    """Every class with chunked kernels overrides the four stages (base.py has no default: the
    Jinja macros that were the default are gone), and no class ships a template."""
    from pathlib import Path
    base = classes.base.TransitionClass
    for unit in classes.CLASSES:
        if unit.parallel_form != "chunk":
            continue
        for hook in ("chunk_readout", "chunk_advance", "chunk_readout_backward", "chunk_advance_backward"):
            assert getattr(type(unit), hook) is not getattr(base, hook), (unit.name, hook)
    assert not list(Path(classes.__file__).parent.glob("*.j2"))


def test_the_cumulative_decay_is_built_as_ir_with_its_scan():
    """ChunkCode's cumulative log decay (b, its resets z, the weights b0, bl0, kw) is built with
    the stage builder: tl.cumsum is a Scan over the rows, verified like a reduction."""
    code, st = _code("gla")
    text = _text(code.cumulative_decay(st, "_gk"))
    assert text[0] == "_r_S = _gk == float('-inf')"
    assert "_bh_S = tl.cumsum(_gh_S, axis=0)" in text and text[-1].startswith("_kw_S = tl.where(_z_S < _zl_S[None, :]")
    with pytest.raises(KirError, match=r"scans over V, not a dim of \[_T, K\]"):
        verify_block([K.Let("_c", K.Scan("tl.cumsum", K.Name("_g", (I, "K")), "V"), (I, "K"))], {"_g": ((I, "K"), "f32")})
    assert code.shifted(st, "_b_S", "_bx").split("  # ")[0].strip() == \
        "_bx = tl.sum(tl.where((_offs__T[:, None] - 1 == _offs__T[None, :])[:, :, None], _b_S[None, :, :], 0.0), axis=1)"

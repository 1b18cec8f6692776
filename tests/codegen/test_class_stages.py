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
    assert k.lines() == [f"{code.indent}_x = _mixc_dot(_q, s_S, DOT)", f"{code.indent}_y = _v * _x"]
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
    assert [x.strip() for x in lines] == [
        "_A = tl.where(_offs__T[:, None] > _offs__T[None, :], _mixc_dot(_q, tl.trans(_Kc_S), DOT), 0.0)",
        "_r = _mixc_dot(_q, s_S, DOT) + _mixc_dot(_A, _Vc_S, DOT)"]


@pytest.mark.parametrize("spec", ["simple_gla", "mlstm", "hgrn", "linear_attn"])
def test_every_stage_of_a_class_built_as_ir_is_valid_triton(spec):
    """Each hook of the class (forward and backward) gives lines that parse as Python, named in
    the generated kernel by the class's module, not a template."""
    src = pipeline.render(pipeline.compile(spec))
    unit = classes.unit(pipeline.compile(spec).states[0].transition)
    assert unit.builds_stages and unit.template is None
    for stage in ("readout", "advance", "readout_backward", "advance_backward"):
        assert f"{stage} (mixc/classes/{unit.stages_file})" in src
    ast.parse(src)


def test_a_name_the_stage_made_is_read_with_the_dims_it_made():
    code, st = _code("linear_attn")
    k = code.builder(st)
    k.let("_x", k.dot(k.block("_q", "i", "K"), k.state()), "i", "V")
    assert k.block("_x", "i", "V").dims == ("_T", "V")
    with pytest.raises(KirError, match=r"_x is read as \[_T, K\], elsewhere as \[_T, V\]"):
        k.block("_x", "i", "K")

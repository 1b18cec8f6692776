"""The chunked kernels' scaffolding as kernel IR (codegen/chunk_ir.py): every library spec's
chunked kernels are built as IR and verified, the forward's only text is its chunk body (the
class stages), the states' loads and stores are typed statements (a flat key axis, a scalar
state's two unit axes), and the verifier, printer and passes treat Text and constexpr
branches as documented (kir/verify.py)."""
import ast

import pytest

from mixc import pipeline
from mixc.codegen import chunk_ir, module
from mixc.codegen.kir import nodes as K
from mixc.codegen.kir import passes, printer
from mixc.codegen.kir.verify import KirError, verify
from mixc.codegen.launch_plan import chunk_stages
from mixc.dsl import library_names

CHUNKED = [n for n in library_names("recurrent") if pipeline.compile(n).layout.chunked]
BWD_TEXTS = ["init_grads", "chunk_backward", "store_grads"]


def _texts(k: K.Kernel) -> list[str]:
    return [s.what for s in K.walk_stmts(k.body) if isinstance(s, K.Text)]


@pytest.mark.parametrize("name", CHUNKED)
def test_every_chunked_kernel_is_verified_ir_around_its_hooks_text(name):
    plan = pipeline.compile(name)
    for form in ("chunk_fwd", "chunk_bwd"):
        for stage in chunk_stages(plan, form):
            k = module.chunk_kernel(plan, form, stage)       # verified as built
            assert k.name == f"{name}_{form}_{stage}"
            assert _texts(k) == (["chunk_body"] if form == "chunk_fwd" else BWD_TEXTS), (k.name, _texts(k))
            source = printer.kernel(k)
            ast.parse(source)
            assert source.startswith(f"# ---- {k.name}: ")


def _stmts(k: K.Kernel, kind):
    return [s for s in K.walk_stmts(k.body) if isinstance(s, kind)]


def test_the_forwards_state_io_is_typed_statements():
    plan = pipeline.compile("simple_gla")
    walk = module.chunk_kernel(plan, "chunk_fwd", "walk")
    stores = {s.ptr.id: s for s in _stmts(walk, K.Store)}
    assert set(stores) == {"p_ckpt_S", "p_final_S"}
    # a checkpoint in the buffer's dtype, the final state as float32
    assert isinstance(stores["p_ckpt_S"].value, K.Cast) and stores["p_final_S"].value == K.Name("s_S", ("K", "V"))
    assert all(s.mask.dims == ("K", "V") for s in stores.values())
    output = module.chunk_kernel(plan, "chunk_fwd", "output")
    rewalk = module.chunk_kernel(plan, "chunk_fwd", "output", ("rewalk",))
    # from the checkpoint: one chunk a program, in the chunk loop; the rewalk variant walking
    # CKPT_EVERY chunks, before it; neither branches on CKPT_EVERY
    for k, in_loop in ((output, True), (rewalk, False)):
        loads = [s for s in _stmts(k, K.Let) if s.name == "s_S" and isinstance(s.value, K.Cast)]
        loop = next(s for s in k.body if isinstance(s, K.For) and s.var == "_chunk")
        assert len(loads) == 1 and (loads[0] in K.walk_stmts(loop.body)) == in_loop
        assert "if CKPT_EVERY" not in printer.kernel(k)
    assert [s.name for s in _stmts(output, K.Let) if s.name.startswith("v_")] == ["v_q", "v_k", "v_v", "v_g"]
    v_q = next(s for s in _stmts(output, K.Let) if s.name == "v_q")
    assert v_q.dims == ("_T", "K") and printer.expr(v_q.value).startswith(
        "tl.load(p_q + (_rows[:, None] * _heads_q + _head_q) * _size_K + _offs_K[None, :], "
        "mask=_mask__T[:, None] & _mask_K[None, :], other=0.0)")
    refill = module.chunk_kernel(plan, "chunk_fwd", "refill")
    assert {s.ptr.id for s in _stmts(refill, K.Store)} == {"p_dense_S"}


def test_a_flat_key_axis_and_a_scalar_states_two_unit_axes():
    plan = pipeline.compile("based")
    k = module.chunk_kernel(plan, "chunk_fwd", "fused")
    lets = {}
    for s in _stmts(k, K.Let):
        lets.setdefault(s.name, s)          # the first: the zero state
    s2 = lets["s_s2"]
    assert s2.dims == ("K*J", "V")
    assert printer.expr(s2.value) == "tl.zeros([_BLOCK_K * _BLOCK_J, _BLOCK_V], dtype=tl.float32)"
    assert printer.expr(lets["_fk_s2"].value) == "tl.arange(0, _BLOCK_K * _BLOCK_J)"
    z0 = lets["s_z0"]          # the normalizer without key or value dims: [_1, _1']
    assert z0.dims == ("_1", "_1'")
    assert printer.expr(z0.value) == "tl.zeros([_BLOCK__1, _BLOCK__1], dtype=tl.float32)"
    ckpt = next(s for s in _stmts(k, K.Store) if s.ptr.id == "p_ckpt_z0")
    assert printer.stmt(ckpt)[0].endswith("mask=_mk_z0[:, None] & _mv_z0[None, :])")


# ---- the IR's rules for what the chunked kernels need ----

def _kernel(*body, args=(("IS_VARLEN", True), ("T", False), ("p_b", False))):
    return K.Kernel("k", ("a test kernel",), (K.ArgLine(tuple(
        K.Arg(a, c, "ptr" if a.startswith("p_") else "i32") for a, c in args)),), tuple(body))


def _first(cond_name: str) -> K.If:
    """_first: int64 from a loaded bos in one branch, int32 in the other (chunk_ir.programs)."""
    bos = K.Cast(K.Load(K.Name("p_b"), (K.Num(0),)), K.Const("tl.int64"))
    return K.If(K.Name(cond_name),
                (K.Let("_first", K.BinOp("-", K.Name("T"), bos), (), "i64"),),
                (K.Let("_first", K.BinOp("%", K.Name("T"), K.Num(3)), (), "i32"),))


def test_a_constexpr_branch_may_give_a_name_another_dtype_a_runtime_one_may_not():
    use = K.Let("_x", K.BinOp("+", K.Name("_first"), K.Num(1)), (), "i64")      # lives on as int64
    verify(_kernel(_first("IS_VARLEN"), use))
    with pytest.raises(KirError, match="the branches define _first with different dims or dtypes"):
        verify(_kernel(_first("T")))
    with pytest.raises(KirError, match="declared i32, its value is i64"):
        verify(_kernel(_first("IS_VARLEN"), K.Let("_x", K.Name("_first"), (), "i32")))


def test_text_prints_at_its_place_and_takes_no_passes():
    loop = K.For("_i", K.Num(0), K.Name("T"), (chunk_ir.text("        a = 1\n            b = a\n", "        ", "t"),))
    k = _kernel(loop)
    assert printer.kernel(k).splitlines()[-4:] == ["    for _i in range(0, T):", "        a = 1",
                                                    "            b = a", ""]
    assert passes.run(k, ()) is k
    with pytest.raises(ValueError, match="holds text made outside the IR: it takes no passes"):
        passes.run(k, (passes.DEAD_LETS,))
    with pytest.raises(AssertionError, match="less indented than 8 spaces"):
        chunk_ir.text("        a = 1\n    b = 2", "        ", "t")

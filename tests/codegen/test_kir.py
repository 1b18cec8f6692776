"""The kernel IR (mixc/codegen/kir): the verifier rejects hand-built kernels that break each
of its rules, the printer prints a small kernel that Triton runs, and every library spec's
recurrent kernels are built as IR, verified after each pass, printed with headers and shape
comments, and compile for sm_90 with the real Triton compiler."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import mixc
from mixc import pipeline
from mixc.codegen import module
from mixc.codegen.kir import nodes as K
from mixc.codegen.kir import passes, printer
from mixc.codegen.kir.verify import KirError, verify
from mixc.codegen.triton_expr import Emitter
from mixc.dsl import library_names

RECURRENT = library_names("recurrent")


def _n(x, *dims):
    return K.Name(x, tuple(dims))


def _kernel(*body, args=("p_x", "p_out", "_size_K", "_BLOCK_K", "_size_V", "_BLOCK_V")):
    return K.Kernel("k", ("a test kernel",), (K.ArgLine(tuple(K.Arg(a, a.startswith("_")) for a in args)),),
                    tuple(body))


LANES = (K.Let("_offs_K", K.Arange("K"), ("K",), "i32"),
         K.Let("_mask_K", K.BinOp("<", _n("_offs_K", "K"), _n("_size_K")), ("K",), "i1"),
         K.Let("_offs_V", K.Arange("V"), ("V",), "i32"))


# ---- the verifier: one failing kernel per rule ----

def test_a_name_read_before_any_definition_is_an_error():
    k = _kernel(*LANES, K.Let("y", K.BinOp("*", _n("x", "K"), K.Num(2.0)), ("K",)))
    with pytest.raises(KirError, match="reads x, which nothing defines before it"):
        verify(k)


def test_a_use_before_its_definition_is_an_error():
    k = _kernel(*LANES, K.Let("y", _n("x"), ()), K.Let("x", K.Num(1.0), ()))
    with pytest.raises(KirError, match="reads x, which nothing defines"):
        verify(k)


def test_operands_with_different_dims_are_an_error():
    x = K.Let("x", K.Zeros(("K",)), ("K",))
    v = K.Let("v", K.Zeros(("V",)), ("V",))
    # [K] * [V] without broadcasting both to [K, V] first: Triton would broadcast by position
    k = _kernel(*LANES, x, v, K.Let("y", K.BinOp("*", _n("x", "K"), _n("v", "V")), ("K",)))
    with pytest.raises(KirError, match=r"the operands of \* have different dims, \[K\] and \[V\]"):
        verify(k)
    ok = _kernel(*LANES, x, v, K.Let("y", K.BinOp("*", K.Broadcast(_n("x", "K"), ("K", "V")),
                                                   K.Broadcast(_n("v", "V"), ("K", "V"))), ("K", "V")))
    verify(ok)


def test_a_name_read_with_other_dims_than_its_definition_is_an_error():
    k = _kernel(*LANES, K.Let("x", K.Zeros(("K",)), ("K",)), K.Let("y", _n("x", "V"), ("V",)))
    with pytest.raises(KirError, match=r"x is read as \[V\], its definition has \[K\]"):
        verify(k)


def test_a_broadcast_that_reorders_or_drops_dims_is_an_error():
    k = _kernel(*LANES, K.Let("x", K.Zeros(("K", "V")), ("K", "V")),
                K.Let("y", K.Broadcast(_n("x", "K", "V"), ("V", "K")), ("V", "K")))
    with pytest.raises(KirError, match="broadcasts"):
        verify(k)


def test_a_read_outside_the_loop_that_defines_it_is_an_error():
    loop = K.For("_t", K.Num(0), K.Num(4), (K.Let("acc", K.Num(1.0), ()),))
    k = _kernel(*LANES, loop, K.Let("y", _n("acc"), ()))
    with pytest.raises(KirError, match="reads acc, defined inside the loop over _t and read outside it"):
        verify(k)
    # defined before the loop and re-assigned in it (a loop-carried value): fine
    verify(_kernel(*LANES, K.Let("acc", K.Num(0.0), ()), loop, K.Let("y", _n("acc"), ())))


def test_a_read_of_what_one_branch_defines_is_an_error():
    one = K.If(_n("_size_K"), (K.Let("z", K.Num(1.0), ()),))
    with pytest.raises(KirError, match="defined inside one branch"):
        verify(_kernel(one, K.Let("y", _n("z"), ())))
    both = K.If(_n("_size_K"), (K.Let("z", K.Num(1.0), ()),), (K.Let("z", K.Num(2.0), ()),))
    verify(_kernel(both, K.Let("y", _n("z"), ())))


def test_a_loop_carried_value_keeps_its_dims():
    k = _kernel(*LANES, K.Let("s", K.Zeros(("K",)), ("K",)),
                K.For("_t", K.Num(0), K.Num(4), (K.Let("s", K.Zeros(("V",)), ("V",)),)))
    with pytest.raises(KirError, match=r"re-assigns s as \[V\] f32, defined as \[K\] f32"):
        verify(k)


def test_a_reduction_over_a_dim_its_operand_lacks_is_an_error():
    k = _kernel(*LANES, K.Let("x", K.Zeros(("K",)), ("K",)), K.Let("y", K.Reduce("tl.sum", _n("x", "K"), "V"), ()))
    with pytest.raises(KirError, match="reduces over V"):
        verify(k)


def test_a_let_whose_value_has_another_dtype_is_an_error():
    """A comparison is i1, `/` float32, a cast its target, ints promote to int64 and floats."""
    k = _kernel(*LANES, K.Let("big", K.BinOp(">", _n("_offs_K", "K"), K.Num(2)), ("K",)))     # declared f32
    with pytest.raises(KirError, match="declared f32, its value is i1"):
        verify(k)
    wide = K.Cast(_n("_size_K"), K.Const("tl.int64"))
    with pytest.raises(KirError, match="declared i32, its value is i64"):
        verify(_kernel(K.Let("n", K.BinOp("*", wide, _n("_size_V")), (), "i32")))
    verify(_kernel(K.Let("n", K.BinOp("*", wide, _n("_size_V")), (), "i64"),
                   K.Let("x", K.BinOp("/", _n("n"), K.Num(2)), ()),
                   K.For("_t", K.Num(0), _n("n"), (K.Let("y", K.BinOp("+", _n("_t"), K.Num(1)), (), "i64"),))))


# ---- the printer ----

def _rowsum_kernel() -> K.Kernel:
    """out[v] = sum_k exp(x[k]) * w[k, v] over the real lanes, x and w loaded with masks."""
    mk, mv = _n("_mask_K", "K"), _n("_mask_V", "V")
    mkv = K.BinOp("&", K.Broadcast(mk, ("K", "V")), K.Broadcast(mv, ("K", "V")))
    offs_kv = (K.BinOp("*", K.Broadcast(_n("_offs_K", "K"), ("K", "V")), _n("_size_V")),
               K.Broadcast(_n("_offs_V", "V"), ("K", "V")))
    body = LANES + (
        K.Let("_mask_V", K.BinOp("<", _n("_offs_V", "V"), _n("_size_V")), ("V",), "i1"),
        K.Comment(""),
        K.Let("x", K.Cast(K.Load(_n("p_x"), (_n("_offs_K", "K"),), mk, K.Num(0.0)), K.Const("tl.float32")), ("K",),
              comment="the row"),
        K.Let("w", K.Load(_n("p_w"), offs_kv, mkv, K.Num(0.0)), ("K", "V")),
        K.Let("e", K.Template("tl.exp({x})", (("x", _n("x", "K")),)), ("K",)),
        K.Let("p", K.BinOp("*", K.Broadcast(_n("e", "K"), ("K", "V")), _n("w", "K", "V")), ("K", "V")),
        K.Let("o", K.Reduce("tl.sum", K.Call("tl.where", (mkv, _n("p", "K", "V"), K.Num(0.0))), "K"), ("V",)),
        K.Store(_n("p_out"), (_n("_offs_V", "V"),), K.Cast(_n("o", "V"), K.ElementType(_n("p_out"))), mv),
    )
    args = (K.ArgLine((K.Arg("p_x"), K.Arg("p_w"), K.Arg("p_out")), "pointers"),
            K.ArgLine(comment="sizes and blocks"),
            K.ArgLine((K.Arg("_size_K", True), K.Arg("_BLOCK_K", True), K.Arg("_size_V", True), K.Arg("_BLOCK_V", True))))
    return K.Kernel("rowsum", ("---- rowsum: a test ----",), args, body, ("one program",))


ROWSUM = '''# ---- rowsum: a test ----
@triton.jit
def rowsum(
    p_x, p_w, p_out,                  # pointers
    # sizes and blocks
    _size_K: tl.constexpr, _BLOCK_K: tl.constexpr, _size_V: tl.constexpr, _BLOCK_V: tl.constexpr,
):
    # one program
    _offs_K = tl.arange(0, _BLOCK_K)  # [K] i32
    _mask_K = _offs_K < _size_K  # [K] i1
    _offs_V = tl.arange(0, _BLOCK_V)  # [V] i32
    _mask_V = _offs_V < _size_V  # [V] i1

    x = tl.load(p_x + _offs_K, mask=_mask_K, other=0.0).to(tl.float32)  # [K]: the row
    w = tl.load(p_w + _offs_K[:, None] * _size_V + _offs_V[None, :], mask=_mask_K[:, None] & _mask_V[None, :], other=0.0)  # [K, V]
    e = tl.exp(x)  # [K]
    p = e[:, None] * w  # [K, V]
    o = tl.sum(tl.where(_mask_K[:, None] & _mask_V[None, :], p, 0.0), axis=0)  # [V]
    tl.store(p_out + _offs_V, o.to(p_out.dtype.element_ty), mask=_mask_V)
'''


def test_the_printer_prints_a_small_kernel_that_triton_runs(tmp_path):
    """Built by hand, verified, printed (with its shape comments), imported and run in Triton's
    interpreter: the printed text is the one above and computes sum_k exp(x_k) w_kv."""
    k = verify(_rowsum_kernel())
    text = printer.kernel(k)
    assert text == ROWSUM
    path = tmp_path / "rowsum_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + text)
    spec = importlib.util.spec_from_file_location("rowsum_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, generator=gen), torch.randn(5, 3, generator=gen)
    out = torch.full((3,), float("nan"))
    mod.rowsum[(1,)](x, w, out, _size_K=5, _BLOCK_K=8, _size_V=3, _BLOCK_V=4)
    torch.testing.assert_close(out, torch.exp(x) @ w)


def test_parentheses_only_where_binding_needs_them():
    a, b, c = _n("a"), _n("b"), _n("c")
    cases = [(K.BinOp("-", a, K.BinOp("-", b, c)), "a - (b - c)"),
             (K.BinOp("-", K.BinOp("-", a, b), c), "a - b - c"),
             (K.BinOp("/", K.BinOp("*", K.Neg(a), b), K.BinOp("*", c, c)), "-a * b / (c * c)"),
             (K.Neg(K.BinOp("+", a, b)), "-(a + b)"),
             (K.BinOp("*", a, K.Num(-0.5)), "a * -0.5"),
             (K.Cast(K.BinOp(">", a, K.Num(0)), K.Const("tl.float32")), "(a > 0).to(tl.float32)"),
             (K.BinOp("and", _n("USE"), K.BinOp("==", a, K.Num(0))), "USE and a == 0"),
             (K.BinOp("*", a, K.Template("{x} * (1.0 - {x})", (("x", b),))), "a * (b * (1.0 - b))"),
             (K.Num(float("-inf")), "float('-inf')")]
    for e, text in cases:
        assert printer.expr(e) == text


def test_dead_lets_drops_what_nothing_reads_and_is_verified():
    k = _kernel(*LANES, K.Let("a", K.Num(1.0), ()), K.Let("b", K.BinOp("*", _n("a"), K.Num(2.0)), ()),
                K.Store(_n("p_out"), (K.Num(0),), _n("a")))
    record = []
    out = passes.run(k, (passes.DEAD_LETS,), record)
    # b, the unread mask, then the lanes only the mask read: until nothing unread is left
    assert [s.name for s in out.body if isinstance(s, K.Let)] == ["a"]
    assert [p for p, _ in record] == ["build", "dead_lets"]


def test_hoist_invariants_moves_what_every_iteration_computes_alike():
    """A Let of loop-invariant operands leaves the loop (and then the next one out); one that
    reads the loop's variable, a re-assigned name or a load stays."""
    x = _n("x")
    inner = K.For("_j", K.Num(0), K.Num(3), (
        K.Let("a", K.BinOp("*", _n("_size_K"), K.Num(2.0)), ()),         # invariant in both loops
        K.Let("b", K.BinOp("+", _n("a"), _n("_i")), ()),                  # reads the outer loop's variable
        K.Let("c", K.BinOp("+", _n("a"), _n("_j")), ()),                  # reads its own
        K.Let("d", K.Cast(K.Load(_n("p_x"), (K.Num(0),)), K.Const("tl.float32")), ()),   # a load
        K.Let("e", K.BinOp("+", x, _n("a")), ()),                         # x is re-assigned below
        K.Let("x", K.BinOp("+", _n("b"), _n("c")), ()),
        K.Store(_n("p_out"), (K.Num(0),), K.BinOp("+", _n("d"), _n("e"))),
    ))
    k = _kernel(K.Let("x", K.Num(0.0), ()), K.For("_i", K.Num(0), K.Num(2), (inner,)))
    out = passes.run(k, (passes.HOIST_INVARIANTS,))
    assert [s.name for s in out.body if isinstance(s, K.Let)] == ["x", "a"]
    outer = out.body[-1]
    assert [s.name for s in outer.body if isinstance(s, K.Let)] == ["b"]
    assert [s.name for s in outer.body[-1].body if isinstance(s, K.Let)] == ["c", "d", "e", "x"]


# ---- the Emitter's adapter ----

def test_the_emitter_builds_ir_and_its_lines_are_the_printed_ir():
    op = mixc.load("gla")
    m = op.plan().kernel_ir
    env = {s.name: (f"s_{s.name}", ("K", "V")) for s in m.states} | {
        "prev S": ("s_S", ("K", "V"))} | {d.name: (f"v_{d.name}", d.shape) for d in m.inputs}
    env |= {o.name: (f"v_{o.name}", ()) for o in m.options if o.kind == "float"}
    em = Emitter(m, env, indent="  ")
    em(m.output.expr)
    assert em.stmts and all(isinstance(s, K.Let) for s in em.stmts)
    assert not any(isinstance(x, K.Raw) for s in em.stmts for x in K.walk(s.value))
    assert em.lines == [line for s in em.stmts for line in printer.stmt(s, "  ")]     # with shape comments
    # mlstm's output max(|q . n|, 1): the adjoint's pick between the two is a comparison, i1
    from mixc.codegen.adjoint import Adjoint
    m = mixc.load("mlstm").plan().kernel_ir
    env = {s.name: (f"s_{s.name}", s.shape) for s in m.states} | {d.name: (f"v_{d.name}", d.shape) for d in m.inputs}
    env |= {"prev " + s.name: (f"s_{s.name}", s.shape) for s in m.states}
    env |= {o.name: (f"v_{o.name}", ()) for o in m.options if o.kind == "float"}
    out = Emitter(m, env)
    o = out(m.output.expr)
    adj = Adjoint(out, "_a")
    adj.backward(m.output.expr, ("_do", o[1]))
    picks = [s for s in adj.stmts if isinstance(s.value, K.BinOp) and s.value.op == ">="]
    assert picks and all(s.dtype == "i1" for s in picks)
    assert {s.dtype for s in out.stmts} == {"f32"}


# ---- the recurrent kernels of every library spec ----

def _raw(stmts):
    for s in stmts:
        for e in K.stmt_exprs(s):
            if any(isinstance(x, K.Raw) for x in K.walk(e)):
                return True
        if isinstance(s, K.For) and _raw(s.body) or isinstance(s, K.If) and (_raw(s.body) or _raw(s.orelse)):
            return True
    return False


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_kernels_are_ir_verified_after_each_pass(name):
    plan = mixc.load(name).plan()
    record = {}
    kernels = module.recurrent_ir(plan, record)
    assert set(kernels) == {"recurrent_fwd", "recurrent_bwd"}
    for form, k in kernels.items():
        assert [p for p, _ in record[form]] == ["build"] + [p.name for p in module.RECURRENT_PASSES]
        assert not _raw(k.body), "no text made outside the IR"
        text = printer.kernel(k)
        assert text.startswith(f"# ---- {name}_{form}: ") and "\n# notation: " in text
        assert text.count("@triton.jit") == 1
        assert "  # [" in text           # shape comments
        # the module holds exactly the printed kernel
        assert text in module.generate(plan)
        # a note of hoist_invariants stands above the Lets it moved (not above a loop)
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.strip() == f"# {passes.HOISTED.text}":
                assert " = " in lines[i + 1] and not lines[i + 1].strip().startswith("for "), lines[i + 1]


def test_dump_kir_prints_each_kernel_after_each_pass(capsys):
    from mixc import cli
    assert cli.main(["compile", "gla", "--dump", "kir"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("#### gla_recurrent")]
    assert heads == [
        "#### gla_recurrent_fwd after build (verified): 57 statements",
        "#### gla_recurrent_fwd after dead_lets (verified): 57 -> 56 statements; dropped _fhead",
        "#### gla_recurrent_fwd after hoist_invariants (verified): 56 -> 56 statements; moved out of loops _zs_S",
        "#### gla_recurrent_bwd after build (verified): 102 statements",
        "#### gla_recurrent_bwd after dead_lets (verified): 102 -> 90 statements; dropped _ao5, _ao6, _az4, "
        "_az6, _az7, _fhead, _o2, _o3, _oj, _z1, _z2, _z3",
        "#### gla_recurrent_bwd after hoist_invariants (verified): 90 -> 90 statements; moved out of loops _zs_S"]
    # then each chunked kernel as built (codegen/chunk_ir.py), its hooks' text named
    chunked = [line for line in out.splitlines() if line.startswith("#### gla_chunk")]
    assert [line.split()[1] for line in chunked] == [
        f"gla_chunk_{stage}" for stage in ("fwd_fused", "fwd_walk", "fwd_output", "fwd_refill", "fwd_intra",
                                           "bwd_fused", "bwd_walk", "bwd_tiles")]
    assert all(" as built (verified): " in line for line in chunked)
    assert chunked[0].endswith("54 statements, 1 of them text (chunk_body)")
    assert chunked[-1].endswith("3 of them text (init_grads, chunk_backward, store_grads)")
    retention = pipeline.dump("kir", "retention")
    assert ("#### retention_recurrent_fwd after hoist_invariants (verified): 57 -> 57 statements; "
            "moved out of loops _l1, _l2, _l3, _l4, _zs_S") in retention
    assert pipeline.dump("kir", "hyena").endswith("it has no kernels")
    # the stage itself: the kernels as frozen IR, what the module prints
    kernels = pipeline.kir(mixc.load("gla").plan())
    assert {f: k.name for f, k in kernels.items()} == {"recurrent_fwd": "gla_recurrent_fwd",
                                                       "recurrent_bwd": "gla_recurrent_bwd"}


@pytest.mark.slow
def test_recurrent_kernels_compile_for_sm90(tmp_path):
    """Both recurrent kernels of every library spec through Triton's real compiler for sm_90
    (no GPU), in a process without the interpreter (mixc/tools/aot.py)."""
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", "--arch", "90",
                        "--forms", "recurrent_fwd,recurrent_bwd", *RECURRENT],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {(r["spec"], r["kernel"]) for r in json.loads(p.stdout)}
    assert got == {(n, k) for n in RECURRENT for k in ("recurrent_fwd", "recurrent_bwd")}


HEAD_AND_F = """
mixer head_and_f
  dims   K, V
  input  q[K], k[K], v[V], f[]
  let    a = sigmoid(f) * exp(-0.5 * head)
  state  S[K, V]
  update S = a * S + k * v
  output o = q @ S
"""


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_an_input_named_f_leaves_the_head_index_alone(mode):
    """An input named f once gave the kernels `_head_f = i_h // _group_f` (its head among the
    grouped heads) over the float head index `_head_f = i_h * 1.0` that `head` reads (the
    verifier's re-assignment rule found it): with f shared by groups of 2 heads, heads 1 and 3
    read the decay of heads 0 and 1. B2-T9-H4-K4-V3 against the float64 reference on f repeated."""
    from helpers import random_args
    op = pipeline.from_text(HEAD_AND_F, "head_and_f.mix")
    args, _ = random_args(op.ir, B=2, T=9, H=4, sizes={"K": 4, "V": 3}, dtype=torch.float32, seed=5)
    args["f"] = args["f"][:, :, :2].clone()
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
    o, _ = op(**leaves, mode=mode)
    ref = {k: v.detach().double().requires_grad_(True) for k, v in args.items()}
    o_ref, _ = op(**{k: (v.repeat_interleave(2, dim=2) if k == "f" else v) for k, v in ref.items()}, mode="reference")
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (o.double() * w).sum().backward()
    (o_ref * w).sum().backward()
    for k in args:
        torch.testing.assert_close(leaves[k].grad.double(), ref[k].grad, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", [n for n in RECURRENT if mixc.load(n).plan().layout.chunked])
def test_the_chunked_kernels_spec_expressions_are_typed_ir(name, monkeypatch):
    """The chunked kernels still reach kir through the Emitter's adapter; every Let it builds
    from a spec expression (no text of the templates inside) has the dims it declares and
    operands whose dims agree (the verifier's expression rules, names read as declared)."""
    from mixc.codegen import triton_expr
    from mixc.codegen.kir import verify as V
    lets = []
    emit = triton_expr.Emitter.emit

    def spy(self, code, dims):
        out = emit(self, code, dims)
        lets.append(self.stmts[-1])
        return out
    monkeypatch.setattr(triton_expr.Emitter, "emit", spy)
    # the fused kernels hold every expression of their direction: each once (the other stages'
    # kernels render the same expressions again, and fewer of the spec's own)
    monkeypatch.setattr(module, "chunk_stages", lambda plan, form: ("fused",))
    module.generate(mixc.load(name).plan())
    typed = [s for s in lets if not any(isinstance(x, K.Raw) for x in K.walk(s.value))]
    assert len(typed) > len(lets) // 2
    for s in typed:
        assert s.value.dims == s.dims, printer.stmt(s)[0]
        names = {x.id: (x.dims, "f32") for x in K.walk(s.value) if isinstance(x, K.Name)}
        V._check_expr(s.value, V._Scope(names, {}), printer.stmt(s)[0])

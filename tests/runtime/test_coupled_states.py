"""Coupled states at run time: the updates of a token run in the order written (an earlier
update's new value, a later one's previous value, prev() the previous value), in every mode;
systems whose states differ in shape (a state without the recurrent kernels' tile dim feeding
one with it, and one read back through a reduction) on the kernels with their gradients."""
from __future__ import annotations

import pytest
import torch

from mixc.pipeline import from_text
from helpers import random_args, random_state
from kernel_checks import check_against_reference

HEAD = """mixer m
  dims   K, V
  input  q[K], k[K], v[V], a[], b[]
  state  x[K, V], y[K, V]
"""
ORDERS = {
    # y reads x's new value (x is updated first)
    "new": "  update x = a * x + k * v\n  update y = b * y + x\n",
    # y reads x's previous value explicitly
    "prev": "  update x = a * x + k * v\n  update y = b * y + prev(x)\n",
    # y's update comes first: x is not updated yet, so y reads its previous value
    "later": "  update y = b * y + x\n  update x = a * x + k * v\n",
}


def _loop(args, s0, new: bool):
    x, y = s0["x"].double(), s0["y"].double()
    out = []
    for t in range(args["q"].shape[1]):
        a, b = args["a"][:, t, :, None, None].double(), args["b"][:, t, :, None, None].double()
        x_new = a * x + args["k"][:, t, :, :, None].double() * args["v"][:, t, :, None, :].double()
        y = b * y + (x_new if new else x)
        x = x_new
        out.append(torch.einsum("bhk,bhkv->bhv", args["q"][:, t].double(), x + y))
    return torch.stack(out, 1), {"x": x, "y": y}


@pytest.mark.parametrize("mode", ["reference", "torch", "recurrent"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_updates_run_in_the_order_written(order, mode):
    op = from_text(HEAD + ORDERS[order] + "  output o = q @ (x + y)\n", "m.mix")
    args, sizes = random_args(op.ir, B=2, T=6, H=2, sizes={"K": 3, "V": 4}, seed=3)
    s0 = random_state(op.ir, 2, 2, sizes, seed=4)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = _loop(args, s0, new=(order == "new"))
    tol = 1e-10 if mode == "reference" else 1e-5
    assert (o.double() - o_l).abs().max() <= tol * max(1, o_l.abs().max())
    for n in ("x", "y"):
        assert (fin[n].double() - fin_l[n]).abs().max() <= tol * max(1, fin_l[n].abs().max())
    o_other, _ = _loop(args, s0, new=(order != "new"))
    assert (o_l - o_other).abs().max() > 1e-3         # the two readings differ: the test can tell them apart


SHAPED = {
    # n[K] lacks the kernels' tile dim V and feeds S (S reads n's new value)
    "one-way": ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[K]\n  state n[K], S[K, V]\n"
                "  update n = sigmoid(g) * n + k\n  update S = 0.9 * S + n * v\n  output o = q @ S\n"),
    # and n reads S back through a reduction over V (then V is no tile dim)
    "two-way": ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[K]\n  state n[K], S[K, V]\n"
                "  update n = sigmoid(g) * n + k - 0.1 * sum(S, V)\n  update S = 0.9 * S + n * v\n"
                "  output o = q @ S + q * n @ k\n"),
}


@pytest.mark.parametrize("CK", [3, 16])
@pytest.mark.parametrize("name", list(SHAPED))
def test_systems_of_different_shapes_on_the_kernels(name, CK):
    """Output, final states and every gradient of the recurrent kernels (float32, Triton's
    interpreter) against the float64 reference, packed sequences included."""
    op = from_text(SHAPED[name], "m.mix")
    assert op.plan().systems and op.plan().forms == ("recurrent", "step")
    assert (op.plan().layout.tile == "V") == (name == "one-way")
    args, sizes = random_args(op.ir, B=1, T=12, H=2, sizes={"K": 5, "V": 6}, seed=9, dtype=torch.float32)
    args = {k: v.requires_grad_() for k, v in args.items()}
    s0 = random_state(op.ir, 3, 2, sizes, seed=2, dtype=torch.float32, requires_grad=True)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    check_against_reference(op, {}, args, s0, torch.float32, CK=CK, cu_seqlens=cu, mode="recurrent")


def test_step_of_a_system_equals_the_sequence():
    op = from_text(SHAPED["two-way"], "m.mix")
    args, sizes = random_args(op.ir, B=2, T=4, H=2, sizes={"K": 3, "V": 4}, seed=5)
    s0 = random_state(op.ir, 2, 2, sizes, seed=6)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="reference")
    st = s0
    for t in range(4):
        ot, st = op.step(**{k: v[:, t] for k, v in args.items()}, state=st)
        assert (ot.double() - o[:, t]).abs().max() <= 1e-5 * max(1, o.abs().max())
    for n in fin:
        assert (st[n].double() - fin[n]).abs().max() <= 1e-5 * max(1, fin[n].abs().max())


def test_no_chunked_mode_for_a_system_says_why():
    op = from_text(SHAPED["one-way"], "m.mix")
    args, _ = random_args(op.ir, B=1, T=4, H=1, sizes={"K": 2, "V": 2}, seed=1)
    with pytest.raises(Exception) as info:
        op(**args, mode="chunk")
    assert "block-affine system" in str(info.value)


def test_inplace_step_with_a_state_without_the_tile_dim():
    """op.step(inplace=True) on a cache: n[K] (no V) feeds S[K, V], V large enough for several
    tile blocks; with one buffer a later block would read the n an earlier one wrote (the
    launcher takes one tile block then: standalone/launcher.py)."""
    op = from_text(SHAPED["one-way"], "m.mix")
    args, sizes = random_args(op.ir, B=2, T=1, H=2, sizes={"K": 5, "V": 70}, seed=1, dtype=torch.float32)
    s0 = random_state(op.ir, 2, 2, sizes, seed=2, dtype=torch.float32)
    o_ref, st_ref = op(**args, initial_state=s0, output_final_state=True, mode="reference")
    cache = {k: v.clone() for k, v in s0.items()}
    o, _ = op.step(**{k: v[:, 0] for k, v in args.items()}, state=cache, inplace=True)
    assert (o.double() - o_ref[:, 0]).abs().max() <= 1e-5 * max(1, o_ref.abs().max())
    for n in cache:
        assert (cache[n].double() - st_ref[n]).abs().max() <= 1e-5 * max(1, st_ref[n].abs().max())


@pytest.mark.parametrize("declared", ["x, y", "y, x"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_torch_chunked_form_of_a_system_without_projections(order, declared, monkeypatch):
    """Gates in (0, 1) and reads q @ x + q @ y: the 2x2 system with triangular scalar gates has
    mode "torch"'s chunked form (classes/block_affine.py) in every order of its updates and of
    its declared states; chunks of 4 over T = 11, output, final states and every gradient
    against the loop."""
    import mixc.runtime.torch_chunk as torch_chunk
    calls, run = [], torch_chunk.torch_system_forward
    monkeypatch.setattr(torch_chunk, "torch_system_forward", lambda *a, **k: calls.append(k["C"]) or run(*a, **k))
    head = HEAD.replace("a[], b[]", "a[] in (0, 1), b[] in (0, 1)").replace(
        "state  x[K, V], y[K, V]", f"state  {declared.replace('x', 'x[K, V]').replace('y', 'y[K, V]')}")
    op = from_text(head + ORDERS[order] + "  output o = q @ x + q @ y\n", "m.mix")
    (sy,) = op.plan().systems
    assert op.plan().layout.torch_chunk_unsupported is None
    # the chunked form takes the states in the order that makes the gates lower triangular: y reads x
    assert sy.states == tuple(declared.split(", ")) and sy.chunk.states == ("x", "y")
    args, sizes = random_args(op.ir, B=2, T=11, H=2, sizes={"K": 3, "V": 4}, seed=5)
    gen = torch.Generator().manual_seed(6)
    for n in ("a", "b"):
        args[n] = 0.05 + 0.9 * torch.rand(args[n].shape, generator=gen, dtype=torch.float64)
    args = {n: x.requires_grad_() for n, x in args.items()}
    s0 = {n: x.requires_grad_() for n, x in random_state(op.ir, 2, 2, sizes, seed=7).items()}
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=4)
    assert calls == [4]
    o_l, fin_l = _loop(args, s0, new=(order == "new"))
    w = torch.randn(o_l.shape, generator=gen, dtype=torch.float64)
    leaves = list(args.values()) + list(s0.values())
    got = torch.autograd.grad((w * o).sum() + fin["x"].sum() + 2 * fin["y"].sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((w * o_l).sum() + fin_l["x"].sum() + 2 * fin_l["y"].sum(), leaves, allow_unused=True)
    assert (o - o_l).abs().max() <= 1e-9 * max(1, o_l.abs().max())
    for n in ("x", "y"):
        assert (fin[n] - fin_l[n]).abs().max() <= 1e-6 * max(1, fin_l[n].abs().max())
    for name, g, g_l in zip(list(args) + ["x0", "y0"], got, want):
        if g_l is None:
            assert g is None or g.abs().max() == 0, name
            continue
        assert (g - g_l).abs().max() <= 1e-6 * max(1, g_l.abs().max()), name


TITANS_RANGED = """mixer titans
  dims   K, V
  input  q[K], k[K], v[V], eta[] in (0, 1), theta[] in (0, 1), alpha[] in (0, 1)
  state  mom[K, V], mem[K, V]
  update mom = eta * mom - theta * k * (k @ mem - v)
  update mem = (1 - alpha) * mem + mom
"""


@pytest.mark.parametrize("output", ["sum(mom, K) + q @ mem", "q @ prev(mem) + 2 * (q @ prev(mom))"],
                         ids=["both-states", "prev-reads"])
def test_torch_chunked_form_reads_either_state(output):
    """The system's chunked form reads the state its projection does not read (mom), a sum over
    the key dims, and the previous states (prev(): the 2x2 products up to t - 1): output and
    final states against the float64 reference, chunks of 4 over T = 11."""
    op = from_text(TITANS_RANGED + f"  output o = {output}\n", "m.mix")
    assert op.plan().layout.torch_chunk_unsupported is None
    args, sizes = random_args(op.ir, B=2, T=11, H=2, sizes={"K": 3, "V": 4}, seed=5)
    gen = torch.Generator().manual_seed(8)
    for n in ("eta", "theta", "alpha"):
        args[n] = 0.05 + 0.9 * torch.rand(args[n].shape, generator=gen, dtype=torch.float64)
    s0 = random_state(op.ir, 2, 2, sizes, seed=7)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=4)
    o_r, fin_r = op(**args, initial_state=s0, output_final_state=True, mode="reference")
    assert (o - o_r).abs().max() <= 1e-9 * max(1, o_r.abs().max())
    for n in fin_r:
        assert (fin[n].double() - fin_r[n]).abs().max() <= 1e-6 * max(1, fin_r[n].abs().max())

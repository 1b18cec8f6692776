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

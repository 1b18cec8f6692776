"""One launcher (issue 31 item 3): mixc.load's op and a compiled module (`mixc compile NAME -o
DIR`) launch through mixc/standalone/launcher.py, so for the same call they make the same
launches. Each path's launches are recorded (launcher.recording) and compared launch by
launch: kernel name, grid, every constexpr and Triton option, every positional argument (a
tensor by shape and dtype, a number by value), forward and backward of the chunked and the
recurrent forms, and a decode step; the outputs agree too. support.py holds no launch rule of
its own: it imports the launcher and neither builds a grid nor allocates a buffer."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

import mixc
from helpers import random_args, random_state
from mixc import standalone
from mixc.cli import main
from mixc.codegen.launch_plan import launch_plan
from mixc.standalone import launcher
from mixc.standalone.launch_data import LaunchPlan

SPECS = ("gla", "gated_delta_rule", "retention", "rwkv6", "mamba2")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return tmp_path_factory.mktemp("one_launcher")


def _compiled(build: Path, name: str):
    assert main(["compile", name, "-o", str(build)]) == 0
    spec = importlib.util.spec_from_file_location(f"one_launcher_{name}", build / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(log: list) -> list:
    """Each launch as (kernel, grid, constexprs and options by name, positional arguments: a
    tensor's shape and dtype, a number's value)."""
    out = []
    for r in log:
        v, args = r["values"], r["args"]
        consts = {name: v[k] for name, k in args.named if not isinstance(v[k], torch.Tensor)}
        consts.update({k: v[k] for k in ("num_warps", "num_stages") if k in v})
        positional = [(tuple(v[k].shape), v[k].dtype) if isinstance(v[k], torch.Tensor) else v[k]
                      for k in args.positional]
        out.append((r["kernel"], r["grid"], consts, positional))
    return out


def _call(fn, args: dict, state: dict, leaves: list, **kw):
    """fn's forward and backward (output and final states weighted), their launches recorded."""
    with launcher.recording() as log:
        o, s = fn(**args, initial_state=state, output_final_state=True, **kw)
        w = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=w)).sum() + sum((x * torch.randn(x.shape, generator=w)).sum()
                                                                   for x in s.values())
        grads = torch.autograd.grad(loss, leaves)
    return log, o, grads


@pytest.mark.parametrize("name", SPECS)
def test_the_compiled_module_and_the_loaded_op_make_the_same_launches(name, build):
    mod = _compiled(build, name)
    op = mixc.load(name)
    op._fast.clear()                # an earlier test's replay recipe would launch without the launcher
    args, sizes = random_args(op.ir, B=2, T=9, H=2, sizes={}, dtype=torch.float32, seed=31, requires_grad=True)
    state = random_state(op.ir, 2, 2, sizes, requires_grad=True, dtype=torch.float32)
    leaves = list(args.values()) + list(state.values())
    modes = ("chunk", "recurrent") if "chunk_fwd" in mod.METADATA["kernels"] else ("recurrent",)
    for mode in modes:
        log_op, o_op, g_op = _call(op, args, state, leaves, mode=mode)
        log_mod, o_mod, g_mod = _call(mod.op, args, state, leaves, mode=mode)
        forms = [r["form"] for r in log_op]
        assert any(f.endswith("_bwd") for f in forms) and any(f.endswith("_fwd") for f in forms), forms
        assert _summary(log_mod) == _summary(log_op), mode
        torch.testing.assert_close(o_mod, o_op, rtol=0, atol=0)
        for a, b in zip(g_mod, g_op):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0].detach() if k in names else v.detach()) for k, v in args.items()}
    st = {k: v.detach() for k, v in state.items()}
    with launcher.recording() as log_op:
        o_op, _ = op.step(**one, state=st)
    with launcher.recording() as log_mod:
        o_mod, _ = mod.step(**one, state=st)
    assert [r["form"] for r in log_op] == ["recurrent_fwd"]
    assert _summary(log_mod) == _summary(log_op)
    torch.testing.assert_close(o_mod, o_op, rtol=0, atol=0)


def test_the_launch_plan_travels_in_metadata(build):
    """The module's METADATA["launch"] is the LaunchPlan mixc.load's op launches from."""
    mod = _compiled(build, "gla")
    lp = launch_plan(mixc.load("gla").plan())
    assert LaunchPlan.from_metadata(mod.METADATA["launch"]) == lp
    assert LaunchPlan.from_metadata(lp.to_metadata()) == lp
    assert lp.kernel_args == mixc.load("gla").plan().layout.kernel_args


def test_support_holds_no_launch_rules():
    """support.py imports the launcher and launches through it: no grid, block, buffer,
    checkpoint or kernel call of its own (those rules live once, in launcher.py)."""
    path = Path(standalone.__file__).with_name("support.py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("launcher", "Launcher") in imported
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # what launch rules are made of: grids and blocks, buffers, checkpoint slots and dtypes,
    # the kernels' argument lists and the call kernel[grid](...)
    rules = {"grid", "tiles", "splits", "slots", "next_power_of_2", "empty", "zeros", "checkpoint_dtype",
             "metadata_kernel_args", "kernel_args", "CHUNK_TILE", "RECURRENT_TILE", "bfloat16", "float16"}
    assert not names & rules, sorted(names & rules)
    # x[...](...): only the option defaults' operator tables (scalar()), never kernel[grid](...)
    calls = {ast.unparse(n.func.value) for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)}
    assert calls <= {"_BINARY", "_MAX_MIN"}, calls

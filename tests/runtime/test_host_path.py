"""The per-call host path (issue 17): after the first call, op() and op.step() do no file-system
work, no hashing and no IR walk, bind their arguments once, and an eager call neither goes
through torch's custom-op dispatch nor imports torch._dynamo."""
import builtins
import hashlib
import io
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import mixc
from helpers import random_args
from mixc.runtime import cache, launch
from mixc.runtime import op as op_module


class _NoLaunch:
    """A kernel whose launch does nothing: only the host path is under test."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _counting(counts, name, fn):
    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


FS_CALLS = [(builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"), (os, "mkdir"),
            (os, "makedirs"), (os, "replace"), (os, "unlink"), (os, "access"), (os, "listdir"), (os, "scandir"),
            (hashlib, "sha256")] + [(pathlib.Path, m) for m in (
                "stat", "lstat", "exists", "is_file", "is_dir", "mkdir", "open", "read_text", "read_bytes",
                "write_text", "unlink", "iterdir", "rglob")]


@pytest.mark.parametrize("name", ["gla", "mamba2"])
def test_no_file_system_work_hashing_or_ir_walk_after_the_first_call(name, monkeypatch):
    op = mixc.load(name)
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=1, T=5, H=2, sizes=sizes, dtype=torch.float32)
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in names else v) for k, v in args.items()}
    mod = cache.load_module(op.plan())
    for kernel in mod.METADATA["kernels"].values():
        monkeypatch.setattr(mod, kernel, _NoLaunch())

    def calls():
        _, st = op(**args, output_final_state=True)            # the chunked kernels (interpreter: mode auto)
        op(**args, mode="recurrent")
        op(**args, mode="torch")
        op.step(**one, state=st)
    calls()                                                     # the first call may look things up
    counts = {}
    for owner, attr in FS_CALLS:
        monkeypatch.setattr(owner, attr, _counting(counts, f"{getattr(owner, '__name__', owner)}.{attr}",
                                                   getattr(owner, attr)))
    from mixc.derive import layout
    for fn in ("kernel_layout", "tile_dim", "split_dim", "chunk_supported", "torch_chunk_supported"):
        # the IR walks behind the launch layout: done once per plan, by derive
        monkeypatch.setattr(layout, fn, _counting(counts, fn, getattr(layout, fn)))
    monkeypatch.setattr(op_module, "bind", _counting(counts, "bind", op_module.bind))
    calls()
    calls()
    assert counts == {"bind": 8}, counts          # 4 calls twice: each binds its arguments once


def test_an_eager_call_does_not_go_through_the_custom_op(monkeypatch):
    """Outside torch.compile the registered op is not called (its dispatch costs ~60 us and its
    first call imports torch._dynamo); gradients still flow (the same backward)."""
    op = mixc.load("simple_gla")
    fwd, _ = op.prepare()[:2]
    calls = []
    monkeypatch.setattr(fwd, "_opoverload", lambda *a: calls.append(a))
    args, _ = random_args(op.ir, B=1, T=5, H=2, sizes={"K": 4, "V": 3}, dtype=torch.float32, requires_grad=True)
    o, _ = op(**args, mode="recurrent")
    o.square().sum().backward()
    ref, _ = op.reference(**{k: v.detach().double().requires_grad_() for k, v in args.items()})
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    assert not calls and all(x.grad is not None and torch.isfinite(x.grad).all() for x in args.values())


def test_a_warm_first_call_imports_nothing_heavy(tmp_path):
    """A fresh process with a warm cache: the first forward imports neither torch._dynamo nor
    the code generator (jinja2); its time is printed (docs/kernels.md has the breakdown)."""
    env = dict(os.environ, MIXC_CACHE_DIR=str(cache.cache_dir()), TRITON_INTERPRET="1")
    cache._codegen_fingerprint.cache_clear()       # the generator's sources as they are now (the key)
    cache.ensure_source(mixc.load("gla").plan())                # warm
    script = textwrap.dedent("""
        import sys, time
        import torch
        t0 = time.perf_counter()
        import mixc
        op = mixc.load("gla")
        g = torch.Generator().manual_seed(3)
        x = {n: torch.randn(1, 4, 2, 4, generator=g) for n in ("q", "k", "v")}
        x["g"] = -torch.rand(1, 4, 2, 4, generator=g)
        t1 = time.perf_counter()
        o, _ = op(**x)
        t2 = time.perf_counter()
        assert torch.isfinite(o).all()
        heavy = [m for m in ("torch._dynamo", "jinja2", "mixc.codegen.module") if m in sys.modules]
        print(f"heavy={heavy}; import+load {t1 - t0:.2f} s, first call {t2 - t1:.2f} s")
    """)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    print(out.stdout)
    assert out.stdout.startswith("heavy=[];"), out.stdout

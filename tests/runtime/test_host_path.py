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
from mixc.standalone.launcher import Launcher
from mixc.runtime import op as op_module
from mixc.runtime.signature import ArgumentError


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


@pytest.mark.parametrize("name,phases", [("gla", None), ("mamba2", None), ("gla", 2)])
def test_no_file_system_work_hashing_or_ir_walk_after_the_first_call(name, phases, monkeypatch):
    """phases 2: the chunked forward in two launches (CUDA's), replayed too."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    op = mixc.load(name)
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=1, T=5, H=2, sizes=sizes, dtype=torch.float32)
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in names else v) for k, v in args.items()}
    mod = cache.load_module(op.plan())
    # every kernel: the recurrent ones by name, the chunked forms' one per stage (<stem>_<stage>)
    stems = tuple(mod.METADATA["kernels"].values())
    kernels = [k for k in vars(mod) if k in stems or k.startswith(tuple(f"{s}_" for s in stems))]
    assert len(kernels) > len(stems)
    for kernel in kernels:
        monkeypatch.setattr(mod, kernel, _NoLaunch())

    def calls():
        _, st = op(**args, output_final_state=True)            # the chunked kernels (interpreter: mode auto)
        op(**args, cu_seqlens=torch.tensor([0, 2, 5]))          # packed
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
    # the kernel calls replay their first launch (runtime/fastpath.py: no bind); the torch mode binds
    assert counts == {"bind": 2}, counts


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


# ---- step()'s fast path (runtime/fastpath.py) ----

def _step_args(op, B=2, H=2, D=4, seed=0, dtype=torch.float32):
    sizes = {d: D for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=B, T=3, H=H, sizes=sizes, dtype=dtype, seed=seed)
    names = {d.name for d in op.ir.inputs}
    _, st = op(**args, output_final_state=True, mode="recurrent")
    op._fast.clear()                # the recorded calls of other tests on this (shared) op
    return {k: (v[:, 0] if k in names else v) for k, v in args.items()}, st


@pytest.mark.parametrize("name", ["gla", "mamba2", "mlstm", "rwkv6"])
def test_a_replayed_step_equals_the_bound_step(name):
    """Three steps on the fast path (after one that records) equal the same steps bound anew,
    bit for bit, and the float64 reference's (stabilized mlstm: the states unstabilized too)."""
    op = mixc.load(name)
    one, st = _step_args(op, seed=1)
    fast_st = slow_st = st
    for i in range(4):
        step_in = {k: v + 0.1 * i for k, v in one.items()}     # fresh values, same look
        o_fast, fast_st = op.step(**step_in, state=fast_st)
        op._fast.clear()                                         # the bound path
        o_slow, slow_st = op.step(**step_in, state=slow_st)
        assert len(op._fast) == 1
        torch.testing.assert_close(o_fast, o_slow, rtol=0, atol=0)
        for k in slow_st:
            torch.testing.assert_close(fast_st[k], slow_st[k], rtol=0, atol=0)
            assert fast_st[k].dtype == torch.float32


@pytest.mark.parametrize("name", ["gla", "mamba2"])
def test_a_replayed_step_matches_the_reference(name):
    op = mixc.load(name)
    one, st = _step_args(op, seed=2)
    op.step(**one, state=st)                                     # records
    o, new = op.step(**one, state=st)                            # replays
    o_ref, new_ref = op.reference_step(**{k: v.double() for k, v in one.items()},
                                       state={k: v.double() for k, v in st.items()})
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for k in new_ref:
        torch.testing.assert_close(new[k].double(), new_ref[k], rtol=1e-5, atol=1e-5)


def test_the_fast_path_binds_nothing(monkeypatch):
    """After the first step only the key is built from the arguments: no bind, no plan, option
    or layout lookup, no module load."""
    op = mixc.load("gla")
    one, st = _step_args(op, seed=3)
    op.step(**one, state=st)
    counts = {}
    from mixc.runtime import custom_op, signature
    for owner, attr in [(op_module, "bind"), (signature, "bind"), (signature, "option_values"),
                        (launch, "launcher"), (launch, "plan_of"), (Launcher, "dim_blocks"), (Launcher, "forward"),
                        (cache, "load_module"),
                        (custom_op, "_bound"), (op_module.MixerOp, "_plan_for"), (op_module.MixerOp, "_kernels")]:
        monkeypatch.setattr(owner, attr, _counting(counts, attr, getattr(owner, attr)))
    for _ in range(3):
        o, st = op.step(**one, state=st)
    assert counts == {} and torch.isfinite(o).all(), counts


def test_a_new_look_takes_the_checked_path():
    """Each check still runs where the arguments differ from a recorded step's: a wrong state
    shape, a flag given as 1 (equal to True and of the same hash), a wrong dtype, an option as a
    tensor (its value is read: never replayed)."""
    op = mixc.load("gla")
    one, st = _step_args(op, seed=4)
    op.step(**one, state=st)
    op.step(**one, state=st)
    bad = {k: v[:, :1] for k, v in st.items()}
    with pytest.raises(ArgumentError, match="state\\['S'\\]: expected shape"):
        op.step(**one, state=bad)
    with pytest.raises(ArgumentError, match="q: expected a floating-point tensor"):
        op.step(**dict(one, q=one["q"].to(torch.int32)), state=st)
    with pytest.raises(ArgumentError, match="dim K"):
        op.step(**dict(one, q=torch.randn(2, 2, 5)), state=st)
    n = len(op._fast)
    op.step(**one, state=st, scale=torch.tensor(0.5))     # a number option as a tensor: read, not keyed
    assert len(op._fast) == n


def test_a_flag_given_as_1_is_still_refused():
    op = mixc.load("mamba2")
    one, st = _step_args(op, seed=6)
    op.step(**one, state=st, dt_softplus=True)
    op.step(**one, state=st, dt_softplus=True)
    with pytest.raises(ArgumentError, match="dt_softplus: expected True or False"):
        op.step(**one, state=st, dt_softplus=1)


def test_gradients_still_flow_after_a_replayed_step():
    """A step whose tensors need gradients is not replayed (autograd on the bound path)."""
    op = mixc.load("gla")
    one, st = _step_args(op, seed=5)
    op.step(**one, state=st)
    q = one["q"].clone().requires_grad_()
    o, _ = op.step(**dict(one, q=q), state=st)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("slots", [None, 5], ids=["batch", "cache-N5"])
def test_a_replayed_step_in_place_equals_the_bound_one(slots):
    """step(inplace=True), with and without a cache of slots: replayed steps update the buffers
    exactly as bound ones do; a later step with out-of-range or repeated CPU indices, or a
    non-contiguous buffer, is still refused."""
    op = mixc.load("gla")
    one, st = _step_args(op, seed=7)
    g = torch.Generator().manual_seed(8)
    rows = slots or 2
    fast = {k: torch.randn((rows,) + tuple(v.shape[1:]), generator=g) for k, v in st.items()}
    slow = {k: v.clone() for k, v in fast.items()}
    idx = torch.tensor([3, 1]) if slots else None
    for i in range(3):
        step_in = {k: v + 0.1 * i for k, v in one.items()}
        o_fast, out = op.step(**step_in, state=fast, inplace=True, state_indices=idx)
        assert out is fast and len(op._fast) == 1
        op._fast.clear()
        o_slow, _ = op.step(**step_in, state=slow, inplace=True, state_indices=idx)
        torch.testing.assert_close(o_fast, o_slow, rtol=0, atol=0)
        for k in slow:
            torch.testing.assert_close(fast[k], slow[k], rtol=0, atol=0)
    if slots:
        with pytest.raises(ArgumentError, match="state_indices: slots must be in"):
            op.step(**one, state=fast, inplace=True, state_indices=torch.tensor([3, 5]))
        with pytest.raises(ArgumentError, match="same slot"):
            op.step(**one, state=fast, inplace=True, state_indices=torch.tensor([1, 1]))
    strided = {k: torch.randn(tuple(v.shape[:-1]) + (2 * v.shape[-1],))[..., ::2] for k, v in fast.items()}
    with pytest.raises(ArgumentError, match="contiguous"):
        op.step(**one, state=strided, inplace=True, state_indices=idx)


@pytest.mark.parametrize("name", ["gla", "mlstm"])
@pytest.mark.parametrize("mode", ["auto", "recurrent"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
def test_a_replayed_call_equals_the_bound_call(name, mode, with_state):
    """op() (no gradient wanted, one launch) replays like step(): same outputs and final states
    bit for bit as bound calls, the outputs against float64; output_final_state=False keys apart."""
    op = mixc.load(name)
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=2, T=6, H=2, sizes=sizes, dtype=torch.float32, seed=9)
    st = op(**args, output_final_state=True, mode="recurrent")[1] if with_state else None
    op._fast.clear()
    for i in range(3):
        call_in = {k: v + 0.05 * i for k, v in args.items()}
        o_fast, st_fast = op(**call_in, initial_state=st, output_final_state=True, mode=mode)
        o_only, none = op(**call_in, initial_state=st, mode=mode)
        n = len(op._fast)
        op._fast.clear()
        o_slow, st_slow = op(**call_in, initial_state=st, output_final_state=True, mode=mode)
        assert n == 2 and none is None
        torch.testing.assert_close(o_fast, o_slow, rtol=0, atol=0)
        torch.testing.assert_close(o_only, o_slow, rtol=0, atol=0)
        for k in st_slow:
            torch.testing.assert_close(st_fast[k], st_slow[k], rtol=0, atol=0)
    ref, _ = op.reference(**{k: v.double() for k, v in call_in.items()},
                          initial_state={k: v.double() for k, v in st.items()} if st else None)
    torch.testing.assert_close(o_fast.double(), ref, rtol=1e-4, atol=1e-4)


def test_a_call_with_a_new_look_is_bound_and_packed_offsets_are_checked_on_replay(monkeypatch):
    """A new shape takes the bound path's check; packed offsets are keyed by their look, so a
    replayed packed call still checks their values (bind's check) and refuses bad ones."""
    op = mixc.load("gla")
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes=sizes, dtype=torch.float32, seed=10)
    op(**args)
    op(**args)
    with pytest.raises(ArgumentError, match="dim K"):
        op(**dict(args, k=torch.randn(1, 6, 2, 5)))
    with pytest.raises(ArgumentError, match="cu_seqlens: must start at 0"):
        op(**args, cu_seqlens=torch.tensor([1, 6]))
    n = len(op._fast)
    op(**args, cu_seqlens=torch.tensor([0, 2, 6]))                # recorded
    assert len(op._fast) == n + 1
    with pytest.raises(ArgumentError, match="cu_seqlens: must start at 0"):
        op(**args, cu_seqlens=torch.tensor([1, 2, 6]))
    with pytest.raises(ArgumentError, match="non-decreasing"):
        op(**args, cu_seqlens=torch.tensor([0, 7, 6]))
    # one offsets tensor changed in place between replays (what they made from it, the output kernel's
    # chunk table too, is kept by the checked values): the new values are checked and used
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    cu = torch.tensor([0, 2, 6])
    o_first, _ = op(**args, cu_seqlens=cu)
    cu[1] = 4
    o_fast, _ = op(**args, cu_seqlens=cu)
    o_bound, _ = op(**args, cu_seqlens=torch.tensor([0, 4, 6]), CK=16)       # another key: bound
    torch.testing.assert_close(o_fast, o_bound, rtol=0, atol=0)
    assert not torch.equal(o_first, o_fast)
    cu[1] = 7
    with pytest.raises(ArgumentError, match="non-decreasing"):
        op(**args, cu_seqlens=cu)
    assert len(op._fast) == n + 3


@pytest.mark.parametrize("name,packed,with_state,dtype,mode,every", [
    # the plain call behind -m slow (14 s): gla-state and gla-packed replay the same launches
    pytest.param("gla", False, False, torch.float32, "auto", 1, marks=pytest.mark.slow),
    ("gla", False, True, torch.float32, "auto", 1),
    ("gla", True, False, torch.float32, "auto", 1), ("gla", True, True, torch.float32, "auto", 1),
    ("mlstm", False, False, torch.float32, "auto", 1), ("mlstm", True, True, torch.float32, "auto", 1),
    ("gla", True, True, torch.bfloat16, "auto", 1), ("gla", True, True, torch.float32, "recurrent", 1),
    ("simple_gla", True, True, torch.float32, "auto", 2)],
    ids=["gla", "gla-state", "gla-packed", "gla-packed-state", "mlstm", "mlstm-packed-state", "gla-packed-state-bf16",
         "gla-packed-state-recurrent", "simple_gla-packed-state-R2"])
def test_a_replayed_two_phase_chunked_call_equals_the_bound_call(name, packed, with_state, dtype, mode, every,
                                                                 monkeypatch):
    """The chunked forward in two launches (CUDA's: the walk writes checkpoints and final states,
    the output kernel the outputs, and gla's intra kernel before them, its intra-chunk matrices; forced here
    under the interpreter) replays them all: outputs and final
    states bit for bit as bound calls, with and without an initial state and final state, fixed
    length and packed, no launch bound (Launcher.forward unused); mlstm's stabilizer state starts
    at 0 per call; bf16 (its checkpoints in bf16); the packed recurrent forward (one launch) too;
    a checkpoint every two chunks (the replay's output kernel slot table spans two chunks per slot).
    The replayed output against float64."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "CHECKPOINT_EVERY", every)
    op = mixc.load(name)
    sizes = {d: 4 for d in op.ir.dim_names}
    B, T = (1, 20 if every == 1 else 100) if packed else (2, 20)
    args, _ = random_args(op.ir, B=B, T=T, H=2, sizes=sizes, dtype=dtype, seed=12)
    # gla stages its intra-chunk matrices: the intra kernel, the walk and the output kernel
    launches = 1 if mode == "recurrent" else 3 if op.plan().layout.intra_matrices else 2
    # the second sequence across a chunk boundary (C = 16); with R = 2 lengths 40 and 60, whose
    # slot table (first slots bos // 32 + i: 0, 2) differs from one chunk per slot's (0, 3)
    cu = (torch.tensor([0, 5, 20]) if every == 1 else torch.tensor([0, 40, 100])) if packed else None
    st = op(**args, output_final_state=True, cu_seqlens=cu, mode="recurrent")[1] if with_state else None
    op._fast.clear()
    bound_launches = []
    real = Launcher.forward
    monkeypatch.setattr(Launcher, "forward", lambda *a, **kw: (bound_launches.append(1), real(*a, **kw))[1])
    for i in range(2):
        call_in = {k: v + 0.05 * i for k, v in args.items()}
        bound_launches.clear()
        o_fast, st_fast = op(**call_in, initial_state=st, output_final_state=True, cu_seqlens=cu, chunk=16,
                             mode=mode)
        o_only, none = op(**call_in, initial_state=st, cu_seqlens=cu, chunk=16, mode=mode)
        assert none is None and bound_launches == ([] if i else [1] * 2 * launches)   # two calls bound, then none
        assert len(op._fast) == 2 and all(len(r.launches) == launches for r in op._fast.values())
        recipes = dict(op._fast)
        op._fast.clear()
        o_slow, st_slow = op(**call_in, initial_state=st, output_final_state=True, cu_seqlens=cu, chunk=16,
                             mode=mode)
        op._fast = recipes
        torch.testing.assert_close(o_fast, o_slow, rtol=0, atol=0)
        torch.testing.assert_close(o_only, o_slow, rtol=0, atol=0)
        assert st_fast.keys() == st_slow.keys() == {s.name for s in op.ir.states}
        for k in st_slow:
            torch.testing.assert_close(st_fast[k], st_slow[k], rtol=0, atol=0)
    ref, ref_st = op.reference(**{k: v.double() for k, v in call_in.items()}, cu_seqlens=cu,
                               initial_state={k: v.double() for k, v in st.items()} if st else None,
                               output_final_state=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o_fast.double(), ref, rtol=tol, atol=tol)
    for k in ref_st:
        torch.testing.assert_close(st_fast[k].double(), ref_st[k], rtol=tol, atol=tol)


def test_a_launch_setting_changed_after_a_call_is_not_replayed_past(monkeypatch):
    """launch.CHUNK_PHASES (and the block constants, the tuner's mode) are in the key: a call
    after the tests or gpu_check change one runs the launch they ask for."""
    op = mixc.load("gla")
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes=sizes, dtype=torch.float32, seed=11)
    o1, _ = op(**args)
    op(**args)
    phases = []
    real = Launcher.forward
    monkeypatch.setattr(Launcher, "forward",
                        lambda *a, **kw: (phases.append(kw["launch"].get("stage")), real(*a, **kw))[1])
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    o2, _ = op(**args)
    assert phases == ["intra", "walk", "output"]     # gla stages its intra-chunk matrices (the intra kernel, first)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)


class _MustNotLaunch:
    """A kernel that fails the test when launched: replay must refuse the offsets first."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise AssertionError("launched the kernels on offsets that were never checked")
        return launch


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_replay_checks_offsets_written_without_a_version_bump(how, monkeypatch):
    """A write through a numpy view of cu_seqlens (torch.from_numpy) or through .data leaves the
    tensor's _version as it was; replay checked the offsets only on a new _version and launched
    the kernels on [0, 40, 32] (heap corruption, issue 30). It checks their values every call,
    and launches on a copy made from the checked values: a valid change gives the bound call's
    numbers (the output kernel's chunk table is made from the new values too)."""
    import numpy as np
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load("simple_gla")
    args, _ = random_args(op.ir, B=1, T=32, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=31)
    values = np.array([0, 16, 32], dtype=np.int64)
    cu = torch.from_numpy(values)

    def write(i, v):
        if how == "numpy":
            values[i] = v
        else:
            cu.data[i] = v
    with torch.no_grad():
        op(**args, cu_seqlens=cu, mode="chunk")                       # recorded
        op(**args, cu_seqlens=cu, mode="chunk")                       # replayed
        version = cu._version
        write(1, 5)
        assert cu._version == version                                 # what made the cache stale
        o_fast, _ = op(**args, cu_seqlens=cu, mode="chunk")
        o_bound, _ = op(**args, cu_seqlens=torch.tensor([0, 5, 32]), mode="chunk", CK=16)   # another key
        torch.testing.assert_close(o_fast, o_bound, rtol=0, atol=0)
        for recipe in op._fast.values():
            for ln in recipe.launches:
                monkeypatch.setattr(recipe.module, ln.kernel, _MustNotLaunch())
        write(1, 40)
        with pytest.raises(ArgumentError, match=r"non-decreasing, got 40 then 32"):
            op(**args, cu_seqlens=cu, mode="chunk")
        write(1, -8)
        with pytest.raises(ArgumentError, match=r"non-decreasing, got 0 then -8"):
            op(**args, cu_seqlens=cu, mode="chunk")
        write(2, 64)
        with pytest.raises(ArgumentError, match=r"must start at 0 and end at T = 32"):
            op(**args, cu_seqlens=cu, mode="chunk")

"""The autotuner of the kernels' launch (mixc.runtime.autotune): the configuration lists per
transition class, the untuned launch first; one timing pass per key, then the dict (and the
disk) answer; no tuning under the interpreter, during capture or tracing; compile-only shards;
every config compiles for sm_90 (no GPU here: the timing itself runs on a lent GPU,
bench/gpu_check)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import mixc
from mixc.runtime import autotune, launch
from mixc.runtime.autotune import Config
from mixc.runtime.inputs import random_args
from mixc.runtime.signature import bind


def test_chunk_candidates_per_class():
    got = {n: autotune.chunk_candidates(mixc.load(n).plan())
           for n in ("linear_attn", "simple_gla", "retention", "mamba2", "gla", "rwkv6", "delta_rule",
                     "gated_delta_rule", "rwkv7")}
    assert got == {"linear_attn": [64, 32], "simple_gla": [64, 32], "retention": [64, 32], "mamba2": [64, 32],
                   "gla": [64, 32, 16], "rwkv6": [64, 32, 16], "delta_rule": [64, 32], "gated_delta_rule": [64, 32], "rwkv7": [16]}
    for n in got:                       # the default C (the untuned launch) comes first
        plan = mixc.load(n).plan()
        assert autotune.configs(plan, "chunk")[0].C == plan.layout.chunk_size


def test_kernel_config_lists_start_with_the_untuned_launch():
    plan = mixc.load("simple_gla").plan()
    fwd = autotune.configs(plan, "chunk_fwd")
    # two launches, 8 warps first: the static report's fewest spills on sm_90 at K = V = 128
    assert fwd[0] == Config(8, 3, phases=2) and len(set(fwd)) == 4 and {c.num_warps for c in fwd} == {4, 8}
    assert {c.phases for c in fwd} == {1, 2} and autotune.configs(plan, "chunk_bwd") == fwd
    # mamba: tile dim P, split dim N; blocks capped at the dim's power of two
    op = mixc.load("mamba")
    kw, sizes = random_args(op.ir, B=1, T=4, H=2, sizes={"N": 16, "P": 64})
    bound = bind(op.ir, kw)
    rec = autotune.configs(op.plan(), "recurrent_fwd", bound.sizes)
    assert rec[0] == Config(4, 3, tile=32, split=16)
    assert {c.tile for c in rec} == {16, 32, 64} and {c.split for c in rec} == {16} and len(rec) == 6
    rules = launch.rules(op.plan())
    assert rules.dim_blocks(bound, rec[0]) == rules.dim_blocks(bound)
    assert rules.dim_blocks(bound, rec[2])["block", "P"] == 64
    # a spec with neither dim: warps only
    hgrn = mixc.load("hgrn").plan()
    assert all(c.split is None for c in autotune.configs(hgrn, "recurrent_bwd", {"D": 8}))
    with pytest.raises(ValueError, match="form"):
        autotune.configs(plan, "chunk_fw")


def _fake_key(name="k"):
    return ("hash", (), "chunk_fwd", (("K", 16),), "torch.bfloat16", 64, "many", name)


def test_pick_times_once_then_answers_from_memory_and_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MIXC_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "_quiet", lambda: False)
    times = {Config(4, 3): 2.0, Config(8, 3): 1.0, Config(4, 2): 3.0}
    calls = []

    def run(cfg):
        calls.append(cfg)
        if cfg.num_stages == 1:
            raise RuntimeError("out of resources")       # skipped, not fatal

    monkeypatch.setattr(autotune, "bench", lambda fn: (fn(), times[calls[-1]])[1])
    cands = list(times) + [Config(8, 1)]
    autotune.clear()
    before = dict(autotune.STATS)
    assert autotune.pick(_fake_key(), cands, run) == Config(8, 3)
    assert set(calls) == set(cands) and autotune.STATS["tuned"] == before["tuned"] + 1
    n = len(calls)
    assert autotune.pick(_fake_key(), cands, run) == Config(8, 3)        # the second call pays a lookup
    assert len(calls) == n and autotune.STATS["memory_hits"] == before["memory_hits"] + 1
    autotune.clear()                                                   # a new process: the disk answers
    assert autotune.pick(_fake_key(), cands, run) == Config(8, 3)
    assert len(calls) == n and autotune.STATS["disk_hits"] == before["disk_hits"] + 1
    saved = [json.loads(p.read_text()) for p in (tmp_path / "autotune").glob("*.json")]
    assert len(saved) == 1 and saved[0]["config"]["num_warps"] == 8 and len(saved[0]["timings"]) == 4
    autotune.clear()
    assert autotune.pick(_fake_key("other device"), cands, run) == Config(8, 3)
    assert len(calls) > n                                              # another key is timed again


def test_no_timing_when_quiet_and_compile_shards(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path))
    cands = [Config(4, 3), Config(4, 2), Config(8, 3), Config(8, 2)]
    calls = []
    autotune.clear()
    monkeypatch.setattr(autotune, "_quiet", lambda: True)              # capture or tracing: the default
    assert autotune.pick(_fake_key(), cands, calls.append) == cands[0] and not calls
    monkeypatch.setattr(autotune, "_quiet", lambda: False)
    monkeypatch.setenv("MIXC_AUTOTUNE", "compile")
    monkeypatch.setenv("MIXC_AUTOTUNE_SHARD", "1/2")
    assert autotune.pick(_fake_key(), cands, calls.append) == cands[1]
    assert calls == [cands[1], cands[3]] and not list(tmp_path.glob("autotune/*"))
    calls.clear()                                                      # the "chunk" form runs every C
    k = _fake_key()[:2] + ("chunk",) + _fake_key()[3:]
    assert autotune.pick(k, [Config(C=64), Config(C=32)], calls.append) == Config(C=64)
    assert calls == [Config(C=64), Config(C=32)]


def test_interpreter_launch_is_untuned(monkeypatch):
    """The tests' CPU path: no tuning, the launch exactly as before (no num_warps / num_stages)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert not autotune.active(torch.device("cpu"))
    op = mixc.load("simple_gla")
    kw, _ = random_args(op.ir, B=1, T=8, H=1, sizes={"K": 16, "V": 16}, dtype=torch.float32)
    bound = bind(op.ir, kw)
    assert launch._tuned(op.plan(), bound, "chunk_fwd", lambda cfg: None, 64) is None
    assert launch.chunk_size_for(op.plan(), bound) == op.plan().layout.chunk_size
    monkeypatch.setattr(autotune, "_device", lambda index: ("fake GPU", 132))
    k = [autotune.key(op.plan(), "chunk_fwd", bound.sizes, torch.bfloat16, p, torch.device("cuda", 0), 64)
         for p in (16, 1000)]
    assert k[0][6] == "few" and k[1][6] == "many" and k[0][-1] == "fake GPU"


def test_tuned_blocks_compute_the_same(monkeypatch):
    """Tile and split blocks (and warps) are correctness-neutral, also when the backward's
    differ from the forward's: mamba (tile P, split N) under each of a few config pairs equals
    the untuned run in the output and every gradient."""
    op = mixc.load("mamba")
    kw, sizes = random_args(op.ir, B=1, T=5, H=1, sizes={"N": 64, "P": 48}, dtype=torch.float32, seed=4)

    def run():
        x = {k: v.detach().clone().requires_grad_(True) for k, v in kw.items()}
        o, _ = op(**x, mode="recurrent")
        o.square().sum().backward()
        return [o.detach()] + [x[k].grad for k in sorted(x)]

    want = run()
    plan = op.plan()
    fwd = autotune.configs(plan, "recurrent_fwd", sizes)
    bwd = autotune.configs(plan, "recurrent_bwd", sizes)
    assert {c.split for c in fwd} == {64, 32} and {c.tile for c in fwd} == {32, 16, 64}
    for cf, cb in ((fwd[1], bwd[-1]), (fwd[-1], bwd[2]), (fwd[5], bwd[0])):
        monkeypatch.setattr(launch, "_tuned", lambda plan, bound, form, run, C=None, cf=cf, cb=cb:
                            {"recurrent_fwd": cf, "recurrent_bwd": cb}.get(form))
        for a, b in zip(run(), want):           # fp32 sums in another order: relative to the largest
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


SCRIPT = r"""
import json, sys
from mixc.tools.aot import compile_kernel, signature
from mixc.codegen.launch_plan import stage_kernel_name
from mixc.runtime import autotune
from mixc.runtime.cache import load_module
import mixc
out = []
for name, sizes in (("simple_gla", {"K": 16, "V": 16}), ("mamba", {"N": 16, "P": 64})):
    plan = mixc.load(name).plan()
    mod = load_module(plan)
    for form, kname in mod.METADATA["kernels"].items():
        if form.startswith("chunk"):
            second = "output" if form == "chunk_fwd" else "tiles"
            for C in autotune.chunk_candidates(plan):
                for cfg in autotune.configs(plan, form):
                    # what the config launches: the walk and the output (tiles) kernel, the latter at
                    # one stage, or the fused walk
                    launches = [("walk", cfg.num_stages), (second, 1)] if cfg.phases == 2 else [("fused", cfg.num_stages)]
                    for stage, stages in launches:
                        kernel = getattr(mod, stage_kernel_name(plan, form, stage))
                        sig, const = signature(kernel, plan, sizes)
                        ck = compile_kernel(kernel, sig, dict(const, _BLOCK__T=C), num_warps=cfg.num_warps,
                                            num_stages=stages)
                        out.append((name, form, C, stage, cfg.num_warps, stages, len(ck.asm["cubin"]) > 0))
        else:
            kernel = getattr(mod, kname)
            sig, const = signature(kernel, plan, sizes)
            for cfg in autotune.configs(plan, form, sizes):
                c = dict(const)
                if cfg.tile: c["_BLOCK_" + plan.layout.tile] = cfg.tile
                if cfg.split: c["_BLOCK_" + plan.layout.split] = cfg.split
                ck = compile_kernel(kernel, sig, c, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                out.append((name, form, cfg.tile, cfg.split, cfg.num_warps, len(ck.asm["cubin"]) > 0))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_config_compiles_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert all(r[-1] for r in got)
    # simple_gla: 2 C x (3 two-launch configs x the walk and the output (tiles) kernel + 1 fused walk) x 2 chunked forms;
    # mamba's recurrent kernels: 6 configs each
    assert sum(r[0] == "simple_gla" and r[1].startswith("chunk") for r in got) == 28
    assert sum(r[0] == "mamba" for r in got) == 12


@pytest.mark.parametrize("bad", [{"C": 0}, {"num_warps": -3}, {"num_warps": 6}, {"num_stages": "3"},
                                 {"tile": 0}, {"phases": 3}, {"C": 48}, {"num_warps": True}])
def test_a_disk_entry_that_could_not_have_been_written_is_retuned(monkeypatch, tmp_path, bad):
    """Autotune JSON from another process or a hand edit is type- and range-checked: an entry
    with C = 0 or num_warps = -3 is timed again, never launched (issue 30)."""
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path))
    k = _fake_key("bad entry")
    autotune._disk_put(k, Config(8, 3, C=64), [])
    path = next((tmp_path / "autotune").glob("*.json"))
    assert autotune._disk_get(k) == Config(8, 3, C=64)
    data = json.loads(path.read_text())
    data["config"].update(bad)
    path.write_text(json.dumps(data))
    assert autotune._disk_get(k) is None


@pytest.mark.parametrize("fault", [
    lambda: torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    lambda: RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    lambda: RuntimeError("CUDA error: misaligned address"),
], ids=["AcceleratorError", "triton-launch", "RuntimeError"])
def test_pick_reraises_a_device_fault_at_once(monkeypatch, tmp_path, fault):
    """A CUDA fault poisons the context: no failing config to skip (every later config would
    fail with it, the fault blamed on the next CUDA call), so pick raises at once, naming the
    config and the kernel form; in a nested pick (chunk_size_for's C over chunk_fwd's configs)
    the inner one's error passes unchanged."""
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MIXC_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "_quiet", lambda: False)
    monkeypatch.setattr(autotune, "bench", lambda fn: (fn(), 1.0)[1])
    cands = [Config(8, 3, phases=2), Config(4, 3, phases=2), Config(8, 1, phases=1)]
    calls = []

    def run(cfg):
        calls.append(cfg)
        if cfg == cands[1]:
            raise fault()
    autotune.clear()
    with pytest.raises(autotune.DeviceFault, match=r"'chunk_fwd'.*num_warps=4, num_stages=3") as info:
        autotune.pick(_fake_key(), cands, run)
    assert calls == [cands[0], cands[0], cands[1]]          # the third config never ran
    assert isinstance(info.value.__cause__, RuntimeError)
    k = _fake_key()[:2] + ("chunk",) + _fake_key()[3:]
    autotune.clear()
    with pytest.raises(autotune.DeviceFault, match="'chunk_fwd'"):
        autotune.pick(k, [Config(C=64), Config(C=32)], lambda c: autotune.pick(_fake_key(), cands, run))
    monkeypatch.setenv("MIXC_AUTOTUNE", "compile")           # compile-only runs stop alike
    autotune.clear()
    calls.clear()
    with pytest.raises(autotune.DeviceFault):
        autotune.pick(_fake_key(), cands, run)
    assert calls == cands[:2]


def test_pick_still_skips_configs_that_do_not_fit(monkeypatch, tmp_path):
    """Out of resources, a compile error, out of memory: skipped, not a device fault."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MIXC_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "_quiet", lambda: False)
    monkeypatch.setattr(autotune, "bench", lambda fn: (fn(), 1.0)[1])
    errors = {Config(8, 3): OutOfResources(300000, 232448, "shared memory"),
              Config(4, 3): torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
              Config(4, 2): ValueError("a compile error")}
    assert not any(autotune.device_fault(e) for e in errors.values())

    def run(cfg):
        if cfg in errors:
            raise errors[cfg]
    autotune.clear()
    assert autotune.pick(_fake_key(), list(errors) + [Config(8, 1)], run) == Config(8, 1)

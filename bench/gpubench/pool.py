"""Worker processes of bench/gpu_check's first phase: the correctness checks of each spec, and on
CUDA the warm-up that compiles, in parallel, every kernel the timing phase will launch, so that
phase finds them in Triton's disk cache and only times.

Compiling dominates a cold run: one of mixc's chunked kernels at K = V = 128 takes seconds to
compile, and fla's ops try 57 to 266 autotune configs each (Hopper lists, K = V = 128). The
warm-up launches every config once at the real shape (same H, so the same specialization)
without timing it: mixc's through MIXC_AUTOTUNE=compile, fla's through a benchmarker that
calls the kernel once and reports a constant (and FLA_CACHE_RESULTS=0, so no choice made here
is kept). Each list is split into shards, one task each. The timing phase then runs both
autotuners for real, in one process, with the GPU to itself."""
from __future__ import annotations

import os
import traceback

_SHARD = (0, 1)


def init_worker(dry: bool) -> None:
    os.environ["FLA_CACHE_RESULTS"] = "0"            # read when fla is imported
    os.environ["MIXC_AUTOTUNE"] = "0"
    if dry:
        return
    import triton
    from triton.runtime.autotuner import Autotuner

    def compile_only(fn, quantiles=None, **_):
        fn()                                        # compiles (into the disk cache) and launches once
        return [1.0, 1.0, 1.0] if quantiles else 1.0
    triton.runtime.driver.active.get_benchmarker = lambda: compile_only
    orig = Autotuner._bench

    def sharded(self, *args, config, **meta):
        i, n = _SHARD
        if self.configs.index(config) % n != i:
            return [float("inf")] * 3
        return orig(self, *args, config=config, **meta)
    Autotuner._bench = sharded


def run_task(task: dict) -> dict:
    """One task: {"kind": "correct" | "warm_mixc" | "warm_fla" | "warm_decode", ...} ->
    {"task": task, "rows": [...] (correctness), "error": str (a failed warm-up)}."""
    global _SHARD
    import time
    t0 = time.perf_counter()
    out = {"task": task}
    try:
        if task["kind"] == "correct":
            from .correct import check_spec
            os.environ["MIXC_AUTOTUNE"] = "0"
            out["rows"] = check_spec(task["spec"], task["device"], task["dry"], task.get("modes"))
        else:
            os.environ["MIXC_AUTOTUNE"] = "compile"
            os.environ["MIXC_AUTOTUNE_SHARD"] = f"{task['shard']}/{task['shards']}"
            _SHARD = (task["shard"], task["shards"])
            _warm(task)
    except Exception as err:                        # noqa: BLE001 - reported, the run goes on
        out["error"] = f"{type(err).__name__}: {err}"[:1000]
        out["traceback"] = traceback.format_exc()[-3000:]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _warm(task: dict) -> None:
    import torch

    from . import fla_ops
    from .timing import make_inputs, mixc_call
    spec, D, device = task["spec"], task["D"], task.get("device", "cuda")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if task["kind"] == "warm_decode":
        B, H = task["B"], task["H"]
        op, kw, sizes = make_inputs(spec, B, 1, H, D, device, dtype)
        names = {d.name for d in op.ir.inputs}
        state = {s.name: 0.5 * torch.randn((B, H) + tuple(sizes[d] for d in s.shape), device=device)
                 for s in op.ir.states}
        op.step(**{k: (v[:, 0] if k in names else v) for k, v in kw.items()}, state=state)
        sync()
        return
    fla = None
    if task["kind"] == "warm_fla":
        fla, why = fla_ops.load()
        if fla is None:
            raise RuntimeError(why)
    for B, T, H in task["shapes"]:
        op, kw, _ = make_inputs(spec, B, T, H, D, device, dtype)
        if task["kind"] == "warm_mixc":
            call, _ = mixc_call(op, kw, device)
        else:
            call = lambda x: fla_ops.call(spec, fla, x)      # noqa: E731
        leaves = {k: v.detach().requires_grad_(True) for k, v in kw.items()}
        o = call(leaves)
        torch.autograd.backward(o, torch.randn_like(o))
        sync()
        del kw, leaves, o
        if device == "cuda":
            torch.cuda.empty_cache()

"""Which variant of the scalar decay's chunked forward faults on the GPU (the H200 run of
2026-12-04: retention and simple_gla, "illegal memory access" at K = V = 128 bf16). The
interpreter's bounds checker (tests/interpreter_bounds.py) finds every access of these launches
in bounds, and probe.py's simple_gla log blames the forward output kernel (PHASE 2 then) of the first config (grid
(3072, 4, 1): V blocks of 32, 8 warps, a checkpoint every 4 chunks, KEY_BLOCK 64). Each variant
runs one op call (forward, then backward with ones) in a process of its own, all at once (a
fault poisons only its own context), MIXC_AUTOTUNE=0 (the list's first config), a synchronize
after every launch:

    python3 bench/gpubench/p2_fault.py [B T H D] [--timeout S]     # default 1 2048 16 128

Variants: the launch as on the H200; the output kernel in V blocks of 64 (the walk's: the scalar class's
output_tile off); the output kernel at 4 warps; a checkpoint every chunk (CKPT_EVERY 1); one launch (the fused
kernels); fp16; fp32. Prints one line per (spec, variant): ok or the error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VARIANTS = {"as-run": {}, "p2-tile-64": {"tile": None}, "p2-4-warps": {"p2_warps": 4}, "every-1": {"every": 1},
            "one-launch": {"phases": 1}, "fp16": {"dtype": "float16"}, "fp32": {"dtype": "float32"}}


def one(spec: str, variant: str, B: int, T: int, H: int, D: int) -> str:
    import torch
    sys.path.insert(0, str(ROOT))
    from mixc import classes
    from mixc.standalone import kernel_args
    from mixc.runtime import launch
    v = VARIANTS[variant]
    if "tile" in v:
        classes.unit("scalar decay").__class__.output_tile = v["tile"]
    if "every" in v:
        launch.CHECKPOINT_EVERY = v["every"]
    if "phases" in v:
        launch.CHUNK_PHASES = v["phases"]
    cuda = torch.cuda.is_available()
    orig = kernel_args.KernelArgs.launch

    def traced(self, kernel, grid, values):
        if "p2_warps" in v and values.get("stage") == "output" and "num_warps" in values:
            values = dict(values, num_warps=v["p2_warps"])
        orig(self, kernel, grid, values)
        if cuda:
            torch.cuda.synchronize()
    kernel_args.KernelArgs.launch = traced
    import mixc
    op = mixc.load(spec)
    dtype = getattr(torch, v.get("dtype", "bfloat16"))
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    kw = {d.name: torch.randn((B, T, H) + (D,) * len(d.shape), generator=gen, device=dev).to(dtype).requires_grad_()
          for d in op.ir.given_inputs}
    if "g" in kw:                                          # a log decay: negative
        kw["g"] = (-torch.rand((B, T, H), generator=gen, device=dev) * 0.1).to(dtype).requires_grad_()
    o, _ = op(**kw, mode="chunk", chunk=64)
    o.backward(torch.ones_like(o))
    if cuda:
        torch.cuda.synchronize()
    return f"ok |o| max {o.float().abs().max().item():.3g}"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--one":
        spec, variant, *dims = argv[1:]
        try:
            print(json.dumps({"result": one(spec, variant, *map(int, dims))}))
        except Exception as err:                           # noqa: BLE001 - the point is to report it
            print(json.dumps({"result": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"}))
        return 0
    timeout = 300
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    dims = argv[:4] or ["1", "2048", "16", "128"]
    env = dict(os.environ, MIXC_AUTOTUNE="0", CUDA_LAUNCH_BLOCKING="1")
    procs = {(s, n): subprocess.Popen([sys.executable, __file__, "--one", s, n, *dims], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env)
             for s in ("retention", "simple_gla") for n in VARIANTS}
    for (s, n), p in procs.items():
        try:
            out, _ = p.communicate(timeout=timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            res = json.loads(lines[-1])["result"] if lines else "no result: " + out.strip()[-200:]
        except subprocess.TimeoutExpired:
            p.kill()
            res = f"timed out after {timeout} s"
        print(f"{s:12s} {n:12s} {res}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

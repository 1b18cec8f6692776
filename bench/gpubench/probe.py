"""Find which launch of one op call faults on CUDA: every kernel launch of mixc's op is followed
by a synchronize and named in the log, so an illegal memory access is blamed on its kernel, grid
and constexprs. Run one case per process (a CUDA fault poisons the context):

    CUDA_LAUNCH_BLOCKING=1 python3 bench/gpubench/probe.py retention 1 8192 96 128 [fwd|bwd] [C]
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    from gpubench import wheels
    wheels.activate()
    import torch

    from gpubench.timing import make_inputs
    from mixc.standalone import kernel_args
    spec, B, T, H, D = argv[0], *map(int, argv[1:5])
    passes = argv[5] if len(argv) > 5 else "bwd"
    chunk = int(argv[6]) if len(argv) > 6 else None
    cls = kernel_args.KernelArgs
    orig = cls.launch

    def traced(self, kernel, grid, values):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        consts = {str(k): v for k, v in values.items() if isinstance(v, (int, bool)) and not isinstance(v, torch.Tensor)}
        print(f"  launch {name} grid={grid} {consts}", flush=True)
        orig(self, kernel, grid, values)
        if dev == "cuda":
            torch.cuda.synchronize()
    cls.launch = traced
    dev = "cuda" if torch.cuda.is_available() else "cpu"    # cpu: TRITON_INTERPRET=1, tiny shapes
    op, kw, sizes = make_inputs(spec, B, T, H, D, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    print(f"{spec} B={B} T={T} H={H} D={D} chunk={chunk}", flush=True)
    try:
        leaves = {k: v.detach().requires_grad_(passes == "bwd") for k, v in kw.items()}
        t0 = time.perf_counter()
        o, _ = op(**leaves, mode="chunk", **({"chunk": chunk} if chunk else {}))
        torch.cuda.synchronize() if dev == "cuda" else None
        print(f"forward ok {time.perf_counter() - t0:.1f} s, |o| max {o.float().abs().max().item():.3g}", flush=True)
        if passes == "bwd":
            o.backward(torch.randn_like(o))
            torch.cuda.synchronize() if dev == "cuda" else None
            print("backward ok", flush=True)
    except Exception:                                      # noqa: BLE001 - the point is to print it
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

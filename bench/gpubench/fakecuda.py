"""A stand-in CUDA device for compiling kernels ahead of time on a machine with no GPU: Triton's
active driver answers as an sm_90 device (H100's limits), torch.cuda's queries answer alike, and
every @triton.jit launch compiles (JITFunction.run with warmup=True: the runtime's own
specialization of the arguments, constexprs and options) and records the kernel instead of
running it. The ops themselves run on CPU tensors, so their host code picks the block sizes,
heuristics and grids it would pick on the GPU; kernel outputs stay unwritten.

Autotuned kernels: no config can be timed here, so `install(pick=...)` chooses one per
kernel without compiling the others (bench/gpubench/static.py: the "typical" config).

Use it only in a process of its own: it patches torch.cuda and Triton for good."""
from __future__ import annotations

RECORDS: list[dict] = []
PHASE = {"name": ""}
H100 = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
        "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


def install(arch: int = 90, pick=None) -> None:
    """pick(autotuner, config) -> a sort key (lower is chosen) for autotuned kernels; default:
    the first config of each list."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from triton.runtime.autotuner import Autotuner

    class _Utils:
        @staticmethod
        def get_device_properties(_index):
            return dict(H100)

    class _Driver:
        utils = _Utils()

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, _device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            return lambda fn, quantiles=None, **_: [1.0, 1.0, 1.0]

        def get_empty_cache_for_benchmark(self):
            return torch.empty(1)

        def is_active(self):
            return True

    triton.runtime.driver.set_active(_Driver())
    torch.cuda.get_device_name = lambda *a, **k: f"NVIDIA H100 (stand-in, sm_{arch})"
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    torch.cuda.device_count = lambda: 1

    orig_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        consts = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int)) and k in self.arg_names
                  and self.params[self.arg_names.index(k)].is_constexpr}
        named = dict(zip(self.arg_names, args)) | kwargs
        tensors = {k: {"nbytes": v.numel() * v.element_size(), "ptr": v.data_ptr(), "shape": tuple(v.shape),
                       "dtype": str(v.dtype).replace("torch.", "")}
                   for k, v in named.items() if isinstance(v, torch.Tensor)}
        scalars = {k: v for k, v in named.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        try:                                        # the grid, for the traffic report's FLOP count
            g = grid(named) if callable(grid) else grid
            g = tuple(int(x) for x in g) + (1,) * (3 - len(g))
        except Exception:                           # noqa: BLE001 - a grid of defaults not passed: unknown
            g = None
        RECORDS.append({"kind": "triton", "phase": PHASE["name"], "module": self.module, "kernel": self.fn.__name__,
                        "compiled": kernel, "constexprs": consts, "tensors": tensors, "scalars": scalars, "grid": g,
                        "num_warps": kwargs.get("num_warps", kernel.metadata.num_warps),
                        "num_stages": kwargs.get("num_stages", kernel.metadata.num_stages)})
        return kernel
    jit.JITFunction.run = run

    def _bench(self, *args, config, **meta):        # no timing here: rank by pick, compile only the winner
        score = pick(self, config) if pick is not None else self.configs.index(config)
        return [score, score, score]
    Autotuner._bench = _bench


def fla_on_device_0() -> None:
    """fla picks block sizes with check_shared_mem(arch, tensor.device.index): on a GPU the index
    is 0, but the CPU tensors here have index None, which check_shared_mem swallows as "not that
    much shared memory" (BK = BV = 32 in three Hopper backward kernels, not 64). Answer a None
    index as device 0's. Call after fla is imported, before its first op."""
    import fla.utils.hardware as hw

    class _Device0(list):
        def __getitem__(self, i):
            return super().__getitem__(0 if i is None else i)
    orig = hw.get_all_max_shared_mem
    hw.get_all_max_shared_mem = lambda: _Device0(orig())
    hw.check_shared_mem.cache_clear()


def usage(kernel, arch: int = 90) -> dict:
    """Registers and spills (ptxas -v on the kernel's PTX), shared memory, tensor-core instructions."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from mixc.tools.aot import ptxas_usage
    ptx = kernel.asm["ptx"]
    tc = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None
    return {**ptxas_usage(ptx, arch), "shared_bytes": kernel.metadata.shared, "tensor_cores": tc}

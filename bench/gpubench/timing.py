"""Sections (b) and (c): chunked forward and forward + backward of mixc's ops against fla's and
against SDPA (flash backend pinned, cuDNN where present), and one decode step under CUDA
graphs against SDPA decode over a KV cache. One row per (implementation, pass, shape)."""
from __future__ import annotations

import math
import time

from . import fla_ops
from . import formulas as Fm

# triton.testing.do_bench for the reported timings (ms of warm-up and of repetitions)
WARMUP_MS, REP_MS = 10, 50
# the autotuners (fla's triton.autotune and mixc's) time each config with these
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 20


def use_tuning_benchmarker() -> None:
    """Both autotuners (fla's `triton.autotune`, mixc.runtime.autotune) ask the active driver
    for its benchmarker: time their configs with shorter runs than the reported timings."""
    import functools

    import triton
    import triton.testing
    triton.runtime.driver.active.get_benchmarker = lambda: functools.partial(
        triton.testing.do_bench, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS)


def bench(fn, device: str, grad_to_none=None) -> float:
    """Median ms: do_bench on CUDA (after its warm-up); on the CPU one warm-up call and one timed
    call (the dry run checks that the code runs; its numbers mean nothing)."""
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grad_to_none,
                                             return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def make_inputs(spec: str, B: int, T: int, H: int, D: int, device: str, dtype, seed: int = 2):
    """(op, kwargs, sizes): the spec's inputs and params drawn on the device by the roles of
    mixc.runtime.inputs (negative log gates, beta in (0, 1), ...), every dim of size D; the
    delta rules get l2-normalized keys (both implementations see the same tensors)."""
    import torch
    import torch.nn.functional as F

    import mixc
    from mixc.runtime.inputs import ROLES, _normal
    op = mixc.load(spec)
    sizes = {d.name: D for d in op.ir.dims if not d.alias_of}
    for d in op.ir.dims:
        sizes.setdefault(d.name, sizes.get(op.ir.root_dim(d.name)))
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = {}
    with torch.device(device):
        for decl, lead in [(d, (B, T, H)) for d in op.ir.given_inputs] + [(d, (H,)) for d in op.ir.params]:
            shape = lead + tuple(sizes[x] for x in decl.shape)
            fn = ROLES.get((spec, decl.name)) or ROLES.get(decl.name) or _normal
            kw[decl.name] = fn(shape, gen, torch.float32).to(dtype)
    if spec in Fm.RANK1:
        kw["k"] = F.normalize(kw["k"].float(), dim=-1).to(dtype)
    return op, kw, sizes


def _timed_pair(call, kw: dict, device: str) -> dict:
    """{"fwd": ms, "fwd_bwd": ms} of call(kw) -> output, with gradients for every tensor of kw."""
    import torch
    out = {}
    with torch.no_grad():
        out["fwd"] = bench(lambda: call(kw), device)
    leaves = {k: v.detach().requires_grad_(True) for k, v in kw.items()}
    o = call(leaves)
    do = torch.randn_like(o)
    out["fwd_bwd"] = bench(lambda: torch.autograd.backward(call(leaves), do), device, grad_to_none=list(leaves.values()))
    return out


def mixc_call(op, kw: dict, device: str):
    """op in chunk mode at the tuned chunk size (launch.chunk_size_for), and the chosen C."""
    from mixc.runtime.launch import chunk_size_for
    from mixc.runtime.signature import bind
    C = chunk_size_for(op.plan(), bind(op.ir, dict(kw)))
    return (lambda x: op(**x, mode="chunk", chunk=C)[0]), C


def sdpa_backends(device: str) -> dict:
    """Implementation name -> SDPBackend (None: torch's own choice, on the CPU)."""
    if device != "cuda":
        return {"sdpa": None}
    from torch.nn.attention import SDPBackend
    out = {"sdpa_flash": SDPBackend.FLASH_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out["sdpa_cudnn"] = SDPBackend.CUDNN_ATTENTION
    return out


def _sdpa_call(backend, **kw):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    if backend is None:
        return lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], **kw)

    def call(x):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], **kw)
    return call


def time_shape(section: str, shape: tuple, specs: list[str], device: str, fla, fla_why: str,
               bandwidth: float, with_fla: bool, emit) -> None:
    """Time SDPA, then each spec's mixc and fla ops at one (B, T, H, D) (the rank-1 class's also
    with its staged inverse: impl "mixc staged solve"); emit(row) per result."""
    import torch
    from mixc import classes
    from mixc.runtime import launch
    B, T, H, D = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = {"section": section, "B": B, "T": T, "H": H, "D": D}
    tokens = B * T * H
    sdpa_ms = {}
    for name, backend in sdpa_backends(device).items():
        row = dict(base, spec="attention", impl=name)
        try:
            x = {n: torch.randn(B, H, T, D, device=device, dtype=dtype) for n in "qkv"}
            ms = _timed_pair(_sdpa_call(backend, is_causal=True), x, device)
            fl = Fm.sdpa_flops(T, D, D)
            by = Fm.floor_bytes(3 * D, D)
            for p in ("fwd", "fwd_bwd"):
                sdpa_ms[(name, p)] = ms[p]
                emit(dict(row, **{"pass": p, "ms": ms[p], "tflops": Fm.tflops(fl[p] * tokens, ms[p]),
                                  "floor_x": Fm.floor_multiple(by[p] * tokens, ms[p], bandwidth)}))
        except Exception as err:                  # noqa: BLE001 - recorded, the run goes on
            emit(dict(row, error=f"{type(err).__name__}: {err}"[:500]))
        torch.cuda.empty_cache() if device == "cuda" else None
    ref = "sdpa_flash" if device == "cuda" else "sdpa"
    for spec in specs:
        try:
            op, kw, sizes = make_inputs(spec, B, T, H, D, device, dtype)
        except Exception as err:                  # noqa: BLE001
            emit(dict(base, spec=spec, impl="mixc", error=f"inputs: {type(err).__name__}: {err}"[:500]))
            continue
        n_in, n_out = Fm.io_elements(op.ir, sizes)
        K = V = D
        fl, by = Fm.chunk_flops(spec, K, V), Fm.floor_bytes(n_in, n_out)
        rows, ms_of = [], {}
        fla_skip = None if not with_fla else (None if fla is not None else fla_why)
        impls = [("mixc", None)]
        if any(classes.unit(st.transition).stages_solve for st in op.plan().states):
            # the rank-1 walk reading the inverses the intra kernel staged (launch.STAGE_SOLVE, off by default)
            impls.append(("mixc staged solve", None))
        impls.append(("fla", fla_skip if with_fla else "skipped: D not in --fla-dims"))
        for impl, skip in impls:
            row = dict(base, spec=spec, impl=impl)
            if skip:
                rows.append(dict(row, skipped=skip))
                continue
            saved = launch.STAGE_SOLVE
            try:
                launch.STAGE_SOLVE = impl == "mixc staged solve"
                if impl.startswith("mixc"):
                    call, row["C"] = mixc_call(op, kw, device)
                else:
                    call = lambda x, s=spec: fla_ops.call(s, fla, x)      # noqa: E731
                ms = _timed_pair(call, kw, device)
                for p in ("fwd", "fwd_bwd"):
                    ms_of[(impl, p)] = ms[p]
                    r = dict(row, **{"pass": p, "ms": ms[p], "tflops": Fm.tflops(fl[p] * tokens, ms[p]),
                                     "floor_x": Fm.floor_multiple(by[p] * tokens, ms[p], bandwidth)})
                    if (ref, p) in sdpa_ms:
                        r["ratio_sdpa"] = ms[p] / sdpa_ms[(ref, p)]
                    rows.append(r)
            except Exception as err:              # noqa: BLE001 - recorded, the run goes on
                rows.append(dict(row, error=f"{type(err).__name__}: {err}"[:500]))
            finally:
                launch.STAGE_SOLVE = saved
        for r in rows:                           # mixc's ms over fla's, on both rows
            p = r.get("pass")
            if ("mixc", p) in ms_of and ("fla", p) in ms_of:
                r["ratio_fla"] = ms_of[("mixc", p)] / ms_of[("fla", p)]
            emit(r)
        del kw
        torch.cuda.empty_cache() if device == "cuda" else None


def time_decode(specs: list[str], contexts: list[int], B: int, H: int, D: int, device: str, bandwidth: float,
                emit, fla: dict | None = None) -> None:
    """One decode step of B sequences (op.step, the recurrent kernel at T = 1) under a CUDA graph,
    fla's fused recurrent kernel at T = 1 on the same inputs and state where fla has the op, and
    SDPA decode (one query, flash backend) over a bf16 KV cache of each context length."""
    import torch
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    graphs = device == "cuda"
    note = None if graphs else "eager: CUDA graphs need a CUDA device"
    for spec in specs:
        row = {"section": "decode", "spec": spec, "impl": "mixc", "B": B, "H": H, "D": D, "context": None}
        ms_of, rows = {}, []
        try:
            op, kw, sizes = make_inputs(spec, B, 1, H, D, device, dtype)
            names = {d.name for d in op.ir.inputs}
            step_kw = {k: (v[:, 0] if k in names else v) for k, v in kw.items()}
            state = {s.name: 0.5 * torch.randn((B, H) + tuple(sizes[d] for d in s.shape), device=device)
                     for s in op.ir.states}
            n_in, n_out = Fm.io_elements(op.ir, sizes)
            f = Fm.decode_step(spec, D, D, n_in, n_out)
            calls = {"mixc": lambda: op.step(**step_kw, state=state)}
            if fla is not None and spec in fla_ops.FLA_DECODE and len(state) == 1:
                S = next(iter(state.values()))
                calls["fla"] = lambda: fla_ops.call_step(spec, fla, kw, S)
            for impl, fn in calls.items():
                try:
                    ms_of[impl] = _bench_graph(fn, device)
                    rows.append(dict(row, impl=impl, ms=ms_of[impl], graph=graphs, note=note,
                                     tflops=Fm.tflops(f["flops"] * B * H, ms_of[impl]),
                                     floor_x=Fm.floor_multiple(f["bytes"] * B * H, ms_of[impl], bandwidth)))
                except Exception as err:          # noqa: BLE001
                    rows.append(dict(row, impl=impl, error=f"{type(err).__name__}: {err}"[:500]))
        except Exception as err:                  # noqa: BLE001
            rows.append(dict(row, error=f"{type(err).__name__}: {err}"[:500]))
        for r in rows:                            # mixc's ms over fla's, on both rows
            if "mixc" in ms_of and "fla" in ms_of:
                r["ratio_fla"] = ms_of["mixc"] / ms_of["fla"]
            emit(r)
    for name, backend in sdpa_backends(device).items():
        if name == "sdpa_cudnn":
            continue
        for L in contexts:
            row = {"section": "decode", "spec": "attention", "impl": name, "B": B, "H": H, "D": D, "context": L}
            try:
                x = {"q": torch.randn(B, H, 1, D, device=device, dtype=dtype),
                     "k": torch.randn(B, H, L, D, device=device, dtype=dtype),
                     "v": torch.randn(B, H, L, D, device=device, dtype=dtype)}
                call = _sdpa_call(backend)
                ms = _bench_graph(lambda: call(x), device)
                f = Fm.sdpa_decode(L, D, D)
                emit(dict(row, ms=ms, graph=graphs, note=note, tflops=Fm.tflops(f["flops"] * B * H, ms),
                          floor_x=Fm.floor_multiple(f["bytes"] * B * H, ms, bandwidth)))
                x = None                              # free the cache before the next context
            except Exception as err:              # noqa: BLE001
                emit(dict(row, error=f"{type(err).__name__}: {err}"[:500]))
            torch.cuda.empty_cache() if device == "cuda" else None


def _bench_graph(fn, device: str) -> float:
    """Median ms of replaying fn captured in a CUDA graph (triton.testing.do_bench_cudagraph,
    after eager warm-up calls that compile and tune); eager timing on the CPU."""
    if device != "cuda":
        return bench(fn, device)
    import torch
    import triton.testing
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median"))


def measure_bandwidth(device: str) -> dict:
    """Device-to-device copy of 1 GiB (bytes read + written per second): the memory floor's
    bandwidth. The CPU dry run takes a nominal 1e11 B/s."""
    if device != "cuda":
        return {"copy_bytes_per_s": 1e11, "note": "nominal (CPU dry run)"}
    import torch
    x = torch.empty(2 ** 29, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), device)
    return {"copy_bytes_per_s": 2 * x.numel() * x.element_size() / (ms * 1e-3), "copy_ms": ms}


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

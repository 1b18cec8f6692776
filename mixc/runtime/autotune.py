"""Autotuning of the generated kernels' launch on CUDA: chunk size, tile and split blocks,
warps and stages, chosen by timing a configuration list generated per transition class.

Why not the `@triton.autotune` decorator: the chunk size C fixes the layout of the
checkpoints the backward reads (slot = chunk index), and the recurrent kernels' tile and
split blocks fix the grid and the partial-gradient buffers the host allocates and sums. Those
are host decisions, so the tuner times whole launches (`launch.chunk_forward`, ...) with
Triton's benchmarker, the one `triton.autotune` uses, and caches the winner per key:

    key = (spec hash, flags, kernel form, dim sizes, input dtype, C where fixed,
           parallelism bucket: programs below / at least the device's SM count, device name)

in a dict (the second call pays one dict lookup) and on disk, one JSON file per key under
`$MIXC_CACHE_DIR/autotune/` (written atomically; keyed also by the mixc and Triton versions).

Never tuned: under Triton's interpreter (the CPU path the tests take: the launch is exactly
the untuned one), during CUDA-graph capture or torch.compile tracing (the cached or the
default config), or with MIXC_AUTOTUNE=0. MIXC_AUTOTUNE=compile launches every config once
(compiles it into Triton's disk cache) without timing or caching a choice, and
MIXC_AUTOTUNE_SHARD=i/n restricts that to every n-th config from the i-th: bench/gpu_check's
parallel warm-up processes split the compiles so."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from functools import lru_cache

import torch
import triton

from .. import __version__
from .. import classes
from ..derive.plan import Plan
from ..standalone.launch_data import CHUNK_DEFAULT, LaunchConfig
from .cache import cache_dir, interpreting, write_atomic

# Triton's defaults for a CUDA launch without num_warps / num_stages: the untuned launch.
DEFAULT_WARPS, DEFAULT_STAGES = 4, 3
FORMS = ("chunk", "chunk_fwd", "chunk_bwd", "recurrent_fwd", "recurrent_bwd")
# Blocks of the recurrent kernels' tile dim and split dim (plan.layout.tile, .split) in the
# untuned launch: one program per block. fla's fused recurrent kernels take BV <= 32 (ours: the
# tile) and BK <= 64 (ours: the split, Mamba's N or the key dim).
RECURRENT_TILE = 32
RECURRENT_SPLIT = 64


def block(size: int) -> int:
    """A dim's block: its next power of two (at least 1)."""
    return max(triton.next_power_of_2(size), 1)

_CACHE: dict[tuple, "Config"] = {}
STATS = {"tuned": 0, "memory_hits": 0, "disk_hits": 0}


# One launch configuration: the launcher's (standalone/launcher.py; C, tile, split, phases,
# num_warps, num_stages), so a compiled module's untuned launch and this tuner share one type.
Config = LaunchConfig


def mode() -> str:
    """MIXC_AUTOTUNE: "1" (default: tune on CUDA), "0" (never), "compile" (launch every config once)."""
    v = os.environ.get("MIXC_AUTOTUNE", "1").strip().lower()
    return {"": "1", "on": "1", "true": "1", "off": "0", "false": "0"}.get(v, v)


def active(device: torch.device) -> bool:
    """Tuning applies to compiled kernels on CUDA only: never under the interpreter."""
    return device.type == "cuda" and not interpreting() and mode() != "0"


# ---- the configuration lists, per transition class ----

def chunk_candidates(plan: Plan) -> list[int]:
    """C values for the chunked kernels: the plan's default (plan.layout.chunk_size) first, then
    what the class of its hardest state adds (classes/base.py chunk_candidates: half of it where
    the intra-chunk term is a [C, C] matrix; the [C, C, dim] blocks of the diagonal classes stay
    at 16, as 32 would hold 32 x 32 x K values)."""
    return classes.unit(plan.transition).chunk_candidates(plan.layout.chunk_size)


def configs(plan: Plan, form: str, sizes: dict[str, int] | None = None) -> list[Config]:
    """The configuration list of one kernel form of a plan; the launch without tuning (CUDA with
    MIXC_AUTOTUNE=0) takes the first.

    chunk:          C in chunk_candidates(plan) (warps and stages tuned per C by the next two)
    chunk_fwd/bwd:  two launches (launch.CHUNK_PHASES: every chunk at once) at 8 warps and 3
                    stages, at 4 warps and 3 stages, at 8 warps and 1 stage; one launch (the
                    walk) at 8 warps and 1 stage. Stages are the walk's: an output (tiles) launch takes
                    one (its loop has one iteration, nothing to pipeline). The sm_90 static
                    report (bench/README.md) at K = V = 128: with 8 warps no forward kernel
                    spills and the backward's spill 0.4-1.5 KB; with 4 warps the forwards spill
                    up to 1.7 KB and three backward tiles kernels (gla, rwkv6, gated_delta_rule)
                    24-34 KB (kept for small head dims); the walk's backward at 3 stages needs
                    more shared memory than a block has (248 KiB). Each config compiles two
                    kernels at most; the list, 6 distinct kernels per form and C
    recurrent_*:    num_warps in {4, 2} x the tile block in {32, 16, 64} (where the spec has a
                    tile dim) x the split block in {64, 32} (where it has a split dim), blocks
                    no larger than the dim's power of two; num_stages 3"""
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    if form == "chunk":
        return [Config(C=c) for c in chunk_candidates(plan)]
    if form in ("chunk_fwd", "chunk_bwd"):
        # the first: the launcher's untuned CUDA launch (launcher.default_config)
        return [CHUNK_DEFAULT, Config(4, 3, phases=2), Config(8, 1, phases=2), Config(8, 1, phases=1)]
    sizes = sizes or {}
    tile, split = plan.layout.tile, plan.layout.split

    def blocks(dim, default, options):
        if dim is None:
            return [None]
        cap = block(sizes[dim]) if dim in sizes else max(options)
        return list(dict.fromkeys(min(b, cap) for b in (default,) + options))

    out = []
    for w in (4, 2):
        for t in blocks(tile, RECURRENT_TILE, (16, 64)):
            for s in blocks(split, RECURRENT_SPLIT, (32,)):
                out.append(Config(w, DEFAULT_STAGES, tile=t, split=s))
    return list(dict.fromkeys(out))


def default(plan: Plan, form: str, sizes: dict[str, int] | None = None) -> Config:
    return configs(plan, form, sizes)[0]


# ---- the cache ----

@lru_cache(maxsize=16)
def _device(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def key(plan: Plan, form: str, sizes: dict, dtype: torch.dtype, programs: int, device: torch.device,
        C: int | None = None) -> tuple:
    """The cache key; the parallelism bucket says whether the programs fill the SMs (with fewer,
    smaller blocks or fewer warps may win)."""
    name, sms = _device(device.index if device.index is not None else torch.cuda.current_device())
    return (plan.ir.spec_hash, tuple(plan.flags), form, tuple(sorted(sizes.items())), str(dtype), C,
            "few" if programs < sms else "many", name)


def _disk_path(k: tuple):
    h = hashlib.sha256(repr((k, __version__, triton.__version__)).encode()).hexdigest()[:32]
    return cache_dir() / "autotune" / f"{h}.json"


def _disk_get(k: tuple) -> Config | None:
    try:
        data = json.loads(_disk_path(k).read_text())
        cfg = Config(**data["config"]) if data.get("key") == repr(k) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return cfg if cfg is not None and _valid(cfg) else None


def _pow2(x, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi and x & (x - 1) == 0


def _valid(cfg: Config) -> bool:
    """A config read from disk as one this module could have written: another process's file
    or a hand edit (C = 0, num_warps = -3) is re-tuned, never launched."""
    return (_pow2(cfg.num_warps, 1, 32) and type(cfg.num_stages) is int and 1 <= cfg.num_stages <= 8
            and (cfg.C is None or _pow2(cfg.C, 16, 256))
            and all(b is None or _pow2(b, 1, 1 << 16) for b in (cfg.tile, cfg.split))
            and cfg.phases in (None, 1, 2))


def _disk_put(k: tuple, cfg: Config, timings: list) -> None:
    try:
        path = _disk_path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": repr(k), "config": asdict(cfg), "timings": timings}))
    except OSError:
        pass                                   # a read-only cache only costs a re-tune next process


def clear(memory: bool = True) -> None:
    if memory:
        _CACHE.clear()


def _quiet() -> bool:
    """No timing now: a CUDA graph is being captured, or torch.compile is tracing."""
    try:
        if torch.compiler.is_compiling():
            return True
    except AttributeError:
        pass
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def bench(fn) -> float:
    """Median milliseconds of fn by the active Triton driver's benchmarker (what triton.autotune
    calls; bench/gpu_check serializes it across its warm-up processes)."""
    ms = triton.runtime.driver.active.get_benchmarker()(fn, quantiles=(0.5, 0.2, 0.8))
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def _shard() -> tuple[int, int]:
    try:
        i, n = (int(x) for x in os.environ.get("MIXC_AUTOTUNE_SHARD", "0/1").split("/"))
        return (i % n, n) if n > 0 else (0, 1)
    except ValueError:
        return 0, 1


class DeviceFault(RuntimeError):
    """A config faulted on the device while tuned (an illegal memory access, ...)."""


def device_fault(err: BaseException) -> bool:
    """Whether err is a device fault, which leaves the CUDA context unusable (every later CUDA
    call fails alike): torch.AcceleratorError, a RuntimeError saying "CUDA error" (torch) or
    "Triton Error [CUDA]" (a Triton launch), not an out-of-memory error nor a config that fails
    to compile or fit (Triton's OutOfResources)."""
    if isinstance(err, DeviceFault):
        return True
    if isinstance(err, getattr(torch, "OutOfMemoryError", ())) or not isinstance(err, RuntimeError):
        return False
    if isinstance(err, getattr(torch, "AcceleratorError", ())):
        return True
    msg = str(err)
    return any(s in msg for s in ("CUDA error", "Triton Error [CUDA]", "illegal memory access", "CUDA_ERROR_"))


def _raise_if_fault(err: Exception, k: tuple, cfg: Config) -> None:
    """Re-raise a device fault at once, naming the config and the kernel form: it is no failing
    config to skip, as it poisons the context (the next config, or the next CUDA call, would fail
    with it and hide which launch faulted). An inner pick's DeviceFault passes unchanged."""
    if isinstance(err, DeviceFault):
        raise err
    if device_fault(err):
        form = k[2] if len(k) > 2 else "?"
        sizes = dict(k[3]) if len(k) > 3 and isinstance(k[3], tuple) else {}
        raise DeviceFault(
            f"autotune: kernel form {form!r} at {sizes} (key {k!r}) faulted on the device with config {cfg}: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''} -- the CUDA "
            "context is unusable now, so no other config is tried (CUDA reports a fault at a later call: "
            "rerun with CUDA_LAUNCH_BLOCKING=1, e.g. bench/gpubench/probe.py, to name the launch)") from err


def pick(k: tuple, candidates: list[Config], run) -> Config:
    """The cached config for key k, or the fastest of candidates by timing run(config) (a
    config that fails to compile or launch, e.g. out of shared memory, is skipped; a device
    fault, which poisons the CUDA context, raises DeviceFault at once)."""
    hit = _CACHE.get(k)
    if hit is not None:
        STATS["memory_hits"] += 1
        return hit
    if len(candidates) == 1 or _quiet():
        return candidates[0]
    if mode() == "compile":
        # this process's share of the list (MIXC_AUTOTUNE_SHARD=i/n; every C of the "chunk" form,
        # whose kernels shard their own lists), each launched once: compiled into Triton's cache
        i, n = _shard()
        first = None
        for j, cfg in enumerate(candidates):
            if j % n == i or k[2] == "chunk":
                try:
                    run(cfg)
                    first = first or cfg
                except Exception as err:      # noqa: BLE001 - a failing config is not chosen anyway
                    _raise_if_fault(err, k, cfg)
        return first or candidates[0]
    hit = _disk_get(k)
    if hit is not None:
        STATS["disk_hits"] += 1
        _CACHE[k] = hit
        return hit
    timings = []
    for cfg in candidates:
        try:
            run(cfg)                          # compile (and check) outside the timed calls
            timings.append((bench(lambda: run(cfg)), cfg))
        except Exception as err:              # noqa: BLE001 - out of resources, a compile error: skip it
            _raise_if_fault(err, k, cfg)
            timings.append((float("inf"), cfg))
            if len(timings) == len(candidates) and all(t == float("inf") for t, _ in timings):
                raise err
    best = min(timings, key=lambda t: t[0])[1]
    STATS["tuned"] += 1
    _CACHE[k] = best
    _disk_put(k, best, [(t, asdict(c)) for t, c in timings])
    return best

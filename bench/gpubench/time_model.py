"""A time model for one op call on a Hopper GPU, from what is counted without one: the traffic
report's launches (bytes through HBM, tensor-core FLOPs, grid) and the static report's
compile (registers, warps, shared memory, wgmma or mma.sync). A model, not a measurement: its
constants are the device's data sheet, instruction latencies, and two step latencies fitted to
the few GPU timings on record
(CALIBRATION), and `calibrate` says how close it comes to each.

Per launch of P programs (a torch op between kernels: its bytes at full bandwidth):

    blocks per SM   o = min(65536 // (registers * 32 * warps), SMEM // shared, 64 // warps), at least 1
    waves           w = ceil(P / (SMs * o))
    SMs busy        A = min(P, SMs)
    t_bytes = bytes / (BW * A / SMs)                 a few programs cannot pull all of HBM
    t_flops = FLOPs / (PEAK[wgmma | mma.sync] * A / SMs)
    t_chain = w * steps * L_step                     the dependent chain: chunk-steps one program
                                                     walks in order, each waiting on the last
    L_step  = L0[impl] + (matmuls on the path - 1) * L_MMA + solve rows * L_ROW
    t = max(t_bytes, t_flops, t_chain) + LAUNCH      a chain that waits is not also streaming

`steps`: a walk (mixc's walk kernels forward and backward, fla's chunk_*_h / dh / dhu kernels)
carries the state through every chunk of its sequence, T / C steps; mixc's output and refill
programs walk from a checkpoint through the chunks of their segment (B H T / C / programs
along axis 0); every other program computes its chunk(s) without waiting on another (1 step).
The per-step latency is where the kernel's instruction mix enters: L0 is one step of a walk
(the chunk's loads, one matmul into the state, the checkpoint's store; fitted), each further
matmul on the dependent path adds L_MMA, and the triangular solve that mixc's delta-rule walks
run per chunk adds L_ROW per row (63 dependent rows of two cross-warp reductions each at C = 64;
from the instruction latencies, not fitted: no delta-rule timing is on record yet)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    bandwidth: float            # bytes / s, HBM (a device-to-device copy's, where measured)
    peak_wgmma: float           # dense bf16 FLOP / s
    peak_mma_sync: float        # what Triton's mma.sync path reaches on Hopper (no wgmma)
    smem: int = 228 * 1024      # shared memory per SM, bytes


# data sheets; the H200's bandwidth is the copy measured on the lent one (2026-12-04: 4.21 TB/s)
DEVICES = {
    "H100": Device("H100 SXM", 132, 3.35e12, 989e12, 989e12 / 2),
    "H200": Device("H200", 132, 4.21e12, 989e12, 989e12 / 2),
    "H20": Device("H20", 78, 4.0e12, 148e12, 148e12 / 2),
}


@dataclass(frozen=True)
class Constants:
    # one walk step, fitted per implementation (`calibrate`): the two timings on record do not
    # separate what makes mixc's step slower (8 warps at one block per SM, a 128-row state tile,
    # the checkpoint's store, no load prefetched across steps) into instruction latencies
    L0_MIXC: float = 4.25e-6
    L0_FLA: float = 2.25e-6
    L_MMA: float = 0.3e-6       # one more matmul on the dependent path (a 64-row wgmma and its wait)
    L_ROW: float = 0.12e-6      # one row of a serial triangular solve: two cross-warp reductions
    LAUNCH: float = 4e-6        # a kernel launch and its tail, back to back (not fitted: a
                                # free launch term absorbed the backward's misfit, 20 us)

    def step(self, impl: str) -> float:
        return self.L0_MIXC if impl == "mixc" else self.L0_FLA


def occupancy(dev: Device, registers: int, warps: int, shared: int) -> int:
    by_regs = 65536 // max(1, registers * 32 * warps)
    by_smem = dev.smem // shared if shared else 64
    return max(1, min(by_regs, by_smem, 64 // warps))


# fla's walks: the kernels that carry a state through every chunk, and the matmuls on each
# step's dependent path (h += k^T v; the delta rule's v_new = u - w h first; dhu's three)
FLA_WALKS = {
    "chunk_fwd_kernel_h": 1, "chunk_bwd_kernel_dh": 1, "chunk_rwkv6_bwd_kernel_dh": 1,
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": 2,
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": 3,
}
# mixc's chunked kernels: <spec>_chunk_<fwd|bwd>_<stage>[_<variant>...], one kernel per stage and
# tuner variant (_rewalk, _staged, _keyblocks); the reports committed before that named them by
# PHASE, <spec>_chunk_<fwd|bwd>[n] (read as the stage)
_MIXC = re.compile(r"_chunk_(fwd|bwd)(?:_(fused|walk|output|refill|intra|tiles)((?:_[a-z]+)*)|\[(\d)\])$")
_PHASE_STAGES = {"fwd": ("fused", "walk", "output", "refill", "intra"), "bwd": ("fused", "walk", "tiles")}


def mixc_stage(kernel: str) -> tuple[str, str] | None:
    """(direction, stage) of a mixc chunked kernel's name (None: another kernel)."""
    m = _MIXC.search(kernel)
    if not m:
        return None
    return m.group(1), m.group(2) or _PHASE_STAGES[m.group(1)][int(m.group(4))]
# mixc's delta-rule walks: the state's correction is the WY form, solved per chunk inside the
# walk unless the staged inverse is on (launch.STAGE_SOLVE: on by default since this model chose it;
# the backward's walk reads it where its kernel is the _staged variant)
SOLVE_IN_WALK = {"delta_rule", "gated_delta_rule", "kda", "rwkv7", "dplr"}


@dataclass(frozen=True)
class Chain:
    steps: float                # dependent chunk-steps per program
    matmuls: int = 1            # matmuls on one step's dependent path
    solve_rows: int = 0


def chain_of(spec: str, impl: str, launch: dict, B: int, T: int, H: int, C: int = 64,
             staged_solve: bool = False) -> Chain:
    """The dependent chain of one launch (module doc). staged_solve: the forward staged the
    inverse (an intra launch of a delta rule: launch.STAGE_SOLVE), so its walk takes U as one
    more matmul; the backward's reverse walk alike where its kernel is the _staged variant
    (the intra kernel run again before it: dY = (I - M)^-T dU, on its dependent path, as one
    more matmul), else it solves per chunk."""
    name, grid = launch["kernel"], launch.get("grid") or [1, 1, 1]
    if impl == "fla":
        if name in FLA_WALKS:
            return Chain(T / C, FLA_WALKS[name])
        return Chain(1)
    ds = mixc_stage(name)
    if ds is None:
        return Chain(1)
    direction, stage = ds
    solve = C - 1 if spec in SOLVE_IN_WALK else 0
    # a segmented walk (standalone/segments.py, its launch's "segments": bench/segments_model) runs
    # S segments per sequence on S times the programs, each T / (S C) chunk-steps long
    segments = launch.get("segments", 1) if stage == "walk" else 1
    if stage == "walk" and solve and staged_solve and direction == "fwd":
        return Chain(T / C / segments, 4)  # the staged inverse as one more matmul instead of the rows
    if stage == "walk" and solve and direction == "bwd" and "_walk_staged" in name:
        return Chain(T / C / segments, 4)  # dY = (I - M)^-T dU as one more matmul instead of the rows
    if stage == "walk":                     # the walk, forward or reverse
        return Chain(T / C / segments, 3 if solve else 1, solve)
    if stage in ("output", "refill") and direction == "fwd":
        return Chain(max(1.0, B * H * (T / C) / grid[0]))
    return Chain(1)


def launch_time(dev: Device, k: Constants, launch: dict, static: dict | None, chain: Chain, impl: str) -> dict:
    nbytes = launch["read"] + launch["written"]
    if launch["kind"] != "triton":
        t = nbytes / dev.bandwidth + k.LAUNCH
        return {"t": t, "t_bytes": t - k.LAUNCH, "t_flops": 0.0, "t_chain": 0.0, "programs": 0, "occupancy": 0}
    programs = math.prod(launch.get("grid") or [1])
    regs = (static or {}).get("registers") or 64
    warps = (static or {}).get("num_warps") or 4
    shared = (static or {}).get("shared_bytes") or 0
    o = occupancy(dev, regs, warps, shared)
    waves = math.ceil(programs / (dev.sms * o))
    busy = min(programs, dev.sms) / dev.sms
    peak = dev.peak_mma_sync if (static or {}).get("tensor_cores") == "mma.sync" else dev.peak_wgmma
    t_bytes = nbytes / (dev.bandwidth * busy)
    t_flops = (launch.get("flops") or 0.0) / (peak * busy)
    step = k.step(impl) + (chain.matmuls - 1) * k.L_MMA + chain.solve_rows * k.L_ROW
    t_chain = waves * chain.steps * step if chain.steps > 1 else 0.0
    t = max(t_bytes, t_flops, t_chain) + k.LAUNCH
    return {"t": t, "t_bytes": t_bytes, "t_flops": t_flops, "t_chain": t_chain, "programs": programs,
            "occupancy": o, "waves": waves, "steps": chain.steps}


PASSES = {"fwd": ("fwd",), "fwd_bwd": ("train_fwd", "bwd")}


def op_time(dev: Device, k: Constants, result: dict, static_rows: list[dict], B: int, T: int, H: int) -> dict:
    """Modeled seconds of one op call ({'fwd': s, 'fwd_bwd': s}) and each launch's terms."""
    statics = {(r["phase"], r["kernel"]): r for r in static_rows
               if r["spec"] == result["spec"] and r["impl"] == result["impl"]}
    out, rows = {}, []
    staged = any(mixc_stage(x["kernel"]) == ("fwd", "intra") for x in result["launches"])
    for name, phases in PASSES.items():
        total = 0.0
        for x in result["launches"]:
            if x["phase"] not in phases:
                continue
            st = statics.get(("bwd" if x["phase"] == "bwd" else "fwd", x["kernel"]))
            st = st or next((r for (p, kn), r in statics.items() if kn == x["kernel"]), None)
            # a report of another naming (the PHASE names [n] against the stage names): the stage's row
            st = st or next((r for (p, kn), r in statics.items()
                             if mixc_stage(kn) is not None and mixc_stage(kn) == mixc_stage(x["kernel"])), None)
            terms = launch_time(dev, k, x, st, chain_of(result["spec"], result["impl"], x, B, T, H,
                                                          staged_solve=staged), result["impl"])
            total += terms["t"]
            if name == "fwd_bwd" or x["phase"] == "fwd":
                rows.append({"phase": x["phase"], "kernel": x["kernel"], **terms})
        out[name] = total
    return {"seconds": out, "launches": rows}


# GPU timings on record: (device, spec, impl, (B, T, H, D), pass, ms) and where they come from
CALIBRATION = [
    ("H200", "linear_attn", "mixc", (1, 8192, 96, 128), "fwd", 1.520),
    ("H200", "linear_attn", "mixc", (1, 8192, 96, 128), "fwd_bwd", 4.687),
    ("H200", "linear_attn", "fla", (1, 8192, 96, 128), "fwd", 0.552),
    ("H200", "linear_attn", "fla", (1, 8192, 96, 128), "fwd_bwd", 2.440),
]
CALIBRATION_SOURCE = "bench/results/2026-12-04-NVIDIA-H200/run1/results.json (bf16, do_bench medians)"
# the registers of what ran at those points (linear_attn's kernels then: R = 4, the rewalk output
# kernel and the refill), frozen: a later default compiles other kernels, which did not run there
CALIBRATION_STATIC = "bench/results/time-model/static-calibration.json"


def calibrate(points: list[tuple], results: dict, static_rows: list[dict]) -> tuple[Constants, list[dict]]:
    """Fit L0_MIXC and L0_FLA to the points (least squares of log time over a grid; the other
    constants stay at their instruction-latency values). results[(spec, impl)]: the traffic
    report's result at the point's shape. Returns the constants and each point's model/measured."""
    def residuals(k):
        rows = []
        for dev, spec, impl, (B, T, H, _D), pas, ms in points:
            r = results.get((spec, impl))
            if r is None:
                continue
            t = op_time(DEVICES[dev], k, r, static_rows, B, T, H)["seconds"][pas] * 1e3
            rows.append({"device": dev, "spec": spec, "impl": impl, "pass": pas, "measured_ms": ms,
                         "model_ms": t, "ratio": t / ms})
        return rows
    best = None
    grid = [x * 0.25e-6 for x in range(1, 41)]
    for l0m in grid:
        for l0f in grid:
            k = Constants(L0_MIXC=l0m, L0_FLA=l0f)
            rows = residuals(k)
            err = sum(math.log(r["ratio"]) ** 2 for r in rows)
            if best is None or err < best[0]:
                best = (err, k, rows)
    return best[1], best[2]


def modeled_times(traffic: dict, static_rows: list[dict], calibration: dict, calibration_static: list[dict],
                  device: str = "H100") -> tuple[Constants, dict]:
    """Modeled seconds of every op call of a traffic report ({(spec, impl): {'fwd': s, 'fwd_bwd': s}})
    on `device`, the step latencies fitted to CALIBRATION first (calibration: the traffic report at
    the calibration points' shape, calibration_static the static rows of its kernels):
    what bench/traffic_report prints beside its bytes."""
    k, _ = calibrate(CALIBRATION, {(r["spec"], r["impl"]): r for r in calibration["results"]}, calibration_static)
    meta = traffic["meta"]
    B, T, H = meta.get("B", 1), meta["T"], meta["H"]
    return k, {(r["spec"], r["impl"]): op_time(DEVICES[device], k, r, static_rows, B, T, H)["seconds"]
               for r in traffic["results"] if "error" not in r}

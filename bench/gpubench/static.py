"""The static report: mixc's and fla's kernels for the same ops compiled for sm_90 with no GPU
(bench/gpubench/fakecuda.py), compared on registers, spills, shared memory and tensor-core
instructions. Each (op, implementation) runs its forward and backward once on CPU tensors in a
process of its own; every kernel launch is compiled with the runtime's own specialization.

Configs: mixc's kernels get the untuned launch on CUDA (the first config of each of
mixc.runtime.autotune's lists: two launches per direction, 8 warps, 3 stages for the walk and 1
for the output (tiles) kernel; C = launch.chunk_size) and, with --all-configs, every config of the forward's list
(two launches (p2) or one (p1), warps, stages), the backward taking the same. mixc's chunked
kernels are one per stage, listed by name (gla_chunk_fwd_walk, gla_chunk_bwd_tiles ...).
fla's autotuned kernels get the "typical" config of their Hopper list: the one closest to 4
warps, blocks of 64 and 2 stages (sort key: |log2(warps / 4)|, then sum |log2(block / 64)|
over the autotuned block sizes, then |stages - 2|); fla's autotuner would time them all."""
from __future__ import annotations

import json
import math
import re
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent


def typical(_tuner, config) -> tuple:
    blocks = [v for k, v in config.kwargs.items() if isinstance(v, int) and k.startswith("B") and v > 0]
    return (abs(math.log2(config.num_warps / 4)), sum(abs(math.log2(b / 64)) for b in blocks),
            abs(config.num_stages - 2))


def setup(spec: str, impl: str, D: int, T: int, H: int, dtype_name: str = "bfloat16"):
    """In this process: install the stand-in driver and return (call, leaves, op, forced, why):
    call(leaves) runs `impl`'s chunked op on B = 1, T, H, K = V = D CPU tensors whose every
    kernel launch is compiled, not run; forced maps mixc's forms to a config (untuned where
    absent); why says why fla is missing (call is then None)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLA_CACHE_RESULTS"] = "0"           # no autotune choice from (or into) Triton's disk cache
    sys.path[:0] = [str(ROOT), str(BENCH)]
    from gpubench import fakecuda, wheels
    wheels.activate()
    fakecuda.install(pick=typical)
    import torch

    from gpubench import fla_ops
    from gpubench.timing import make_inputs
    op, kw, _ = make_inputs(spec, 1, T, H, D, "cpu", getattr(torch, dtype_name))
    leaves = {k: v.requires_grad_(True) for k, v in kw.items()}
    forced = {}                                     # form -> config; untuned where absent
    if impl == "fla":
        fns, why = fla_ops.load()
        if fns is None:
            return None, leaves, op, forced, why
        fakecuda.fla_on_device_0()
        return (lambda x: fla_ops.call(spec, fns, x)), leaves, op, forced, None
    from mixc.runtime import launch
    from mixc.runtime.cache import load_module
    if os.environ.get("GPUBENCH_STAGE_SOLVE") in ("0", "1"):      # the reports' --stage-solve on/off
        launch.STAGE_SOLVE = os.environ["GPUBENCH_STAGE_SOLVE"] == "1"
    if os.environ.get("GPUBENCH_CKPT_EVERY", "").isdigit():         # the reports' --ckpt-every R
        launch.CHECKPOINT_EVERY = int(os.environ["GPUBENCH_CKPT_EVERY"])
    launch.module_for = lambda plan, device: load_module(plan)
    launch._refuse = lambda device: None        # the launcher's device check: CPU tensors stand in for CUDA
    launch._tuned = lambda plan, bound, form, run, C=None: forced.get(form)
    return (lambda x: op(**x, mode="chunk")[0]), leaves, op, forced, None


def run_one(spec: str, impl: str, D: int, T: int, H: int, all_configs: bool) -> list[dict]:
    """In this process (fakecuda installed first): compile what `impl` launches for `spec`'s
    forward and backward at B = 1, T, H, K = V = D in bf16; one row per kernel launch."""
    call, leaves, op, forced, why = setup(spec, impl, D, T, H)
    if call is None:
        return [{"spec": spec, "impl": impl, "error": why}]
    import torch

    from gpubench import fakecuda
    variants = [None]
    if impl == "mixc":
        from mixc.runtime import autotune
        if all_configs:
            variants += autotune.configs(op.plan(), "chunk_fwd")
    rows = []
    for cfg in variants:
        fakecuda.RECORDS.clear()
        if impl == "mixc":
            forced.clear()
            # the untuned CUDA launch: the first config of each list
            for form in ("chunk_fwd", "chunk_bwd"):
                forced[form] = autotune.default(op.plan(), form) if cfg is None else cfg
        try:
            fakecuda.PHASE["name"] = "fwd"
            o = call(leaves)
            fakecuda.PHASE["name"] = "bwd"
            torch.autograd.backward(o, torch.ones_like(o))
        except Exception as err:                    # noqa: BLE001 - recorded in the table
            rows.append({"spec": spec, "impl": impl, "error": f"{type(err).__name__}: {err}"[:400]})
            continue
        for r in fakecuda.RECORDS:
            name = r["kernel"]          # mixc's chunked kernels: one per stage, named for it
            row = {"spec": spec, "impl": impl, "phase": r["phase"], "kernel": name, "module": r["module"],
                   "num_warps": r["num_warps"], "num_stages": r["num_stages"],
                   "blocks": {k: v for k, v in r["constexprs"].items() if not isinstance(v, bool)
                              and (k.startswith("_BLOCK") or re.fullmatch(r"B[A-Z]+", k))},
                   "variant": "default" if cfg is None else f"w{cfg.num_warps}s{cfg.num_stages}p{cfg.phases}"}
            try:
                row.update(fakecuda.usage(r["compiled"]))
            except Exception as err:                # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            rows.append(row)
    return rows


def collect(specs, impls=("mixc", "fla"), D=128, T=256, H=16, jobs=2, all_configs=False) -> list[dict]:
    """run_one for each (spec, impl), each in a fresh process (jobs at a time)."""
    import concurrent.futures as cf
    todo = [(s, i) for s in specs for i in impls if not (i == "fla" and s == "mamba2")]

    def one(si):
        spec, impl = si
        code = (f"import json, sys; sys.path[:0] = [{str(BENCH)!r}]; from gpubench.static import run_one; "
                f"print('@@' + json.dumps(run_one({spec!r}, {impl!r}, {D}, {T}, {H}, {all_configs})))")
        env = dict(os.environ, TRITON_INTERPRET="0")
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                           timeout=3600)
        out = [x for x in p.stdout.splitlines() if x.startswith("@@")]
        if p.returncode or not out:
            return [{"spec": spec, "impl": impl, "error": (p.stderr or p.stdout)[-600:]}]
        return json.loads(out[-1][2:])

    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        return [r for rows in ex.map(one, todo) for r in rows]


def _agg(rows: list[dict]) -> str:
    """'n kernels: max regs / total spill bytes / max smem KiB / tensor cores' of a group of launches."""
    if not rows:
        return "-"
    if any("error" in r for r in rows):
        return "error: " + next(r["error"] for r in rows if "error" in r)[:60]
    uniq = {(r["kernel"], json.dumps(r["blocks"], sort_keys=True), r["num_warps"]): r for r in rows}
    rs = list(uniq.values())
    regs = max(r["registers"] or 0 for r in rs)
    spill = sum(r["spill_bytes"] or 0 for r in rs)
    smem = max(r["shared_bytes"] for r in rs)
    tcs = sorted({r["tensor_cores"] for r in rs if r["tensor_cores"]})
    n = f"{len(rs)}: " if len(rs) > 1 else ""
    return f"{n}{regs} / {spill} / {_kib(smem)} / {'+'.join(tcs) or 'none'}"


SMEM_LIMIT = 232448            # bytes of shared memory one block may use on sm_90 (227 KiB)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f}" + ("**!**" if nbytes > SMEM_LIMIT else "")


def markdown(rows: list[dict], meta: dict) -> str:
    """The summary (per op: mixc untuned, mixc's config with the fewest spills that fits, fla)
    and the per-kernel table."""
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    out = [f"sm_{meta['arch']}, {meta['triton']}, {meta['fla']}; B = 1, T = {meta['T']}, H = {meta['H']}, "
           f"K = V = {meta['D']} (Mamba-2: N = P = {meta['D']}), bf16. Each cell: [kernels:] max registers per "
           "thread / spill bytes summed over the kernels / max shared memory KiB / tensor-core instructions. "
           "**!**: more shared memory than a block may have on sm_90 (227 KiB): that launch fails (Triton's "
           "OutOfResources) and an autotuner skips the config.", "",
           "| op | implementation | forward | backward |", "|---|---|---|---|"]

    def grp(spec, impl, variant, phase):
        return [r for r in rows if r["spec"] == spec and r["impl"] == impl
                and (r.get("variant", "default") == variant or "error" in r) and (r.get("phase") == phase or "error" in r)]

    def cost(spec, variant):                 # over the limit first, then spill bytes
        rs = grp(spec, "mixc", variant, "fwd") + grp(spec, "mixc", variant, "bwd")
        if not rs or any("error" in r for r in rs):
            return (2, 0)
        return (int(any(r["shared_bytes"] > SMEM_LIMIT for r in rs)), sum(r["spill_bytes"] or 0 for r in rs))

    for s in specs:
        variants = list(dict.fromkeys(r.get("variant", "default") for r in rows if r["spec"] == s and r["impl"] == "mixc"))
        lines = [("mixc, untuned (each list's first)", "mixc", "default", s)]
        others = [v for v in variants if v != "default"]
        if others:
            best = min(others, key=lambda v: cost(s, v))
            w, st, ph = re.fullmatch(r"(w\d+)(s\d+)(p\d+)", best).groups()
            lines.append((f"mixc, fewest spills of the tuner's list ({w} {st} {ph})", "mixc", best, s))
        src = "simple_gla" if s == "mamba2" else s
        lines.append(("fla, typical configs" + (" (simple_gla's kernels)" if src != s else ""), "fla", "default", src))
        for label, impl, variant, spec in lines:
            cells = [_agg(grp(spec, impl, variant, ph)) for ph in ("fwd", "bwd")]
            out.append(f"| {s} | {label} | {cells[0]} | {cells[1]} |")
    out += ["", "| op | impl | phase | kernel | config | blocks | regs | spill B | smem KiB | tensor cores |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r and "kernel" not in r:
            out.append(f"| {r['spec']} | {r['impl']} | | error: {r['error'][:120]} | | | | | | |")
            continue
        blocks = " ".join(f"{k.replace('_BLOCK_', '')}={v}" for k, v in sorted(r["blocks"].items()))
        out.append(f"| {r['spec']} | {r['impl']} | {r['phase']} | {r['kernel']} | {r.get('variant', '')} "
                   f"w{r['num_warps']} s{r['num_stages']} | {blocks} | {r.get('registers')} | {r.get('spill_bytes')} "
                   f"| {_kib(r.get('shared_bytes', 0))} | {r.get('tensor_cores') or 'none'} |")
    return "\n".join(out)

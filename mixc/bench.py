"""`mixc bench`: CPU benchmarks, as ratios measured in one run (CPU timings are not the
timings that count: GPU ones are, bench/gpu_check).

For one library spec (gla by default) at growing T: the torch backend (the chunked form,
linear in T) forward and forward+backward, the float64 reference (the loop over t), and a
quadratic masked implementation written here (O = ((Q K^T) * D) V with the decay matrix D,
what attention-style code does), each timed and with its peak memory measured in a fresh
process (ru_maxrss above the process's baseline). Also the compile latency: spec text to
generated source, and source to the first torch-backend call. Writes JSON (and a PNG plot
when matplotlib is importable) and prints a table."""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import pipeline
from .argtypes import PLOT_HINT
from .bench_fla import FLA_COLUMNS, fla_table, side_by_side
from .runtime.inputs import random_args

# torch at module level: `mixc bench` imports this module only when it runs (cli.py); mixc.recall
# imports writable_folder from it when training

IMPLS = ("torch_chunked", "reference", "quadratic")


def _inputs(T: int, H: int, D: int, seed: int = 0):
    op = pipeline.load_op("gla")
    args, _ = random_args(op.ir, B=1, T=T, H=H, sizes={"K": D, "V": D}, dtype=torch.float32, seed=seed)
    args["g"] = -torch.rand(args["g"].shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    return op, args


def _quadratic(q, k, v, g, scale):
    """GLA as masked attention: o_i = sum_{j<=i} (q_i * exp(b_i - b_j)) . k_j v_j, over [T, T, K]."""
    b = g.cumsum(1)                                                        # [B, T, H, K]
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    w = torch.exp((b[:, :, None] - b[:, None, :]).masked_fill(~causal[None, :, :, None, None], float("-inf")))
    A = torch.einsum("bihk,bjhk,bijhk->bhij", q * scale, k, w)
    return torch.einsum("bhij,bjhv->bihv", A, v)


def _run_one(impl: str, T: int, H: int, D: int, backward: bool) -> dict:
    """Time one implementation (median of repeats) in this process; peak RSS above baseline."""
    op, args = _inputs(T, H, D)
    if backward:
        for x in args.values():
            x.requires_grad_(True)

    def call():
        if impl == "torch_chunked":
            o, _ = op(**args, mode="torch")
        elif impl == "reference":
            o, _ = op(**args, mode="reference")
        else:
            o = _quadratic(args["q"], args["k"], args["v"], args["g"], D ** -0.5)
        if backward:
            o.float().sum().backward()
        return o
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    call()                                                                 # warm-up (and compile, for the backend)
    times = []
    for _ in range(3 if impl != "reference" else 1):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base     # KiB on Linux
    return {"impl": impl, "T": T, "H": H, "D": D, "backward": backward, "ms": sorted(times)[len(times) // 2] * 1e3,
            "peak_mib": peak / 1024}


def compile_latency(name: str = "gla") -> dict:
    """Spec text -> generated source (derive + codegen), and source -> the first torch-backend call."""
    t0 = time.perf_counter()
    op = pipeline.load_op(name)
    pipeline.render(op.plan())
    t1 = time.perf_counter()
    args, _ = random_args(op.ir, B=1, T=64, H=2, sizes={d.name: 16 for d in op.ir.dims if not d.alias_of},
                          dtype=torch.float32, seed=0)
    op(**args, mode="torch")
    t2 = time.perf_counter()
    return {"spec": name, "spec_to_source_ms": (t1 - t0) * 1e3, "source_to_first_call_ms": (t2 - t1) * 1e3}


def run(Ts, H: int = 2, D: int = 32, max_reference_T: int = 4096, max_quadratic_T: int = 2048,
        backward: bool = True) -> dict:
    """Every (impl, T) in a fresh process, so that peak memory is that run's alone."""
    rows = []
    for T in Ts:
        for impl in IMPLS:
            if (impl == "reference" and T > max_reference_T) or (impl == "quadratic" and T > max_quadratic_T):
                continue
            for bwd in ((False, True) if backward else (False,)):
                cmd = [sys.executable, "-c", f"import json, mixc.bench as b; print(json.dumps(b._run_one("
                                             f"{impl!r}, {T}, {H}, {D}, {bwd})))"]
                env = dict(os.environ, TRITON_INTERPRET="0")
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
                if p.returncode != 0:
                    raise RuntimeError(f"bench {impl} T={T}: {p.stderr[-2000:]}")
                rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
            "spec": "gla", "rows": rows, "compile": compile_latency()}


def table(result: dict) -> str:
    rows = result["rows"]
    head = f"{'impl':14} {'T':>6} {'pass':8} {'ms':>10} {'peak MiB':>9} {'ms / first T':>12}"
    out = [head, "-" * len(head)]
    first = {}
    for r in rows:
        key = (r["impl"], r["backward"])
        first.setdefault(key, r)
        f = first[key]
        growth = r["ms"] / f["ms"] if f["ms"] else float("nan")
        out.append(f"{r['impl']:14} {r['T']:>6} {'fwd+bwd' if r['backward'] else 'fwd':8} {r['ms']:>10.1f} "
                   f"{r['peak_mib']:>9.1f} {growth:>12.1f}")
    c = result["compile"]
    out.append(f"compile ({c['spec']}): spec -> source {c['spec_to_source_ms']:.0f} ms, source -> first call "
               f"{c['source_to_first_call_ms']:.0f} ms")
    return "\n".join(out)


def plot(result: dict, path: Path, fla: dict | None = None) -> bool:
    """Time and peak memory against T for each implementation; with fla's rows (side_by_side),
    a third panel: mixc's time over fla's per spec (the table fla_table prints), forward +
    backward solid, forward dashed. False when matplotlib is missing."""
    try:
        import matplotlib       # optional: no plot without it
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt      # optional
    except ImportError:
        return False
    fla_rows = [r for r in (fla or {}).get("rows", []) if r.get("ratio") is not None]
    fig, axes = plt.subplots(1, 3 if fla_rows else 2, figsize=(15 if fla_rows else 10, 4))
    for impl in IMPLS:
        rs = [r for r in result["rows"] if r["impl"] == impl and r["backward"]] or \
             [r for r in result["rows"] if r["impl"] == impl]
        if rs:
            axes[0].loglog([r["T"] for r in rs], [r["ms"] for r in rs], "o-", label=impl)
            axes[1].loglog([r["T"] for r in rs], [max(r["peak_mib"], 0.1) for r in rs], "o-", label=impl)
    passes = "fwd+bwd" if any(r["backward"] for r in result["rows"]) else "fwd"
    axes[0].set(xlabel="T", ylabel=f"ms ({passes})", title="time")
    axes[1].set(xlabel="T", ylabel="peak MiB", title="memory")
    axes[0].legend()
    if fla_rows:
        ax = axes[2]
        specs = list(dict.fromkeys(r["spec"] for r in fla_rows))
        for k, spec in enumerate(specs):
            for bwd, style in ((True, "o-"), (False, "s--")):
                rs = sorted((r["T"], r["ratio"]) for r in fla_rows if r["spec"] == spec and r["backward"] == bwd)
                if rs:
                    ax.semilogx([t for t, _ in rs], [x for _, x in rs], style, color=f"C{k % 10}",
                                label=f"{spec} {'fwd+bwd' if bwd else 'fwd'}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="T", ylabel="mixc ms / fla ms", title=f"mixc (torch backend) vs {fla.get('fla', 'fla')} naive chunked")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def writable_folder(path: str) -> Path:
    """The output folder, created and tried with a test file now, so that a path onto a file
    or an unwritable folder is refused before minutes of work (an OSError naming it)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the output must be a folder, not a file", str(out))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".mixc-write-test-"):
        pass
    return out


def main(args) -> int:
    Ts = list(args.T) if not isinstance(args.T, str) else [int(x) for x in args.T.split(",")]
    if args.out:
        writable_folder(args.out)
    result = run(Ts, H=args.H, D=args.D, max_reference_T=args.max_reference_T,
                 max_quadratic_T=args.max_quadratic_T, backward=not args.forward_only)
    print(table(result))
    fla = None
    if not getattr(args, "no_fla", False):
        # the fla column: the torch backend against fla's naive chunked references, where fla is
        # importable (mixc/bench_fla.py; one process, calls interleaved)
        fla = side_by_side([T for T in Ts if T % 64 == 0], H=4, D=64, backward=not args.forward_only, threads=None)
        print(fla_table(fla))
        if fla["rows"]:
            print(FLA_COLUMNS)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
        written = ["cpu_bench.json"]
        if fla is not None and fla["rows"]:
            (out / "cpu_bench_fla.json").write_text(json.dumps(fla, indent=1) + "\n")
            written.append("cpu_bench_fla.json")
        if plot(result, out / "cpu_bench.png", fla):
            print(f"wrote {out}/: {', '.join(written)}, cpu_bench.png")
        else:
            print(f"wrote {out}/: {', '.join(written)} (no plot: matplotlib is not installed; {PLOT_HINT})")
    return 0

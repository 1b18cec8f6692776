"""The fla column of `mixc bench`: the torch backend (mode="torch", the CPU default) against
flash-linear-attention's pure-PyTorch chunked references (fla/ops/*/naive.py), forward and
forward + backward, timed interleaved in one process so that both see the same machine.

fla is never a dependency: where it is not importable the column says why and nothing else
changes. Its naive chunked functions in fla-core 0.6.0 and their conventions:

  simple_gla        naive_chunk_simple_gla(q, k, v, g)                      [B, T, H, d], C = 64
  gated_delta_rule  naive_chunk_gated_delta_rule(q, k, v, g, beta)          [B, T, H, d], C = 64
  linear_attn       naive_chunk_linear_attn(q, k, v, normalize=False)       [B, T, H, d], C = 64
  delta_rule        delta_rule_chunkwise(q, k, v, beta)                     [B, H, T, d], C = 32
  rwkv6             naive_chunk_rwkv6(r, k, v, w, u) (no scale: mixc's scale = 1)  [B, H, T, d], C = 32

gla has only a recurrent naive form, retention a quadratic one, so neither is here. For the
[B, H, T, d] ones the transpose from [B, T, H, d] is inside fla's timed call, as a caller
holding mixc's layout would do it. T must be a multiple of 64 (fla's linear_attn does not pad).

Each cell is the median of the calls' thread CPU time (time.thread_time: on a shared machine
wall time counts other processes' turns), with the quartiles of the per-pair ratios (call i of
mixc over call i of fla) as its spread, the minor page faults per call (a fresh tensor whose
pages glibc returned to the OS costs one per 4 KB touched) and the load average."""
from __future__ import annotations

import importlib
import os
import statistics
import time

import torch

from . import pipeline
from .runtime.inputs import random_args

FLA_NAIVE = {
    "simple_gla": ("fla.ops.simple_gla.naive", "naive_chunk_simple_gla"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule"),
    "linear_attn": ("fla.ops.linear_attn.naive", "naive_chunk_linear_attn"),
    "delta_rule": ("fla.ops.delta_rule.naive", "delta_rule_chunkwise"),
    "rwkv6": ("fla.ops.rwkv6.chunk_naive", "naive_chunk_rwkv6"),
}
SPECS = tuple(FLA_NAIVE)


def load_fla() -> tuple[dict | None, str]:
    """fla's naive functions by spec, or (None, why not)."""
    try:
        fns = {s: getattr(importlib.import_module(m), n) for s, (m, n) in FLA_NAIVE.items()}
    except Exception as err:                    # noqa: BLE001 - any failure means: no fla column
        return None, f"fla not importable: {type(err).__name__}: {err}"[:300]
    import fla          # optional: imported above when it is installed; here for its version
    return fns, f"fla {getattr(fla, '__version__', '?')}"


def inputs(spec: str, B: int, T: int, H: int, D: int, seed: int = 0) -> tuple:
    """(op, kwargs for mixc, options): inputs drawn by role (log gates below 0, beta in (0, 1));
    the delta rules' keys l2-normalized (as fla's callers do), rwkv6's scale 1 (fla's naive
    form has none)."""
    op = pipeline.load_op(spec)
    kw, _ = random_args(op.ir, B=B, T=T, H=H, sizes={"K": D, "V": D}, dtype=torch.float32, seed=seed,
                        bounded=True)
    if spec in ("delta_rule", "gated_delta_rule"):
        kw["k"] = torch.nn.functional.normalize(kw["k"], dim=-1)
    opts = {"scale": 1.0} if spec == "rwkv6" else {}
    return op, kw, opts


def call_fla(spec: str, fn, kw: dict):
    """fla's output [B, T, H, V] for mixc's keyword arguments."""
    if spec == "simple_gla":
        return fn(kw["q"], kw["k"], kw["v"], kw["g"])[0]
    if spec == "gated_delta_rule":
        return fn(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])[0]
    if spec == "linear_attn":
        return fn(kw["q"], kw["k"], kw["v"], normalize=False)
    t = [x.transpose(1, 2) for x in (kw["q"] if spec == "delta_rule" else kw["r"], kw["k"], kw["v"])]
    if spec == "delta_rule":
        return fn(*t, kw["beta"].transpose(1, 2))[0].transpose(1, 2)
    return fn(*t, kw["w"].transpose(1, 2), kw["u"]).transpose(1, 2)


def _minor_faults() -> int:
    try:
        import resource         # optional: POSIX only (the fault column is 0 elsewhere)
        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt
    except (ImportError, OSError):
        return 0


def _timer(fn, args: dict, backward: bool):
    """A call of fn (and its backward): (thread CPU seconds, wall seconds, minor page faults)."""
    grads = [x for x in args.values() if x.is_floating_point()]

    def once():
        for x in grads:
            x.grad = None
        f0, c0, t0 = _minor_faults(), time.thread_time(), time.perf_counter()
        o = fn()
        if backward:
            o.sum().backward()
        return time.thread_time() - c0, time.perf_counter() - t0, _minor_faults() - f0
    return once


def compare(spec: str, T: int, fns: dict, *, B: int = 1, H: int = 4, D: int = 64, reps: int = 5,
            backward: bool = False) -> dict:
    """mixc's and fla's median thread CPU ms, calls alternating (a warm-up each first), the
    quartiles of the per-pair ratios, faults per call, and their outputs' largest relative
    difference."""
    op, kw, opts = inputs(spec, B, T, H, D)
    if backward:
        for x in kw.values():
            x.requires_grad_(True)
    run_m = _timer(lambda: op(**kw, **opts, mode="torch")[0], kw, backward)
    run_f = _timer(lambda: call_fla(spec, fns[spec], kw), kw, backward)
    with torch.no_grad():
        om, of = op(**kw, **opts, mode="torch")[0], call_fla(spec, fns[spec], kw)
        diff = float((om - of).abs().max() / of.abs().max())
    run_m()
    try:
        run_f()
    except RuntimeError as err:                 # fla's rwkv6 writes in place what its backward needs
        run_f, why = None, f"fla's backward fails: {str(err)[:120]}"
    tm, tf = [], []
    for _ in range(reps):
        tm.append(run_m())
        if run_f is not None:
            tf.append(run_f())
    ms_m = statistics.median(c for c, _, _ in tm) * 1e3
    ms_f = statistics.median(c for c, _, _ in tf) * 1e3 if tf else None
    row = {"spec": spec, "T": T, "B": B, "H": H, "D": D, "backward": backward, "reps": reps, "clock": "thread_time",
           "mixc_ms": ms_m, "fla_ms": ms_f, "ratio": ms_m / ms_f if ms_f else None, "max_rel_diff": diff,
           "mixc_wall_ms": statistics.median(w for _, w, _ in tm) * 1e3,
           "mixc_faults": statistics.median(f for _, _, f in tm), "load": os.getloadavg()[0]}
    if ms_f is None:
        row["fla_note"] = why
        return row
    pair = [m[0] / f[0] for m, f in zip(tm, tf) if f[0] > 0]
    q = statistics.quantiles(pair, n=4) if len(pair) > 1 else [pair[0]] * 3
    row.update({"ratio_q1": q[0], "ratio_q3": q[2], "fla_wall_ms": statistics.median(w for _, w, _ in tf) * 1e3,
                "fla_faults": statistics.median(f for _, _, f in tf)})
    return row


def side_by_side(Ts, *, specs=SPECS, B: int = 1, H: int = 4, D: int = 64, reps: int = 5, backward: bool = True,
                 threads: int | None = 2, log=None) -> dict:
    """Every (spec, T, pass) where fla has a naive chunked form; {"fla": why not} without fla."""
    fns, why = load_fla()
    if fns is None:
        return {"fla": why, "rows": []}
    if threads:
        torch.set_num_threads(threads)
    rows = []
    for spec in specs:
        for T in Ts:
            for bwd in ((False, True) if backward else (False,)):
                # past 4K a call takes long enough for fewer repeats (a third, at least 3)
                n = reps if T <= 4096 else max(3, reps // 3)
                rows.append(compare(spec, T, fns, B=B, H=H, D=D, reps=n, backward=bwd))
                if log:
                    log(fla_table({"rows": rows[-1:]}, header=False))
    return {"fla": why, "threads": torch.get_num_threads(), "reps": reps, "rows": rows}


# what each column of fla_table means (printed under the table by `mixc bench`; bench/README.md)
FLA_COLUMNS = """\
  mixc ms, fla ms  median thread CPU time of one call (time.thread_time: other processes' turns not counted)
  x fla            mixc ms / fla ms (below 1: mixc is faster)
  q1-q3            quartiles of the per-pair ratios (call i of mixc over call i of fla): the spread
  rel diff         max |mixc - fla| / max |fla| of the two outputs
  mixc us/tok      mixc's time per token (flat across T when the backend is linear in T)
  faults m/f       minor page faults per call, mixc / fla: pages touched for the first time (a fresh tensor
                   whose memory glibc returned to the OS costs one per 4 KB), time that shows in neither
                   implementation's arithmetic
  load             the 1-minute load average when the row was measured: above the cores in use, other
                   processes competed for the CPU and the row's times are less reliable"""


def fla_table(result: dict, header: bool = True) -> str:
    if not result["rows"] and "fla" in result:
        return f"fla column: {result['fla']}"
    out = []
    if header:
        h = (f"{'spec':18} {'T':>6} {'pass':8} {'mixc ms':>10} {'fla ms':>10} {'x fla':>7} {'q1-q3':>11} "
             f"{'rel diff':>9} {'mixc us/tok':>11} {'faults m/f':>11} {'load':>5}")
        out += [h, "-" * len(h)]
    for r in result["rows"]:
        fla = (f"{r['fla_ms']:>10.2f} {r['ratio']:>7.2f} {r.get('ratio_q1', 0):>5.2f}-{r.get('ratio_q3', 0):<5.2f}"
               if r["fla_ms"] is not None else f"{'n/a':>10} {'':>7} {'':>11}")
        # time per token (B tokens a step): flat across T when the backend is linear in T
        per_tok = r["mixc_ms"] * 1e3 / (r["B"] * r["T"])
        faults = f"{r.get('mixc_faults', 0):.0f}/{r.get('fla_faults', 0):.0f}" if r["fla_ms"] is not None else ""
        out.append(f"{r['spec']:18} {r['T']:>6} {'fwd+bwd' if r['backward'] else 'fwd':8} {r['mixc_ms']:>10.2f} "
                   f"{fla} {r['max_rel_diff']:>9.1e} {per_tok:>11.2f} {faults:>11} {r.get('load', 0):>5.1f}")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="1024,4096,16384")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("-o", "--out")
    a = ap.parse_args()
    res = side_by_side([int(t) for t in a.T.split(",")], specs=a.specs.split(","), B=a.B, H=a.H, D=a.D,
                       reps=a.reps, backward=not a.forward_only, threads=a.threads, log=print)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(fla_table(res))

"""The before / after / fla run of this folder (bench/README.md, "Second run"): mixc_before is a copy
of the mixc package taken before the change (cp -r mixc /tmp/h17/before/mixc_before), mixc the
working tree, fla-core 0.6.0 and einops unzipped from bench/wheels into /tmp/flasite (never installed
in .venv). The three calls alternate in one process, 1 torch thread; each cell is the median of the
calls' thread CPU time (time.thread_time: the machine had a load average of 9-12 on 2 cores, so wall
time counts other processes' turns) and, beside it, of wall time.

    python ab.py SPECS TS REPS [bwd]       # e.g. simple_gla,delta_rule 1024,4096 9 bwd
"""
import sys, time, statistics, os, json
sys.path.insert(0, "/tmp/h17/before"); sys.path.insert(0, "/tmp/flasite")
import torch
torch.set_num_threads(1)
import mixc_before.bench_fla as BB
from mixc import bench_fla as BA
fns, why = BA.load_fla()
specs = sys.argv[1].split(","); Ts = [int(t) for t in sys.argv[2].split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
bwd = "bwd" in sys.argv
def timer(fn, args):
    grads = [x for x in args.values() if x.is_floating_point()]
    def once():
        for x in grads: x.grad = None
        c0 = time.thread_time(); t0 = time.perf_counter()
        o = fn()
        if bwd: o.sum().backward()
        return time.thread_time() - c0, time.perf_counter() - t0
    return once
rows = []
for spec in specs:
    for T in Ts:
        opB, kwB, opts = BB.inputs(spec, 1, T, 4, 64)
        opA, kw, _ = BA.inputs(spec, 1, T, 4, 64)
        for k in kw: assert torch.equal(kw[k], kwB[k])
        if bwd:
            for x in kw.values(): x.requires_grad_(True)
        with torch.no_grad():
            oa = opA(**kw, **opts, mode="torch")[0]; ob = opB(**kw, **opts, mode="torch")[0]
            of = BA.call_fla(spec, fns[spec], kw)
        d_ab = float((oa - ob).abs().max() / ob.abs().max()); d_af = float((oa - of).abs().max() / of.abs().max())
        runs = {"before": timer(lambda: opB(**kw, **opts, mode="torch")[0], kw),
                "after": timer(lambda: opA(**kw, **opts, mode="torch")[0], kw),
                "fla": timer(lambda: BA.call_fla(spec, fns[spec], kw), kw)}
        for k in list(runs):
            try:
                if T < 16384 or (k == "fla" and bwd): runs[k]()
            except RuntimeError:            # fla's rwkv6 backward fails (in-place write)
                del runs[k]
        res = {k: [] for k in runs}
        n = reps if T <= 4096 else max(3, reps // 3)
        for _ in range(n):
            for k, r in runs.items(): res[k].append(r())
        med = {k: (statistics.median(c for c, w in v) * 1e3, statistics.median(w for c, w in v) * 1e3) for k, v in res.items()}
        med.setdefault("fla", (float("nan"), float("nan")))
        row = dict(spec=spec, T=T, bwd=bwd, **{f"{k}_cpu": v[0] for k, v in med.items()}, **{f"{k}_wall": v[1] for k, v in med.items()}, d_ab=d_ab, d_af=d_af, load=os.getloadavg()[0])
        rows.append(row)
        print(f"{spec:17} {T:6} {'fwd+bwd' if bwd else 'fwd':7} cpu ms: before {med['before'][0]:8.2f} after {med['after'][0]:8.2f} fla {med['fla'][0]:8.2f} | ratio before {med['before'][0]/med['fla'][0]:.2f} after {med['after'][0]/med['fla'][0]:.2f} | wall ratio before {med['before'][1]/med['fla'][1]:.2f} after {med['after'][1]/med['fla'][1]:.2f} | diff {d_ab:.1e} {d_af:.1e} load {row['load']:.1f}", flush=True)
if len(sys.argv) > 4 and sys.argv[4].endswith(".json"):
    json.dump(rows, open(sys.argv[4], "w"), indent=1)

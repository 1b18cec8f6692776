"""The short table bench/gpu_check prints last, and its matplotlib plots (also from a saved
results.json: `bench/gpu_check --plot-only DIR`)."""
from __future__ import annotations

from pathlib import Path

from .timing import geomean

REF = (4, 4096, 64, 128)          # the shape whose ms the table prints (when it was timed)


def _f(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> str:
    """Correctness totals; per spec and pass: ms at a reference shape, TFLOP/s, and geometric
    means over every timed shape of the ratios to fla and to SDPA and of the floor multiple;
    decode at the shortest and longest context."""
    lines = []
    corr = res.get("correctness", [])
    bad = [r for r in corr if not r.get("ok")]
    lines.append(f"correctness: {len(corr) - len(bad)} passed, {len(bad)} failed"
                 + (": " + ", ".join(f"{r['spec']}/{r['mode']}/{r['dtype']}" for r in bad[:12]) if bad else ""))
    timing = [r for r in res.get("timing", []) if "ms" in r]
    if timing:
        shapes = [(r["B"], r["T"], r["H"], r["D"]) for r in timing]
        ref = REF if REF in shapes else max(set(shapes), key=lambda s: (shapes.count(s), s[0] * s[1] * s[2], s))
        lines.append(f"\ntiming ({res.get('dtype', 'bf16')}; ms at B,T,H,D = {ref}; geometric means over {len(set(shapes))} shapes; "
                     "x fla and x SDPA: mixc's ms over theirs, < 1 is faster)")
        head = f"{'spec':17} {'impl':10} {'pass':8} {'ms':>9} {'TFLOP/s':>8} {'x fla':>7} {'x SDPA':>7} {'x floor':>8}"
        lines += [head, "-" * len(head)]
        keys = sorted({(r["spec"], r["impl"], r["pass"]) for r in timing},
                      key=lambda k: (k[0] == "attention", k[0], k[1] != "mixc", k[1], k[2]))
        for spec, impl, p in keys:
            rows = [r for r in timing if (r["spec"], r["impl"], r["pass"]) == (spec, impl, p)]
            at = [r for r in rows if (r["B"], r["T"], r["H"], r["D"]) == ref]
            lines.append(f"{spec:17} {impl:10} {p:8} {_f(at[0]['ms'] if at else None):>9} "
                         f"{_f(at[0]['tflops'] if at else None):>8} "
                         f"{_f(geomean(r.get('ratio_fla') for r in rows) if impl == 'mixc' else None):>7} "
                         f"{_f(geomean(r.get('ratio_sdpa') for r in rows)):>7} "
                         f"{_f(geomean(r.get('floor_x') for r in rows)):>8}")
    skipped = [r for r in res.get("timing", []) if "skipped" in r or "error" in r]
    if skipped:
        why = {}
        for r in skipped:
            why.setdefault((r.get("impl"), (r.get("skipped") or r.get("error", ""))[:160]), []).append(r)
        lines.append("not timed:" + "".join(f"\n  {impl} x{len(v)}: {w}" for (impl, w), v in why.items()))
    for s in res.get("skipped", []):
        lines.append(f"skipped: {s['section']} {s.get('shape', '')}: {s['why']}")
    dec = [r for r in res.get("decode", []) if "ms" in r]
    if dec:
        ctx = sorted({r["context"] for r in dec if r.get("context")})
        sd = {r["context"]: r["ms"] for r in dec if r["impl"].startswith("sdpa")}
        lo, hi = (ctx[0], ctx[-1]) if ctx else (None, None)
        lines.append(f"\ndecode (one step, B={dec[0]['B']} H={dec[0]['H']} D={dec[0]['D']}, "
                     f"{'CUDA graph' if dec[0].get('graph') else 'eager'}): ms; SDPA {_f(sd.get(lo))} ms at "
                     f"{lo} and {_f(sd.get(hi))} ms at {hi} tokens of context")
        for r in [r for r in dec if r["impl"] == "mixc"]:
            lines.append(f"  {r['spec']:17} {r['ms']:.4f} ms   x fla: {_f(r.get('ratio_fla'))}"
                         f"   x SDPA@{lo}: {_f(r['ms'] / sd[lo] if lo in sd else None)}"
                         f"   x SDPA@{hi}: {_f(r['ms'] / sd[hi] if hi in sd else None)}   x floor {_f(r['floor_x'])}")
    return "\n".join(lines)


def plots(res: dict, out_dir: Path) -> list[str] | None:
    """timing.png (ms per spec at each shape of fla's set), sweep.png (ms against T at B*T
    constant), decode.png (ms against context). Returns the files written (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    written = []
    rows = [r for r in res.get("timing", []) if "ms" in r]
    for section, fname in (("fla_set", "timing.png"), ("sweep", "sweep.png")):
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        if section == "fla_set":
            shapes = sorted({(r["B"], r["T"], r["H"], r["D"]) for r in sec})
            fig, axes = plt.subplots(2, len(shapes), figsize=(4 * len(shapes), 7), squeeze=False)
            for j, shape in enumerate(shapes):
                for i, p in enumerate(("fwd", "fwd_bwd")):
                    ax = axes[i][j]
                    at = [r for r in sec if (r["B"], r["T"], r["H"], r["D"]) == shape and r["pass"] == p]
                    specs = sorted({r["spec"] for r in at if r["spec"] != "attention"})
                    for k, impl in enumerate(("mixc", "fla")):
                        ms = [next((r["ms"] for r in at if r["spec"] == s and r["impl"] == impl), 0) for s in specs]
                        ax.bar([x + 0.4 * k for x in range(len(specs))], ms, width=0.4, label=impl)
                    for r in at:
                        if r["spec"] == "attention":
                            ax.axhline(r["ms"], ls="--", lw=1, color="k" if "flash" in r["impl"] else "gray",
                                       label=r["impl"])
                    ax.set_xticks([x + 0.2 for x in range(len(specs))], specs, rotation=60, fontsize=7)
                    ax.set_title(f"{p} B,T,H,D={shape}", fontsize=8)
                    ax.set_ylabel("ms")
            axes[0][0].legend(fontsize=7)
        else:
            dims = sorted({r["D"] for r in sec})
            fig, axes = plt.subplots(2, len(dims), figsize=(6 * len(dims), 8), squeeze=False)
            for j, D in enumerate(dims):
                for i, p in enumerate(("fwd", "fwd_bwd")):
                    ax = axes[i][j]
                    for (spec, impl) in sorted({(r["spec"], r["impl"]) for r in sec if r["D"] == D}):
                        pts = sorted((r["T"], r["ms"]) for r in sec if (r["spec"], r["impl"], r["D"], r["pass"])
                                     == (spec, impl, D, p))
                        if pts:
                            att = spec == "attention"
                            ax.plot(*zip(*pts), marker="o", ms=3, ls={"mixc": "-", "fla": "--"}.get(impl, ":"),
                                    label=impl if att else f"{spec} ({impl})",
                                    **({"color": "k" if "cudnn" not in impl else "gray"} if att else {}))
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_xlabel("T (B*T constant)")
                    ax.set_ylabel("ms")
                    ax.set_title(f"{p}, D={D}", fontsize=9)
            axes[0][0].legend(fontsize=6, ncol=2)
        fig.suptitle(f"{res.get('device')}: {section}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    dec = [r for r in res.get("decode", []) if "ms" in r]
    if dec:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sd = sorted((r["context"], r["ms"]) for r in dec if r["impl"].startswith("sdpa"))
        if sd:
            ax.plot(*zip(*sd), "k-o", label="SDPA decode (KV cache)")
        for r in [r for r in dec if r["impl"] in ("mixc", "fla")]:
            ax.axhline(r["ms"], lw=1, ls="-" if r["impl"] == "mixc" else ":", label=f"{r['spec']} step ({r['impl']})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out_dir / "decode.png", dpi=110)
        plt.close(fig)
        written.append("decode.png")
    return written

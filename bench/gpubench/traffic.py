"""The traffic report: every launch of one op call, mixc's and fla's, Triton kernels and torch
ops alike, with the bytes each moves through HBM, counted without a GPU.

How (the issue 16 method): the op runs on CPU tensors under the stand-in driver
(bench/gpubench/fakecuda.py: sm_90's host decisions, every @triton.jit launch compiled, not
run). For a Triton launch, the compiled TTIR says which pointer arguments the kernel loads from
and which it stores to (`pointer_access`: each pointer's origin followed through addptr,
splat, loops and descriptors to its tt.load / tt.store / tt.atomic_*); each tensor behind such
an argument counts once per kernel, whole: read if loaded, written if stored (both if both).
Torch ops between kernels (casts, sums, zero fills, copies) are recorded by a
TorchDispatchMode (`TorchTraffic`): tensor arguments read, outputs and mutated arguments
written; views and allocations move nothing. Everything a kernel leaves for the next goes
through HBM: no cache is modelled. Bytes per token-head = the sum over launches / (B T H).

The floor (bench/gpubench/formulas.py): 2 bytes x (every per-token input + the output) for the
forward; forward + backward adds the inputs and dO read again and every input gradient written.
"""
from __future__ import annotations

import re

LOADS = ("tt.load", "tt.descriptor_load", "tt.descriptor_gather")
STORES = ("tt.store", "tt.descriptor_store", "tt.descriptor_scatter", "tt.descriptor_reduce")
ATOMICS = ("tt.atomic_rmw", "tt.atomic_cas")
_RESULT = re.compile(r'^%([\w.$-]+)(?::(\d+))?\s*=\s*"?([\w.]+)"?')
_OP = re.compile(r'^"?([a-z_]+\.[\w.]+)"?')
_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_ARG = re.compile(r"%([\w.$-]+):\s*!tt\.ptr")
_LOC = re.compile(r"\s*loc\(.*$")


def pointer_access(ttir: str) -> dict[str, str]:
    """{pointer argument: "r", "w" or "rw"} of a kernel from its TTIR (Triton's first IR, after
    its cleanup passes: a load whose value is unused is gone). An argument missing from the
    result is neither loaded nor stored."""
    raw = ttir.splitlines()
    at = next(i for i, x in enumerate(raw) if x.strip().startswith("tt.func"))
    args = _ARG.findall(raw[at])                # each argument carries its own loc(...)
    origin: dict[str, set] = {"%" + a: {a} for a in args}
    access: dict[str, set] = {}
    body = [_LOC.sub("", x).strip() for x in raw[at + 1:]]
    for _ in range(2):                          # a second pass sees what loops carry back
        stack: list[dict] = []
        for line in body:
            if line.startswith("}"):
                if not re.match(r"^\}\s*(else|do)\s*\{", line) and stack:
                    _close(stack.pop(), origin)
                continue
            m = _RESULT.match(line)
            name, n, op = (m.group(1), int(m.group(2) or 1), m.group(3)) if m else (None, 0, None)
            if op is None:
                om = _OP.match(line)
                op = om.group(1) if om else ""
            rhs = line.split("=", 1)[1] if m else line
            values = _VALUE.findall(rhs)
            src = lambda v: origin.get(v, set())                   # noqa: E731
            if op in LOADS + STORES + ATOMICS and values:
                mode = "r" if op in LOADS else "w" if op in STORES else "rw"
                for a in src(values[0]):
                    access.setdefault(a, set()).update(mode)
                continue                         # a loaded value is data, not a pointer
            if op in ("scf.yield", "scf.condition") and stack:
                vals = values[1:] if op == "scf.condition" else values
                stack[-1]["yields"].append([src(v) for v in vals])
                continue
            if line.startswith("^bb") and stack:  # a while loop's after-region: its block args
                for v in _VALUE.findall(line):
                    origin[v] = set().union(*stack[-1]["inits"]) if stack[-1]["inits"] else set()
                continue
            inits = []
            if op in ("scf.for", "scf.while"):       # iter_args(%a = %x, ...) / scf.while (%a = %x)
                pairs = re.search(r"iter_args\((.*?)\)\s*->" if op == "scf.for" else r"scf\.while\s*\((.*?)\)\s*:", rhs)
                for blk, init in re.findall(r"(%[\w.$-]+)\s*=\s*(%[\w.$-]+(?:#\d+)?)", pairs.group(1) if pairs else ""):
                    origin[blk] = set(src(init))
                    inits.append(src(init))
            here = set().union(*(src(v) for v in values)) if values else set()
            if name is not None:
                origin["%" + name] = set(here)
                for i in range(n):
                    origin[f"%{name}#{i}"] = set(inits[i]) if i < len(inits) else set(here)
            if line.endswith("{"):
                stack.append({"name": name, "n": n, "inits": inits, "yields": [], "scf": op.startswith("scf.")})
    return {a: "".join(c for c in "rw" if c in access[a]) for a in args if a in access}


def _close(frame: dict, origin: dict) -> None:
    """A region's results take what its yields carry (and, for loops, their initial values)."""
    if frame["name"] is None or not frame["scf"]:
        return
    for i in range(frame["n"]):
        got = set(frame["inits"][i]) if i < len(frame["inits"]) else set()
        for y in frame["yields"]:
            if i < len(y):
                got |= y[i]
        origin[f"%{frame['name']}#{i}"] = got
        if frame["n"] == 1:
            origin["%" + frame["name"]] = got


def launch_bytes(tensors: dict, access: dict) -> tuple[int, int, list, list]:
    """(bytes read, bytes written, names read, names written) of one kernel launch: each tensor
    (by address and size) once per kernel, whole."""
    read, written, rn, wn = {}, {}, [], []
    for arg, mode in access.items():
        t = tensors.get(arg)
        if t is None:
            continue
        key = (t["ptr"], t["nbytes"])
        if "r" in mode:
            read[key] = t["nbytes"]
            rn.append(arg)
        if "w" in mode:
            written[key] = t["nbytes"]
            wn.append(arg)
    return sum(read.values()), sum(written.values()), rn, wn


# ops that write their mutated argument without reading it
_OVERWRITE = ("fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_")


def torch_traffic_mode(records: list, phase: dict):
    """A TorchDispatchMode that appends one record per torch op that moves bytes (kind "torch":
    op name, bytes read and written) to records, tagged with phase["name"]."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def flat(v):
        if isinstance(v, torch.Tensor):
            return [v]
        if isinstance(v, (list, tuple)):
            return [x for x in v if isinstance(x, torch.Tensor)]
        return []

    def key(t):
        return (t.data_ptr(), t.numel() * t.element_size())

    class TorchTraffic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
                return out                              # a view: no bytes move
            name = schema.name.split("::")[-1]
            read, written = {}, {}
            fresh = name.endswith("_like") or name.startswith("new_")     # zeros_like(x): x's shape, not its data
            for i, a in enumerate(schema.arguments):
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in flat(v):
                    if a.alias_info is not None and a.alias_info.is_write:
                        written[key(t)] = 1
                        if not name.endswith(_OVERWRITE) and not a.kwarg_only:
                            read[key(t)] = 1
                    elif not fresh:
                        read[key(t)] = 1
            if all(r.alias_info is None for r in schema.returns):
                for t in flat(out):
                    written[key(t)] = 1
            rb, wb = sum(k[1] for k in read), sum(k[1] for k in written)
            if name.startswith(("empty", "new_empty", "_local_scalar_dense")) or rb + wb == 0:
                return out                              # an allocation or a host read
            records.append({"kind": "torch", "phase": phase["name"], "kernel": f"torch {name}",
                            "read": rb, "written": wb})
            return out

    return TorchTraffic()


def launches_of(records: list) -> list[dict]:
    """The stand-in driver's records (Triton launches, and the torch ops torch_traffic_mode
    added) as launches: phase, kind, kernel, bytes read and written, and for Triton the
    arguments read and written, the grid and the tensor-core FLOPs (None: unknown)."""
    from gpubench.ttir_flops import launch_flops
    launches, seen = [], {}
    for r in records:
        if r["kind"] == "torch":
            launches.append({k: r[k] for k in ("phase", "kind", "kernel", "read", "written")})
            continue
        k = r["compiled"]
        if id(k) not in seen:
            seen[id(k)] = (k, pointer_access(k.asm["ttir"]))
        access = seen[id(k)][1]
        rb, wb, rn, wn = launch_bytes(r["tensors"], access)
        name = r["kernel"]          # mixc's chunked kernels: one per stage, named for it
        try:
            flops = launch_flops(k.asm["ttir"], r["scalars"], r["grid"])
        except Exception:                           # noqa: BLE001 - TTIR this walk does not follow
            flops = None
        launches.append({"phase": r["phase"], "kind": "triton", "kernel": name, "read": rb, "written": wb,
                         "reads": rn, "writes": wn, "flops": flops, "grid": r["grid"]})
    return launches


PASSES = ("fwd", "train_fwd", "bwd")       # inference forward; forward saving for the backward; backward


def run_one(spec: str, impl: str, D: int, T: int, H: int) -> dict:
    """In this process (the stand-in driver installed first): every launch of `impl`'s op at
    B = 1, T, H, K = V = D in bf16: a forward under no_grad ("fwd"), then a forward with
    gradients ("train_fwd") and its backward ("bwd"). mixc: the untuned CUDA launch (each
    autotune list's first config); fla: the typical config of each autotuned kernel."""
    from gpubench.static import setup
    call, leaves, op, forced, why = setup(spec, impl, D, T, H)
    if call is None:
        return {"spec": spec, "impl": impl, "error": why}
    import torch

    from gpubench import fakecuda
    from gpubench import formulas as Fm
    if impl == "mixc":
        from mixc.runtime import autotune
        for form in ("chunk_fwd", "chunk_bwd"):
            forced[form] = autotune.default(op.plan(), form)
    sizes = {d.name: D for d in op.ir.dims if not d.alias_of}
    for d in op.ir.dims:
        sizes.setdefault(d.name, sizes.get(op.ir.root_dim(d.name)))
    n_in, n_out = Fm.io_elements(op.ir, sizes)
    records = fakecuda.RECORDS
    records.clear()
    mode = torch_traffic_mode(records, fakecuda.PHASE)
    try:
        with torch.no_grad(), mode:
            fakecuda.PHASE["name"] = "fwd"
            o = call(leaves)
        do = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(5))
        with mode:
            fakecuda.PHASE["name"] = "train_fwd"
            o = call(leaves)
            fakecuda.PHASE["name"] = "bwd"
            torch.autograd.backward(o, do)
    except Exception as err:                        # noqa: BLE001 - recorded in the table
        return {"spec": spec, "impl": impl, "error": f"{type(err).__name__}: {err}"[:400]}
    launches = launches_of(records)
    return {"spec": spec, "impl": impl, "tokens_heads": T * H, "n_in": n_in, "n_out": n_out,
            "floor": Fm.floor_bytes(n_in, n_out), "launches": launches}


def collect(specs, impls=("mixc", "fla"), D=128, T=2048, H=16, jobs=2) -> list[dict]:
    """run_one for each (spec, impl), each in a fresh process (jobs at a time)."""
    import concurrent.futures as cf
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1]
    todo = [(s, i) for s in specs for i in impls]

    def one(si):
        spec, impl = si
        code = (f"import json, sys; sys.path[:0] = [{str(bench)!r}]; from gpubench.traffic import run_one; "
                f"print('@@' + json.dumps(run_one({spec!r}, {impl!r}, {D}, {T}, {H})))")
        env = dict(os.environ, TRITON_INTERPRET="0")
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                           timeout=3600)
        out = [x for x in p.stdout.splitlines() if x.startswith("@@")]
        if p.returncode or not out:
            return {"spec": spec, "impl": impl, "error": (p.stderr or p.stdout)[-600:]}
        return json.loads(out[-1][2:])

    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        return list(ex.map(one, todo))


def summary(res: dict) -> dict:
    """Per pass ("fwd": the inference forward; "fwd_bwd": the training forward + backward):
    launches (Triton, torch), bytes per token-head and that over the floor."""
    out = {}
    for key, phases in (("fwd", ("fwd",)), ("fwd_bwd", ("train_fwd", "bwd"))):
        ls = [x for x in res["launches"] if x["phase"] in phases]
        b = sum(x["read"] + x["written"] for x in ls) / res["tokens_heads"]
        fl = [x.get("flops") for x in ls if x["kind"] == "triton"]
        out[key] = {"triton": sum(x["kind"] == "triton" for x in ls), "torch": sum(x["kind"] == "torch" for x in ls),
                    "bytes": b, "x_floor": b / res["floor"][key],
                    "flops": None if None in fl else sum(fl) / res["tokens_heads"]}
    return out


def _n(x, fmt="{:.0f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(results: list[dict], meta: dict, modeled: dict | None = None, model_note: str = "") -> str:
    """The summary (per op: mixc, fla; forward and forward + backward), the modeled time of each
    op call where `modeled` has it ({(spec, impl): {'fwd': s, 'fwd_bwd': s}}: time_model.
    modeled_times; model_note says on what) and the per-launch table."""
    from gpubench import formulas as Fm
    D = meta["D"]
    out = [f"sm_90 host decisions (stand-in driver), {meta['triton']}, {meta['fla']}; B = 1, T = {meta['T']}, "
           f"H = {meta['H']}, K = V = {D} (Mamba-2: N = P = {D}), bf16. Per token-head: bytes through HBM (each "
           "tensor a kernel loads or stores counted once per kernel, whole; torch ops' inputs and outputs) and "
           "tensor-core FLOPs (tt.dot x trips x grid). Launches: Triton kernels + torch ops. x floor: bytes over "
           "2 B x (inputs + output) (fwd) / 2 B x (3 inputs + 2 outputs) (fwd+bwd); x nominal: FLOPs over "
           "bench/gpubench/formulas.py's chunked count at C = 64. fwd is the inference forward (no_grad); "
           "fwd+bwd the forward that saves for the backward, plus the backward.", "",
           "| op | impl | fwd launches | fwd B | x floor | fwd FLOPs | x nominal | fwd+bwd launches | fwd+bwd B "
           "| x floor | fwd+bwd FLOPs | x nominal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            out.append(f"| {r['spec']} | {r['impl']} | error: {r['error'][-150:]} |" + " |" * 9)
            continue
        s, nominal = summary(r), Fm.chunk_flops(r["spec"], D, D)
        cells = []
        for key in ("fwd", "fwd_bwd"):
            x = s[key]
            fl = x["flops"]
            cells += [f"{x['triton']} + {x['torch']}", f"{x['bytes']:.0f}", f"{x['x_floor']:.2f}",
                      _n(fl), _n(None if fl is None else fl / nominal[key], "{:.2f}")]
        impl = r["impl"] + (" (simple_gla's kernels + torch)" if r["impl"] == "fla" and r["spec"] == "mamba2" else "")
        out.append(f"| {r['spec']} | {impl} | " + " | ".join(cells) + " |")
    if modeled:
        out += ["", f"Modeled time (bench/gpubench/time_model.py: per launch the larger of bytes over bandwidth, "
                f"FLOPs over peak and the dependent chain, scaled by occupancy; {model_note}). A model, not a "
                "measurement: bench/README.md says how close it comes.", "",
                "| op | mixc fwd ms | fla fwd ms | mixc / fla | mixc fwd+bwd ms | fla fwd+bwd ms | mixc / fla |",
                "|---|---|---|---|---|---|---|"]
        for spec in dict.fromkeys(r["spec"] for r in results):
            mx, fl = modeled.get((spec, "mixc")), modeled.get((spec, "fla"))
            if mx is None or fl is None:
                continue
            out.append(f"| {spec} | {mx['fwd'] * 1e3:.3f} | {fl['fwd'] * 1e3:.3f} | {mx['fwd'] / fl['fwd']:.2f} | "
                       f"{mx['fwd_bwd'] * 1e3:.3f} | {fl['fwd_bwd'] * 1e3:.3f} | {mx['fwd_bwd'] / fl['fwd_bwd']:.2f} |")
    out += ["", "| op | impl | pass | kernel | grid | read B | written B | reads | writes | FLOPs |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r.get("launches", []):
            th = r["tokens_heads"]
            grid = "x".join(map(str, x["grid"])) if x.get("grid") else ""
            out.append(f"| {r['spec']} | {r['impl']} | {x['phase']} | {x['kernel']} | {grid} | {x['read'] / th:.0f} "
                       f"| {x['written'] / th:.0f} | {' '.join(x.get('reads', []))} | {' '.join(x.get('writes', []))} "
                       f"| {_n(None if x.get('flops') is None else x['flops'] / th) if x['kind'] == 'triton' else ''} |")
    return "\n".join(out)

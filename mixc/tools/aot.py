"""Ahead-of-time compilation of generated kernels for a GPU target, with no GPU: catches what
the interpreter forgives (dtype rules, block shapes, shared memory) and shows the code.

Needs compiled (not interpreted) kernels: run it in a process without TRITON_INTERPRET=1
(`python -m mixc.tools.aot NAME ...`, `mixc compile NAME --report`). The spec goes through the
stages of mixc/pipeline.py (compile: read, parse, check, derive; load: render, cache, import)."""
from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .. import pipeline
from ..codegen.key_split import key_dim as plan_key
from ..codegen.launch_plan import chunk_stages, kernel_name, stage_kernel_name
from ..derive.plan import Plan
from ..derive.system_chunk import kernel_unsupported
from ..runtime import system_kernels as SK
from ..runtime.system_chunk import SYSTEM_CHUNK, SYSTEM_WARPS
from ..runtime.cache import interpreting
from ..runtime.launch import rules
from ..standalone.launcher import block

_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# constexpr values of the switches of every template, by role (standalone/kernel_args.py)
_SWITCHES = {"use_initial": True, "store_final": True, "varlen": False, "store_ckpt": True, "use_dfinal": True,
             "use_indices": False, "ck": 32, "unit": 16,
             "segmented": False}     # the segmented walk's correction (segments.py) is a launch-time choice
# every stage's kernel of the chunked forms (standalone/kernel_args.py CHUNK_STAGES)
STAGES = ("fused", "walk", "output", "refill", "intra", "tiles")
_DOT = {"bfloat16": 1, "float16": 2, "float32": 0}


def _form(kernel, plan: Plan) -> str:
    """The form of one of the plan's kernels (its name is kernel_name(plan, form), a chunked
    form's stage_kernel_name(plan, form, stage))."""
    name = getattr(kernel, "fn", kernel).__name__
    for form in plan.layout.kernel_args:
        if name == kernel_name(plan, form) or (form.startswith("chunk") and any(
                name == stage_kernel_name(plan, form, s) or name.startswith(stage_kernel_name(plan, form, s) + "_")
                for s in chunk_stages(plan, form))):
            return form
    raise ValueError(f"{name} is none of {plan.name}'s kernels ({', '.join(plan.layout.kernel_args)})")


def signature(kernel, plan: Plan, sizes: dict[str, int], dtype: str = "bfloat16",
              stage_solve: bool | None = None) -> tuple[dict, dict]:
    """(signature, constexprs) of a generated kernel from its argument list (plan.layout.
    kernel_args, the definition its signature was printed from): pointers by their role's dtype
    rule ("io": `dtype`, the inputs, the output and their gradients; "fp32"; "i32"), runtime
    scalars i32 or fp32, constexprs the dims' sizes and blocks, the plan's chunk size and the
    switches above."""
    t = _DTYPE[dtype]
    form = _form(kernel, plan)
    policy = rules(plan)                            # the launcher's rules (standalone/launcher.py)
    chunked = form.startswith("chunk")              # matmul blocks are at least 16
    sig, const = {}, {}
    for a in plan.layout.kernel_args[form].args:
        if not a.constexpr:
            code = t if a.dtype == "io" else a.dtype
            sig[a.name] = f"*{code}" if a.kind == "pointer" else code
            continue
        sig[a.name] = "constexpr"
        if a.role == "size":
            const[a.name] = sizes[a.of]
        elif a.role == "block":
            const[a.name] = max(16, block(sizes[a.of])) if chunked else block(sizes[a.of])
        elif a.role == "chunk":
            const[a.name] = plan.layout.chunk_size
        elif a.role == "dot":
            const[a.name] = _DOT[dtype] if plan.layout.half_matmuls or not _DOT[dtype] else 3   # launcher.dot_code
        elif a.role == "ckpt_every":        # the policy's at long sequences (Launcher.checkpoint_every)
            const[a.name] = max(1, policy.checkpoint_tokens() // plan.layout.chunk_size)
        elif a.role == "key_block":         # the launch's policy (Launcher.key_block)
            blocks = {("block", d): max(16, block(n)) for d, n in sizes.items()}
            const[a.name] = policy.key_block(blocks, plan.layout.chunk_size)
        else:
            const[a.name] = _SWITCHES[a.role]
    return sig, const


def compile_kernel(kernel, sig: dict, constexprs: dict, arch: int = 90, num_warps: int = 4, num_stages: int = 2):
    """triton.compile for CUDA sm_<arch>."""
    fn = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else triton.runtime.jit.JITFunction(
        inspect.unwrap(getattr(kernel, "fn", kernel)))
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_spec(name: str, archs=(90, 80), size: int = 16, dtype: str = "bfloat16",
                 stages=STAGES, forms=None, key_block: int | None = None,
                 ckpt_every: int = 1, stage_solve: bool = False) -> list[dict]:
    """Compile every kernel of a library spec (or .mix file) for each arch; one report per kernel,
    a chunked form's the kernels of its stages in `stages` (fused: the walk alone; walk and
    output, walk and tiles: the two launches; refill: the forward's refill of every chunk's
    state, which the backward launches first; intra: the forward's intra-chunk matrices, where
    the plan stages them), each reported as <form>_<stage>. forms: only these kernel forms;
    key_block: the forward's KEY_BLOCK (and ckpt_every chunks a program), so that the output and
    intra kernels compile their loop over the key dim's blocks (codegen/key_split.py; the output
    kernel walking more than one chunk: its static key blocks, codegen/key_walk.py);
    stage_solve: the rank-1 walk and output kernel reading the inverses the intra kernel staged
    (launch.STAGE_SOLVE's path)."""
    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs compiled kernels: unset TRITON_INTERPRET")
    plan = pipeline.compile(name)
    if plan.sequence is not None:          # conv, mix, attend: computed by torch, no kernel to compile
        return []
    mod = pipeline.load(plan)
    sizes = {d: size for d in plan.ir.dim_names}
    out = []
    for form, kname in mod.METADATA["kernels"].items():
        if forms is not None and form not in forms:
            continue
        kernels = ([(f"{form}_{s}", getattr(mod, stage_kernel_name(plan, form, s)))
                    for s in chunk_stages(plan, form) if s in stages]
                   if form.startswith("chunk") else [(form, getattr(mod, kname))])
        for label, kernel in kernels:
            sig, const = signature(kernel, plan, sizes, dtype, stage_solve)
            if key_block is not None and "KEY_BLOCK" in const:
                const["KEY_BLOCK"] = key_block
                if "CKPT_EVERY" in const:
                    const["CKPT_EVERY"] = ckpt_every
            if form.startswith("chunk"):
                # the variant the launcher picks with these constexprs (Launcher.variant), staged
                # as the launch stages (Launcher.stages: the key-diagonal A, and the rank-1
                # inverse only where stage_solve or launch.STAGE_SOLVE asks)
                policy, key = rules(plan), plan_key(plan)
                v = {"stage": label[len(form) + 1:], "ckpt_every": const.get("CKPT_EVERY", 1),
                     "staged_intra": policy.stages(stage_solve), "key_block": const.get("KEY_BLOCK", 0),
                     ("block", key): const.get(f"_BLOCK_{key}", 0)}
                kernel = policy.kernel(form, None, v["stage"], v)[1]
            for arch in archs:
                t0 = time.perf_counter()
                ck = compile_kernel(kernel, sig, const, arch=arch)
                ptx = ck.asm["ptx"]
                tensor_cores = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None
                out.append({"spec": name, "kernel": label,
                            "arch": f"sm_{arch}", "shared_bytes": ck.metadata.shared, **ptxas_usage(ptx, arch),
                            "tensor_cores": tensor_cores, "cubin_bytes": len(ck.asm["cubin"]),
                            "seconds": round(time.perf_counter() - t0, 2)})
    if forms is None or "system_chunk" in forms:
        out += compile_system(name, plan, archs, size)
    return out


def compile_system(name: str, plan: Plan, archs, size: int, C: int = SYSTEM_CHUNK) -> list[dict]:
    """The chunked kernels of a 2x2 block-affine system (runtime/system_kernels.py: not generated
    per spec; they take the system's pieces), where the plan's forms list chunk: the forward
    and the backward, reported as system_chunk_fwd / _bwd at K = V = size, chunks of C."""
    if not plan.systems or "chunk" not in plan.forms:
        return []
    if kernel_unsupported(plan) is not None:
        return []
    blk = max(16, block(size))
    shape = dict(C=C, BK=blk, BV=min(blk, 64), READ=1, QS=1, PREV=False, DOT=3)
    out = []
    for label, kernel, switch in (("system_chunk_fwd", SK.system_chunk_fwd, "USE_INIT"),
                                  ("system_chunk_bwd", SK.system_chunk_bwd, "USE_DFINAL")):
        names = list(inspect.signature(kernel.fn).parameters)
        sig = {n: ("constexpr" if n in shape or n == switch else
                   "*i64" if n == "p_cu" else "*fp32" if n.startswith("p_") else "i32") for n in names}
        for arch in archs:
            t0 = time.perf_counter()
            ck = compile_kernel(kernel, sig, shape | {switch: True}, arch=arch, num_warps=SYSTEM_WARPS[label[-3:]])
            ptx = ck.asm["ptx"]
            out.append({"spec": name, "kernel": label, "arch": f"sm_{arch}", "shared_bytes": ck.metadata.shared,
                        **ptxas_usage(ptx, arch),
                        "tensor_cores": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None,
                        "cubin_bytes": len(ck.asm["cubin"]), "seconds": round(time.perf_counter() - t0, 2)})
    return out


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spills as ptxas reports them (-v), with the ptxas that Triton ships."""
    try:                                  # the ptxas Triton itself uses for this arch
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
    except (ImportError, TypeError, AttributeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return {"registers": None, "spill_bytes": None}
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = p.stdout + p.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": max(spills) if spills else 0}


def report_table(reports: list[dict]) -> str:
    head = f"{'spec':18} {'kernel':18} {'arch':6} {'regs':>5} {'spill B':>8} {'smem B':>8} {'tensor cores':12}"
    rows = [head, "-" * len(head)]
    for r in reports:
        rows.append(f"{r['spec']:18} {r['kernel']:18} {r['arch']:6} {str(r['registers']):>5} "
                    f"{str(r['spill_bytes']):>8} {r['shared_bytes']:>8} {str(r['tensor_cores'] or '-'):12}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compile generated kernels for sm_90 / sm_80 without a GPU")
    p.add_argument("specs", nargs="+")
    p.add_argument("--arch", type=int, action="append")
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--table", action="store_true", help="a table instead of JSON")
    p.add_argument("--stages", default=",".join(STAGES),
                   help="the chunked forms' kernels to compile, by stage (fused: the walk alone; walk and output, "
                        "walk and tiles: the two launches; refill: the forward's refill of every chunk's state for "
                        "the backward; intra: the forward's intra-chunk matrices, where staged)")
    p.add_argument("--forms", help="only these kernel forms (comma-separated: chunk_fwd, chunk_bwd, ...)")
    p.add_argument("--key-block", type=int, help="the chunked forward's KEY_BLOCK (one chunk a program): the output "
                                                 "and intra kernels compile their loop over key blocks where it is "
                                                 "less than the key dim's block")
    p.add_argument("--ckpt-every", type=int, default=1,
                   help="with --key-block: the chunks a forward output program walks (CKPT_EVERY; more than "
                        "one: the state in static key blocks, codegen/key_walk.py)")
    p.add_argument("--stage-solve", action="store_true",
                   help="the rank-1 class's staged inverse (launch.STAGE_SOLVE, on by default at run time): its walk and "
                        "output kernel read it; without it they compile with the solve in the walk (STAGE_SOLVE off)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="specs compiled at once, one process each (default: the CPU count)")
    args = p.parse_args(argv)
    archs = tuple(args.arch or (90, 80))
    stages = tuple(x for x in args.stages.split(",") if x)
    if set(stages) - set(STAGES):
        p.error(f"--stages: expected some of {', '.join(STAGES)}, got {', '.join(sorted(set(stages) - set(STAGES)))}")
    forms = tuple(args.forms.split(",")) if args.forms else None
    n = len(args.specs)
    if args.jobs > 1 and n > 1:
        # the Triton compiler and ptxas are CPU-bound: processes, one spec each
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
            per_spec = list(pool.map(compile_spec, args.specs, [archs] * n, [args.size] * n, ["bfloat16"] * n,
                                     [stages] * n, [forms] * n, [args.key_block] * n, [args.ckpt_every] * n,
                                     [args.stage_solve] * n))
    else:
        per_spec = [compile_spec(name, archs, args.size, stages=stages, forms=forms, key_block=args.key_block,
                                 ckpt_every=args.ckpt_every, stage_solve=args.stage_solve) for name in args.specs]
    reports = [r for rs in per_spec for r in rs]
    if args.table:
        print(report_table(reports))
    else:
        json.dump(reports, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

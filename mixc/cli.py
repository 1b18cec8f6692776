"""mixc command line: list | check | explain | run. Spec errors print and exit 1."""
from __future__ import annotations

import argparse
import sys
import time

from .dsl import SpecError, library_names, read_spec, parse
from .dsl.unparse import spec_text


def _flags(pairs: list[str]) -> dict[str, bool]:
    out = {}
    for p in pairs or []:
        name, _, value = p.partition("=")
        if value.lower() not in ("true", "false", "1", "0", ""):
            raise SpecError(f"--set {p}: a flag takes true or false")
        out[name] = value.lower() in ("true", "1", "")
    return out


def _sizes(pairs: list[str]) -> dict[str, int]:
    out = {}
    for p in pairs or []:
        name, _, value = p.partition("=")
        if not value.isdigit() or int(value) < 1:
            raise SpecError(f"--dim {p}: expected NAME=SIZE with a positive size")
        out[name] = int(value)
    return out


def _load(target: str):
    src = read_spec(target)
    return parse(src.text, src.filename)


def cmd_list(args) -> int:
    from .derive.plan import derive
    rows = []
    for name in library_names():
        plan = derive(_load(name))
        if plan.sequence is not None:       # a cache of the past (none when it reads the future)
            seq = plan.sequence
            states = "cache: " + ", ".join(seq.cache_keys) if seq.no_step is None else "none (not causal)"
        else:
            states = ", ".join(f"{s.name}[{', '.join(s.shape)}]" for s in plan.ir.states)
        rows.append((name, plan.transition, ", ".join(plan.forms), states))
    w = [max(len(r[i]) for r in rows + [("spec", "class", "forms", "states")]) for i in range(4)]
    print(f"{'spec':{w[0]}}  {'class':{w[1]}}  {'forms':{w[2]}}  states")
    for r in rows:
        print(f"{r[0]:{w[0]}}  {r[1]:{w[1]}}  {r[2]:{w[2]}}  {r[3]}")
    return 0


def _dump(mixer, plan, what: str | None) -> bool:
    if what == "ir":
        print(spec_text(mixer))
        return True
    if what == "plan":
        from .derive.explain import plan_json
        print(plan_json(plan))
        return True
    return False


def cmd_check(args) -> int:
    from .derive.plan import derive
    mixer = _load(args.spec)
    plan = derive(mixer, _flags(args.set))
    if _dump(mixer, plan, args.dump):
        return 0
    print(f"ok: {mixer.name} ({mixer.source.filename}): {plan.transition}; forms: {', '.join(plan.forms)}")
    for note in plan.notes:
        print(f"note: {note}")
    from .derive.lint import lint        # numerical risks, at their line: warnings, not errors
    for warning in (lint(plan) if plan.sequence is None else ()):
        print(warning.render(mixer.source))
    return 0


def cmd_explain(args) -> int:
    from .derive.explain import explain
    from .derive.plan import derive
    mixer = _load(args.spec)
    plan = derive(mixer, _flags(args.set))
    if not _dump(mixer, plan, args.dump):
        print(explain(plan))
    return 0


def cmd_run(args) -> int:
    """Run the op on random inputs, forward and backward, and diff it against the float64
    reference. mode auto: the Triton kernels on CUDA, or on CPU under TRITON_INTERPRET=1;
    the torch backend otherwise."""
    import torch

    from .runtime.inputs import random_args
    from .runtime.op import make_op
    op = make_op(_load(args.spec))
    kw, sizes = random_args(op.ir, B=args.B, T=args.T, H=args.H, seed=args.seed, dtype=torch.float32,
                            sizes={d.name: 16 for d in op.ir.dims if not d.alias_of} | _sizes(args.dim),
                            requires_grad=True)
    flags = _flags(args.set)
    # a sequence mixer's state is a cache of the past (none when it reads the future)
    want_state = not op.is_sequence or op.can_step(**flags)
    t0 = time.perf_counter()
    o, state = op(**kw, **flags, output_final_state=want_state, mode=args.mode)
    # a cache holds the past in its own scale (exponentials carried with their max): not compared
    state = {} if op.is_sequence else state
    (o.float().square().sum() + sum(v.sum() for v in state.values())).backward()
    dt = time.perf_counter() - t0
    grads = {k: (v.grad.clone() if v.grad is not None else None) for k, v in kw.items()}
    for v in kw.values():
        v.grad = None
    ro, rstate = op(**kw, **flags, output_final_state=want_state, mode="reference")
    rstate = {} if op.is_sequence else rstate
    (ro.square().sum() + sum(v.sum() for v in rstate.values())).backward()
    err = ((o.double() - ro).abs().max() / ro.abs().max().clamp_min(1e-12)).item()
    gerr = max(((grads[k].double() - v.grad).abs().max() / v.grad.abs().max().clamp_min(1e-12)).item()
               for k, v in kw.items() if v.grad is not None and grads[k] is not None)
    from .runtime.cache import interpreting
    used = args.mode if args.mode != "auto" else ("kernels (Triton interpreter)" if interpreting() else "torch backend")
    print(f"{op.name}: mode {args.mode} -> {used}; B={args.B} T={args.T} H={args.H} "
          + " ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"  output {op.ir.output.name}: shape {list(o.shape)} {o.dtype}, max relative error vs the float64 "
          f"reference {err:.2e}")
    for k, v in state.items():
        rel = ((v.double() - rstate[k]).abs().max() / rstate[k].abs().max().clamp_min(1e-12)).item()
        print(f"  final state {k}: shape {list(v.shape)}, max relative error {rel:.2e}")
    print(f"  gradients of {', '.join(kw)}: max relative error {gerr:.2e}")
    print(f"  forward + backward {dt * 1e3:.1f} ms")
    return 0


def cmd_compile(args) -> int:
    """Write the generated module (kernels, metadata, the op) to DIR/NAME.py, or print it."""
    from pathlib import Path

    from .codegen.module import generate
    from .derive.plan import derive
    mixer = _load(args.spec)
    plan = derive(mixer, _flags(args.set))
    if _dump(mixer, plan, args.dump if args.dump != "source" else None):
        return 0
    if args.report:
        return _report(args.spec, tuple(args.arch or (90, 80)))
    source = generate(plan)
    if args.dump == "source" or not args.output:
        print(source)
        return 0
    suffix = "".join(f"__{k}_{int(v)}" for k, v in plan.flags if v != mixer.option(k).default)
    path = Path(args.output) / f"{mixer.name}{suffix}.py"
    from .runtime.cache import write_output
    write_output(path, source)          # replaces a symlink at path, never writes through it
    if plan.sequence is not None:
        print(f"wrote {path} ({plan.transition}; no Triton kernel: computed by torch)")
        return 0
    from .codegen.module import metadata
    print(f"wrote {path} ({plan.transition}; kernels: {', '.join(metadata(plan)['kernels'])})")
    return 0


def _report(spec: str, archs=(90, 80)) -> int:
    """Compile every kernel for each arch (no GPU needed) and print registers, spills,
    shared memory and tensor-core use. Runs in a fresh process: compiled (not interpreted)
    kernels need TRITON_INTERPRET unset before Triton is imported."""
    import os
    import subprocess
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.codegen.aot", spec, "--table",
                        *[x for a in archs for x in ("--arch", str(a))]], env=env)
    return p.returncode


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixc", description="Compile sequence-mixer specs to kernels and ops.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="library specs and their class")
    for name, fn, hlp in (("check", cmd_check, "parse, check and derive a spec"),
                          ("explain", cmd_explain, "class, shapes, recurrent and chunked forms, backward")):
        c = sub.add_parser(name, help=hlp)
        c.add_argument("spec", help="a library spec name (see `mixc list`) or a .mix file")
        c.add_argument("--set", action="append", metavar="FLAG=true|false", help="set a flag option")
        c.add_argument("--dump", choices=("ir", "plan"), help="print a pipeline stage instead")
        c.set_defaults(fn=fn)
    c = sub.add_parser("compile", help="generate the module of a spec (Triton kernels, metadata, the op)")
    c.add_argument("spec", help="a library spec name or a .mix file")
    c.add_argument("-o", "--output", metavar="DIR", help="write DIR/NAME.py (default: print the source)")
    c.add_argument("--set", action="append", metavar="FLAG=true|false", help="set a flag option")
    c.add_argument("--dump", choices=("ir", "plan", "source"), help="print a pipeline stage instead")
    c.add_argument("--report", action="store_true",
                   help="compile for sm_90 and sm_80 and print registers, spills, shared memory, tensor cores")
    c.add_argument("--arch", type=int, action="append", metavar="SM",
                   help="with --report: only this arch (90, 80; repeatable)")
    c.set_defaults(fn=cmd_compile)
    r = sub.add_parser("run", help="run a spec on random inputs and diff it against the float64 reference")
    r.add_argument("spec")
    r.add_argument("--B", type=int, default=2)
    r.add_argument("--T", type=int, default=64)
    r.add_argument("--H", type=int, default=4)
    r.add_argument("--dim", action="append", metavar="NAME=SIZE", help="a dim size (default 16)")
    r.add_argument("--set", action="append", metavar="FLAG=true|false")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--mode", default="auto", choices=("auto", "chunk", "recurrent", "conv", "torch", "reference"))
    r.set_defaults(fn=cmd_run)
    b = sub.add_parser("bench", help="CPU benchmarks: the torch backend, the reference and a quadratic form vs T")
    b.add_argument("--T", default="256,1024,4096,16384", help="comma-separated sequence lengths")
    b.add_argument("--H", type=int, default=2)
    b.add_argument("--D", type=int, default=32, help="K = V")
    b.add_argument("--max-reference-T", type=int, default=4096, help="the float64 loop only up to this T")
    b.add_argument("--max-quadratic-T", type=int, default=2048, help="the [T, T, K] form only up to this T")
    b.add_argument("--forward-only", action="store_true")
    b.add_argument("-o", "--out", metavar="DIR", help="write DIR/cpu_bench.json (and cpu_bench.png)")
    b.set_defaults(fn=lambda a: __import__("mixc.bench", fromlist=["main"]).main(a))
    from .recall import add_arguments as recall_arguments     # light: torch loads only when it runs
    rc = sub.add_parser("recall", help="multi-query associative recall (MQAR): train small models per spec on "
                                       "the CPU, table and plot of accuracy vs state size")
    recall_arguments(rc)
    rc.set_defaults(fn=lambda a: __import__("mixc.recall", fromlist=["main"]).main(a))
    sub.choices["list"].set_defaults(fn=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SpecError as err:
        print(str(err), file=sys.stderr)
        return 1
    except ValueError as err:        # bad arguments to an op (ArgumentError)
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

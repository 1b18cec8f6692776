"""mixc command line: list | check | explain | compile | run | bench | recall (and --version).
Spec errors print and exit 1."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import __version__
from .argtypes import DefaultsHelpFormatter, nonnegative_int, positive_float, positive_int, positive_ints
from .dsl import SpecError, library_names

# the stages `--dump` prints (mixc/pipeline.py's DUMPS; named here so that argparse needs no import)
DUMPS = ("parse", "check", "derive", "kir", "render")

# `mixc run`'s default tolerance: float32 against float64 over a few hundred tokens
RUN_TOL = 1e-3


class CommandError(Exception):
    """A command's arguments cannot work (an unknown dim, a run too large for memory): printed
    as `error: ...`, exit 1."""


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


def _pipeline():
    """mixc/pipeline.py, the compiler's stages. Imported when a command runs: it loads sympy,
    torch and Triton, which `mixc --help` and argparse's errors do without."""
    from . import pipeline       # lazy: sympy, jinja2, torch only when a command runs
    return pipeline


def cmd_list(args) -> int:
    pipeline = _pipeline()
    rows = []
    for name in library_names():
        plan = pipeline.compile(name)
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


def _dump(args) -> bool:
    """--dump STAGE: print that stage's result (pipeline.dump) instead of the command's."""
    if not args.dump:
        return False
    print(_pipeline().dump(args.dump, args.spec, _flags(args.set)))
    return True


def cmd_check(args) -> int:
    if _dump(args):
        return 0
    from .derive.lint import lint        # numerical risks, at their line: warnings, not errors
    pipeline = _pipeline()
    mixer = pipeline.spec(args.spec)
    plan = pipeline.derive(mixer, _flags(args.set))
    print(f"ok: {mixer.name} ({mixer.source.filename}): {plan.transition}; forms: {', '.join(plan.forms)}")
    for note in plan.notes:
        print(f"note: {note}")
    for warning in (lint(plan) if plan.sequence is None else ()):
        print(warning.render(mixer.source))
    return 0


def cmd_explain(args) -> int:
    if _dump(args):
        return 0
    from .derive.explain import explain      # lazy: sympy, not for `mixc --help`
    print(explain(_pipeline().compile(args.spec, _flags(args.set))))
    return 0


def _run_sizes(op, given: dict[str, int]) -> dict[str, int]:
    """Dim sizes for `mixc run`: 16 each, --dim NAME=SIZE for the spec's own dims only."""
    roots = [d.name for d in op.ir.dims if not d.alias_of and d.size is None]
    for name, size in given.items():
        if name not in roots:
            dim = next((d for d in op.ir.dims if d.name == name), None)
            fixed = op.ir.fixed_size(name) if dim is not None else None
            why = (f"{name} = {fixed} in this spec" if fixed is not None else
                   f"{name} = {dim.alias_of} in this spec: give --dim {op.ir.root_dim(name)}=SIZE" if dim
                   else f"spec '{op.name}' has dims {', '.join(roots) or 'none'}")
            raise CommandError(f"--dim {name}={size}: {why}")
    fixed = {d.name: d.size for d in op.ir.dims if d.size is not None}
    return {n: 16 for n in roots} | fixed | given


def _memory_needed(op, B: int, T: int, H: int, sizes: dict[str, int]) -> int:
    """Bytes a run needs, roughly: every input and param and its gradient in float32 and in
    float64 for the reference, each state at every step (the reference loop keeps them for its
    backward), and T x T scores for a sequence mixer."""
    def count(shape):
        n = 1
        for d in shape:
            n *= T if d == "T" else sizes[op.ir.root_dim(d)] if d in op.ir.dim_names else 1
        return n
    tensors = sum(B * T * H * count(d.shape) for d in op.ir.inputs) + sum(H * count(d.shape) for d in op.ir.given_params)
    steps = sum(B * H * count(s.shape) for s in op.ir.states) * (T + 1)
    scores = B * H * T * T if op.is_sequence else 0
    return 8 * (4 * tensors + 3 * steps + 3 * scores)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def _rel(a, b) -> float:
    """max |a - b| / max |b| (nan when a is not finite)."""
    import torch        # lazy: torch only when running
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return float("nan")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def cmd_run(args) -> int:
    """Run the op on random inputs, forward and backward, and diff it against the float64
    reference; exit 1 when an error exceeds --tol or a value is not finite. mode auto: the
    Triton kernels on CUDA, or on CPU under TRITON_INTERPRET=1; the torch backend otherwise."""
    import torch                                # lazy: torch and Triton only when running

    from .runtime.inputs import random_args     # lazy: imports torch
    from .runtime.op import make_op             # lazy: imports torch
    op = make_op(_pipeline().spec(args.spec))
    sizes = _run_sizes(op, _sizes(args.dim))
    flags = _flags(args.set)
    op.plan(**flags)                                   # an unknown --set flag: a SpecError before any work
    need, have = _memory_needed(op, args.B, args.T, args.H, sizes), _physical_memory()
    if need > have // 2:
        raise CommandError(f"--B {args.B} --T {args.T} --H {args.H} " + " ".join(f"{k}={v}" for k, v in sizes.items())
                           + f": this run would need about {_bytes(need)} of memory (inputs, gradients and the "
                           f"float64 reference's states at every step), more than half of this machine's "
                           f"{_bytes(have)}; use a smaller --T, --B, --H or --dim")
    # roles that keep every library recurrence bounded at any T (unit keys for the delta rules, ...)
    kw, sizes = random_args(op.ir, B=args.B, T=args.T, H=args.H, seed=args.seed, dtype=torch.float32,
                            sizes=sizes, requires_grad=True, bounded=True)
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
    from .runtime.cache import interpreting     # lazy: imports Triton
    used = args.mode if args.mode != "auto" else ("kernels (Triton interpreter)" if interpreting() else "torch backend")
    print(f"{op.name}: mode {args.mode} -> {used}; B={args.B} T={args.T} H={args.H} "
          + " ".join(f"{k}={v}" for k, v in sizes.items()))
    failed = []

    def report(what: str, err: float, ref) -> str:
        if not bool(torch.isfinite(ref).all()):
            failed.append(f"the float64 reference's {what} is not finite")
        elif err != err:
            failed.append(f"{what} is not finite")
        elif err > args.tol:
            failed.append(f"{what}: relative error {err:.2e} > --tol {args.tol:g}")
        return f"{err:.2e}"

    text = report(f"output {op.ir.output.name}", _rel(o, ro), ro)
    print(f"  output {op.ir.output.name}: shape {list(o.shape)} {o.dtype}, max relative error vs the float64 "
          f"reference {text}")
    for k, v in state.items():
        print(f"  final state {k}: shape {list(v.shape)}, max relative error {report(f'final state {k}', _rel(v, rstate[k]), rstate[k])}")
    gerrs = {k: _rel(grads[k], v.grad) for k, v in kw.items() if v.grad is not None and grads[k] is not None}
    worst = max(gerrs, key=lambda k: gerrs[k] if gerrs[k] == gerrs[k] else float("inf"))
    text = report(f"the gradient of {worst}", gerrs[worst], kw[worst].grad)
    print(f"  gradients of {', '.join(kw)}: max relative error {text} ({worst})")
    print(f"  forward + backward {dt * 1e3:.1f} ms")
    if failed:
        print(f"FAIL: {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"ok: every error within --tol {args.tol:g}")
    return 0


def cmd_compile(args) -> int:
    """Write the generated module (kernels, metadata, the op) to DIR/NAME.py with its runtime
    (DIR/_mixc_standalone: mixc/standalone copied), or print it."""
    from .codegen.module import metadata        # lazy: jinja2 and sympy only when compiling
    from .runtime.cache import write_output, write_runtime     # lazy: imports Triton
    if _dump(args):
        return 0
    pipeline = _pipeline()
    mixer = pipeline.spec(args.spec)
    plan = pipeline.derive(mixer, _flags(args.set))
    if args.report:
        return _report(args.spec, tuple(args.arch or (90, 80)))
    source = pipeline.render(plan)
    if not args.output:
        print(source)
        return 0
    suffix = "".join(f"__{k}_{int(v)}" for k, v in plan.flags if v != mixer.option(k).default)
    path = Path(args.output) / f"{mixer.name}{suffix}.py"
    write_output(path, source)          # replaces a symlink at path, never writes through it
    if plan.sequence is not None:
        print(f"wrote {path} ({plan.transition}; no Triton kernel: computed by torch)")
        return 0
    runtime = write_runtime(path.parent)    # what the module imports without mixc (mixc/standalone, verbatim)
    print(f"wrote {path} ({plan.transition}; kernels: {', '.join(metadata(plan)['kernels'])}) "
          f"and its runtime {runtime}{os.sep}")
    return 0


def _report(spec: str, archs=(90, 80)) -> int:
    """Compile every kernel for each arch (no GPU needed) and print registers, spills,
    shared memory and tensor-core use. Runs in a fresh process: compiled (not interpreted)
    kernels need TRITON_INTERPRET unset before Triton is imported."""
    import subprocess       # lazy: 3 ms that `mixc --help` does without; only for --report
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", spec, "--table",
                        *[x for a in archs for x in ("--arch", str(a))]], env=env)
    return p.returncode


def build_parser() -> argparse.ArgumentParser:
    fmt = DefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="mixc", description="Compile sequence-mixer specs to kernels and ops.",
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"mixc {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, hlp, description=None):
        return sub.add_parser(name, help=hlp, description=description or hlp[:1].upper() + hlp[1:] + ".",
                              formatter_class=fmt)
    command("list", "library specs and their class")
    for name, fn, hlp in (("check", cmd_check, "parse, check and derive a spec"),
                          ("explain", cmd_explain, "class, shapes, recurrent and chunked forms, backward")):
        c = command(name, hlp)
        c.add_argument("spec", help="a library spec name (see `mixc list`) or a .mix file")
        c.add_argument("--set", action="append", metavar="FLAG=true|false", help="set a flag option (repeatable)")
        c.add_argument("--dump", choices=DUMPS[:3] + ("ir", "plan"), metavar="STAGE",
                       help=f"print a stage's result instead (mixc/pipeline.py): {', '.join(DUMPS[:3])}; "
                            "ir and plan name check and derive")
        c.set_defaults(fn=fn)
    c = command("compile", "generate the module of a spec (Triton kernels, metadata, the op)")
    c.add_argument("spec", help="a library spec name or a .mix file")
    c.add_argument("-o", "--output", metavar="DIR", help="write DIR/NAME.py (default: print the source)")
    c.add_argument("--set", action="append", metavar="FLAG=true|false", help="set a flag option (repeatable)")
    c.add_argument("--dump", choices=DUMPS + ("ir", "plan", "source"), metavar="STAGE",
                   help=f"print a stage's result instead (mixc/pipeline.py): {', '.join(DUMPS)}; "
                        "ir, plan and source name check, derive and render")
    c.add_argument("--report", action="store_true",
                   help="compile for sm_90 and sm_80 and print registers, spills, shared memory, tensor cores")
    c.add_argument("--arch", type=int, action="append", metavar="SM",
                   help="with --report: only this arch (90, 80; repeatable)")
    c.set_defaults(fn=cmd_compile)
    r = command("run", "run a spec on random inputs and diff it against the float64 reference",
                "Run a spec's op on random inputs, forward and backward, and diff it against the float64 "
                "reference; exit 1 when an error exceeds --tol.")
    r.add_argument("spec", help="a library spec name or a .mix file")
    r.add_argument("--B", type=positive_int, default=2, help="batch size")
    r.add_argument("--T", type=positive_int, default=64, help="sequence length")
    r.add_argument("--H", type=positive_int, default=4, help="heads")
    r.add_argument("--dim", action="append", metavar="NAME=SIZE", help="a dim's size (repeatable; default 16 each)")
    r.add_argument("--set", action="append", metavar="FLAG=true|false", help="set a flag option (repeatable)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    r.add_argument("--mode", default="auto", choices=("auto", "chunk", "recurrent", "conv", "torch", "reference"),
                   help="the op's mode (auto: the Triton kernels on CUDA or under TRITON_INTERPRET=1, "
                        "the torch backend otherwise)")
    r.add_argument("--tol", type=positive_float, default=RUN_TOL,
                   help="largest relative error (max |x - ref| / max |ref|) that passes")
    r.set_defaults(fn=cmd_run)
    b = command("bench", "CPU benchmarks: the torch backend, the reference and a quadratic form vs T; "
                         "mixc against fla's naive chunked forms where fla is importable",
                "CPU benchmarks of gla at growing T: the torch backend (chunked), the float64 reference "
                "and a quadratic masked form, time and peak memory; then, where fla is importable, mixc's "
                "torch backend against fla's naive chunked references (bench/README.md explains the columns).")
    b.add_argument("--T", type=positive_ints, default=(256, 1024, 4096, 16384), help="comma-separated sequence lengths")
    b.add_argument("--H", type=positive_int, default=2, help="heads")
    b.add_argument("--D", type=positive_int, default=32, help="head size: K = V")
    b.add_argument("--max-reference-T", type=nonnegative_int, default=4096, help="the float64 loop only up to this T")
    b.add_argument("--max-quadratic-T", type=nonnegative_int, default=2048, help="the [T, T, K] form only up to this T")
    b.add_argument("--forward-only", action="store_true", help="time the forward pass only (default: forward, "
                                                               "and forward + backward)")
    b.add_argument("--no-fla", action="store_true",
                   help="skip the side-by-side with fla's naive chunked references (run where fla is importable)")
    b.add_argument("-o", "--out", metavar="DIR", help="write DIR/cpu_bench.json, cpu_bench_fla.json and "
                                                      "cpu_bench.png (with matplotlib)")
    b.set_defaults(fn=lambda a: __import__("mixc.bench", fromlist=["main"]).main(a))
    from .recall import add_arguments as recall_arguments     # light: torch loads only when it runs
    rc = command("recall", "multi-query associative recall (MQAR): train small models per spec on "
                           "the CPU, table and plot of accuracy vs state size")
    recall_arguments(rc)
    rc.set_defaults(fn=lambda a: __import__("mixc.recall", fromlist=["main"]).main(a))
    sub.choices["list"].set_defaults(fn=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    """Errors a user can cause print one line and exit 1 (argparse's usage errors: 2); a closed
    pipe exits quietly (141, as a process killed by SIGPIPE); Ctrl-C exits 130 with one line."""
    try:
        args = build_parser().parse_args(argv)
        code = args.fn(args)
        sys.stdout.flush()          # a full disk or a closed pipe shows here, not at interpreter exit
        return code
    except SpecError as err:
        print(str(err), file=sys.stderr)
        return 1
    except (CommandError, ValueError) as err:        # bad arguments to an op (ArgumentError)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mixc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                          # `mixc list | head -1`
        _quiet_stdout()
        return 141
    except OSError as err:                           # a file or folder that cannot be read or written
        try:
            sys.stdout.flush()
        except OSError:                              # stdout itself (/dev/full)
            _quiet_stdout()
        print(f"error: {_os_error(err)}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        from .runtime.launch import KernelUnavailable     # lazy: torch, Triton; only on an error
        if isinstance(err, KernelUnavailable):       # e.g. --mode chunk on the CPU without the interpreter
            print(f"error: {err}", file=sys.stderr)
            return 1
        raise


def _os_error(err: OSError) -> str:
    if isinstance(err, FileExistsError) and err.filename:    # mkdir(exist_ok=True) onto a file
        return f"{err.filename}: exists and is not a folder"
    where = f": {err.filename}" if err.filename else ""
    if err.filename2:
        where += f" -> {err.filename2}"
    return f"{err.strerror or err}{where}"


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush of what could not be
    written (a closed pipe, a full disk) raises nothing more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):     # stdout replaced (pytest's capture): nothing to do
        pass


if __name__ == "__main__":
    sys.exit(main())

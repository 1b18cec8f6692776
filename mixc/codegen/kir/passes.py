"""Rewrites of a kernel IR as named passes, the verifier after each (verify.py), and the
record `--dump kir` prints: the kernel after every pass (mixc/pipeline.py)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

from . import nodes as n
from .verify import verify


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[n.Kernel], n.Kernel]
    doc: str


def _reads(stmts, counts: Counter) -> Counter:
    for s in stmts:
        for e in n.stmt_exprs(s):
            counts.update(n.expr_uses(e))
        if isinstance(s, n.For):
            _reads(s.body, counts)
        elif isinstance(s, n.If):
            _reads(s.body, counts)
            _reads(s.orelse, counts)
    return counts


def _drop(stmts, dead: set[str]) -> tuple[n.Stmt, ...]:
    out = []
    for s in stmts:
        if isinstance(s, n.Let) and s.name in dead:
            continue
        if isinstance(s, n.For):
            s = replace(s, body=_drop(s.body, dead))
        elif isinstance(s, n.If):
            s = replace(s, body=_drop(s.body, dead), orelse=_drop(s.orelse, dead))
            if not _effects(s.body) and not _effects(s.orelse):
                continue            # both branches emptied: the If has nothing left to do
        out.append(s)
    return tuple(out)


def _effects(stmts) -> bool:
    return any(not isinstance(s, n.Comment) for s in stmts)


def _defined(stmts, names: set[str]) -> set[str]:
    for s in stmts:
        if isinstance(s, n.Let):
            names.add(s.name)
        elif isinstance(s, n.For):
            _defined(s.body, names)
        elif isinstance(s, n.If):
            _defined(s.body, names)
            _defined(s.orelse, names)
    return names


def dead_lets(kernel: n.Kernel) -> n.Kernel:
    """Drop every Let of a name nothing reads (the adjoint computes every leaf's gradient; a
    spec's option or an output's unused branch needs none), until none is left. Lets have no
    effects: loads only read."""
    body = kernel.body
    while True:
        dead = _defined(body, set()) - set(_reads(body, Counter()))
        if not dead:
            return replace(kernel, body=body)
        body = _drop(body, dead)


DEAD_LETS = Pass("dead_lets", dead_lets, "drop Lets whose names nothing reads")


def count(kernel: n.Kernel) -> int:
    """The statements of a kernel, those inside loops and branches too."""
    def c(stmts):
        return sum(1 + (c(s.body) if isinstance(s, n.For) else c(s.body) + c(s.orelse) if isinstance(s, n.If) else 0)
                   for s in stmts if not isinstance(s, n.Comment))
    return c(kernel.body)


def summary(before: n.Kernel, after: n.Kernel) -> str:
    """What a pass changed, in a line: statements before and after, the names it dropped."""
    gone = sorted(_defined(before.body, set()) - _defined(after.body, set()))
    shown = ", ".join(gone[:12]) + (f" and {len(gone) - 12} more" if len(gone) > 12 else "")
    return f"{count(before)} -> {count(after)} statements" + (f"; dropped {shown}" if gone else "")


def run(kernel: n.Kernel, passes: tuple[Pass, ...], record: list | None = None) -> n.Kernel:
    """The kernel after each pass in turn, verified before the first and after each; `record`
    collects (pass name, kernel) for --dump kir ('build' the kernel as built)."""
    verify(kernel)
    if record is not None:
        record.append(("build", kernel))
    for p in passes:
        kernel = verify(p.run(kernel))
        if record is not None:
            record.append((p.name, kernel))
    return kernel

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
    for s in n.walk_stmts(stmts):
        for e in n.stmt_exprs(s):
            counts.update(n.expr_uses(e))
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
    names.update(s.name for s in n.walk_stmts(stmts) if isinstance(s, n.Let))
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


def _depths(stmts, depth: int = 0, out: dict | None = None) -> dict[str, int]:
    """name -> how many loops its shallowest Let is in."""
    out = {} if out is None else out
    for s in stmts:
        if isinstance(s, n.Let):
            out[s.name] = min(out.get(s.name, depth), depth)
        elif isinstance(s, n.For):
            _depths(s.body, depth + 1, out)
        elif isinstance(s, n.If):
            _depths(s.body, depth, out)
            _depths(s.orelse, depth, out)
    return out


def _names(names: list[str]) -> str:
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")


def summary(before: n.Kernel, after: n.Kernel) -> str:
    """What a pass changed, in a line: statements before and after, the names it dropped, the
    names it moved out of loops."""
    was, now = _depths(before.body), _depths(after.body)
    gone = sorted(set(was) - set(now))
    out = sorted(x for x in now if x in was and now[x] < was[x])
    return (f"{count(before)} -> {count(after)} statements" + (f"; dropped {_names(gone)}" if gone else "")
            + (f"; moved out of loops {_names(out)}" if out else ""))


def run(kernel: n.Kernel, passes: tuple[Pass, ...], record: list | None = None) -> n.Kernel:
    """The kernel after each pass in turn, verified before the first and after each; `record`
    collects (pass name, kernel) for --dump kir ('build' the kernel as built)."""
    verify(kernel)
    if record is not None:
        record.append(("build", kernel))
    if passes and any(isinstance(s, n.Text) for s in n.walk_stmts(kernel.body)):
        # what Text reads and defines is unknown here: a pass could drop or move what it needs
        raise ValueError(f"{kernel.name} holds text made outside the IR: it takes no passes")
    for p in passes:
        kernel = verify(p.run(kernel))
        if record is not None:
            record.append((p.name, kernel))
    return kernel


def _assigned(stmts, names: set[str]) -> set[str]:
    """Every name a block assigns: its Lets and loop variables, nested ones too."""
    for s in stmts:
        if isinstance(s, n.Let):
            names.add(s.name)
        elif isinstance(s, n.For):
            names.add(s.var)
            _assigned(s.body, names)
        elif isinstance(s, n.If):
            _assigned(s.body, names)
            _assigned(s.orelse, names)
    return names


def _defs(stmts, name: str) -> int:
    return sum(1 if isinstance(s, n.Let) and s.name == name else
               _defs(s.body, name) if isinstance(s, n.For) else
               _defs(s.body, name) + _defs(s.orelse, name) if isinstance(s, n.If) else 0 for s in stmts)


HOISTED = n.Comment("the same in every iteration of the loop below (hoist_invariants)")


def _hoist(stmts, visible: set[str]) -> tuple[n.Stmt, ...]:
    out, vis = [], set(visible)
    for s in stmts:
        if isinstance(s, n.For):
            body = _hoist(s.body, vis | {s.var})          # inner loops first: what they hoist may go on
            varies = _assigned(body, {s.var})
            moved, kept, invariant = [], [], set()
            for b in body:
                uses = n.expr_uses(b.value) if isinstance(b, n.Let) else ()
                if (isinstance(b, n.Let) and b.name not in vis and _defs(body, b.name) == 1
                        and not any(isinstance(x, n.Load) for x in n.walk(b.value))
                        and all(u in invariant or (u in vis and u not in varies) for u in uses)):
                    moved.append(b)
                    invariant.add(b.name)
                else:
                    kept.append(b)
            if moved:
                out.append(HOISTED)
            out += moved
            vis |= invariant
            s = replace(s, body=_tidy(kept))
        elif isinstance(s, n.If):
            s = replace(s, body=_hoist(s.body, vis), orelse=_hoist(s.orelse, vis))
        out.append(s)
        if isinstance(s, n.Let):
            vis.add(s.name)
    return _tidy(out)


def _tidy(stmts) -> tuple[n.Stmt, ...]:
    """Without the hoisting notes whose Lets all moved on (out of an enclosing loop)."""
    return tuple(x for i, x in enumerate(stmts)
                 if x != HOISTED or (i + 1 < len(stmts) and isinstance(stmts[i + 1], n.Let)))


def hoist_invariants(kernel: n.Kernel) -> n.Kernel:
    """Move a Let out of a loop whose every iteration computes the same value: it reads only
    names defined before the loop that the loop does not assign (or Lets moved before it), is the
    loop's only Let of its name, and loads nothing (a load could read what the loop stores).
    Inner loops first, so a per-head value leaves every loop it is in. Values are unchanged:
    the same operations on the same operands, once instead of once per token."""
    return replace(kernel, body=_hoist(kernel.body, set(kernel.arg_names)))


HOIST_INVARIANTS = Pass("hoist_invariants", hoist_invariants, "compute loop-invariant Lets once, before the loop")

"""The statements of a rendered kernel as codegen/block_split.py reads them: each statement's
source, the names it writes and reads (its data flow), whether it stores; and the folding of
`if` tests on constexprs (CKPT_EVERY, STAGED_INTRA ...) to the branch a launch takes, evaluated node by
node: nothing of the kernel's text is run."""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field

from .block_shapes import call_name


class NoSplit(Exception):
    """The loop is kept as rendered (the split does not apply); the message says why."""


@dataclass
class Stmt:
    src: str                                   # the statement's source, dedented
    comments: list[str] = field(default_factory=list)
    node: ast.stmt | None = None
    defs: set[str] = field(default_factory=set)      # names written
    uses: set[str] = field(default_factory=set)      # names read before this statement writes them
    effect: bool = False                             # stores
    kind: str = ""                                   # F, T, LP, DUAL, ACC, EFF (classify)
    place: set[str] = field(default_factory=set)     # pre, loop, post
    post_src: str = ""                               # the form after the loop (DUAL)
    sums: list[tuple[str, str, tuple]] = field(default_factory=list)   # (accumulator, expr, shape)


def _parse(src: str) -> Stmt:
    node = ast.parse(src).body[0]
    s = Stmt(src=src, node=node)
    s.uses = _flow([node], set())[0]
    s.defs = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(node, ast.For):
        s.defs.discard(node.target.id)
    s.effect = any(isinstance(n, ast.Call) and call_name(n.func) in ("tl.store", "tl.atomic_add", "tl.debug_barrier")
                   for n in ast.walk(node))
    return s


def _block(text: str) -> list[Stmt]:
    """The top-level statements of a block of code, each with the comment lines before it."""
    text = textwrap.dedent(text)
    lines = text.split("\n")
    out, pending, end = [], [], 0
    for node in ast.parse(text).body:
        pending += [ln.strip() for ln in lines[end:node.lineno - 1] if ln.strip().startswith("#")]
        s = _parse(textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])))
        s.comments, pending, end = pending, [], node.end_lineno
        out.append(s)
    return out


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _flow(stmts, written: set[str]) -> tuple[set[str], set[str]]:
    """Names read before being written (upward-exposed) and names written, in program order."""
    exposed, written = set(), set(written)
    for s in stmts:
        if isinstance(s, ast.Assign):
            exposed |= _names(s.value) - written
            written |= {n.id for t in s.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(s, ast.AugAssign):
            exposed |= (_names(s.value) | {s.target.id}) - written
            written.add(s.target.id)
        elif isinstance(s, ast.Expr):
            exposed |= _names(s.value) - written
        elif isinstance(s, ast.For):
            exposed |= _names(s.iter) - written
            e, w = _flow(s.body, written | {s.target.id})
            exposed |= e
            written |= w - {s.target.id}
        elif isinstance(s, ast.If):
            exposed |= _names(s.test) - written
            e1, w1 = _flow(s.body, written)
            e2, w2 = _flow(s.orelse, written)
            exposed |= e1 | e2
            written |= w1 & w2
        elif isinstance(s, ast.Pass):
            pass
        else:
            raise NoSplit(f"a statement this pass does not read: {ast.unparse(s)[:60]}")
    return exposed, written


_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}


def _constexpr_test(test, env: dict[str, int]):
    """The value of an if's test that reads only the constexprs of env (CKPT_EVERY, STAGED_INTRA ...)
    and integers (comparisons, and, or, not), else None; `and` / `or` decided by one known
    operand are decided (CKPT_EVERY > 1 and X is false at CKPT_EVERY 1 whatever X is). Evaluated here
    node by node: nothing of the kernel's text is run."""
    def value(e):
        if isinstance(e, ast.Name) and e.id in env:
            return env[e.id]
        if isinstance(e, ast.Constant) and type(e.value) is int:
            return e.value
        if isinstance(e, ast.Compare) and all(type(o) in _COMPARE for o in e.ops):
            left, ok = value(e.left), True
            for op, right in zip(e.ops, e.comparators):
                r = value(right)
                ok, left = ok and _COMPARE[type(op)](left, r), r
            return ok
        if isinstance(e, ast.BoolOp):
            known, unknown = [], False
            for v in e.values:
                try:
                    known.append(bool(value(v)))
                except LookupError:
                    unknown = True
            if isinstance(e.op, ast.And):
                if False in known:
                    return False
            elif True in known:
                return True
            if unknown:
                raise LookupError
            return all(known) if isinstance(e.op, ast.And) else any(known)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return not value(e.operand)
        raise LookupError
    if not (_names(test) & set(env)):
        return None
    try:
        return bool(value(test))
    except LookupError:
        return None


def _fold(stmts: list[Stmt], env) -> list[Stmt]:
    """`if CKPT_EVERY ...:` blocks (tests of env's constexprs) replaced by the branch taken."""
    out = []
    for s in stmts:
        taken = _constexpr_test(s.node.test, env) if isinstance(s.node, ast.If) else None
        if taken is None:
            out.append(s)
            continue
        branch = s.node.body if taken else s.node.orelse
        if branch:
            lines = s.src.split("\n")
            part = lines[branch[0].lineno - 1:branch[-1].end_lineno]
            if branch is s.node.orelse and part[0].lstrip().startswith("elif "):
                part[0] = part[0].replace("elif ", "if ", 1)        # an elif: the else's one if
            inner = _block("\n".join(part))
            if inner:
                inner[0].comments = s.comments + inner[0].comments
            out += _fold(inner, env)
    return out

"""The chunked backward's PHASE 2, split around its tile loop as fla's dq/dk kernels are.

PHASE 2 writes one chunk's gradients, looping over the blocks of the tile dim (V: a [K, V]
state block is what fits in registers). As rendered, the loop body is the walk's: every
statement runs once per block, so the loads of q, k and g, the cumulative decays, the
intra-chunk matrices and the adjoints that lack the tile dim are recomputed per block, their
partials summed (and the registers of both kinds live at once: the spills of issue 16). This
pass rewrites the rendered PHASE 2 into

    what no block changes                   once, before the loop
    for each block:
        what carries the block               dv's rows, the block's S0 and dL/dS
        the block's contractions, summed     dO V^T, dO S0^T, V dh^T, sum(S0 * dh) ...
    the rest, from the sums                  dq, dk, dg, once, after the loop

It is code motion over the statements of one iteration, read off their data flow and shapes:
it knows no class, so every class's adjoint macros and the spec's own adjoint split alike.

Why the sums are exact: the backward is linear in its cotangents (dO and dL/dS). A statement
that lacks the tile dim but reads the block's values contracts over the block (a dot or a sum
over the tile axis): summed over the blocks it is the contraction over the whole dim. Every
later statement of the cotangents is linear in those contractions (reverse-mode code only
scales and adds cotangents), so it may take their sums instead of adding its own per block. A
statement is "dual" when both forms are needed: its per-block value for what stays in the loop
(the original code), its summed value after the loop. A reduction over the block of forward
values only (a max, as in a row's non-finite test) is no such sum: it and what reads it stay
per block, added to their sums in the loop as rendered. Where the statements after the loop
would need a per-block value, or a statement has no shape rule (block_shapes.py), PHASE 2
keeps its rendered loop (NoSplit, the reason in a comment of the kernel).
"""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache

from .block_shapes import Shapes, UnknownShape, call_name, rename

PHASE = 2                          # the launch whose tile loop is split
INDENT = "    "


class NoSplit(Exception):
    """This kernel's PHASE 2 keeps its rendered loop; the message says why."""


# ---- statements -------------------------------------------------------------------------

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


def _phase_test(test, phase: int):
    """The value of an if's test that reads only PHASE and integers (comparisons, and, or,
    not), else None. Evaluated here node by node: nothing of the kernel's text is run."""
    def value(e):
        if isinstance(e, ast.Name) and e.id == "PHASE":
            return phase
        if isinstance(e, ast.Constant) and type(e.value) is int:
            return e.value
        if isinstance(e, ast.Compare) and all(type(o) in _COMPARE for o in e.ops):
            left, ok = value(e.left), True
            for op, right in zip(e.ops, e.comparators):
                r = value(right)
                ok, left = ok and _COMPARE[type(op)](left, r), r
            return ok
        if isinstance(e, ast.BoolOp):
            vals = [value(v) for v in e.values]
            return all(vals) if isinstance(e.op, ast.And) else any(vals)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return not value(e.operand)
        raise LookupError
    if "PHASE" not in _names(test):
        return None
    try:
        return bool(value(test))
    except LookupError:
        return None


def _fold(stmts: list[Stmt], phase: int) -> list[Stmt]:
    """`if PHASE ...:` blocks replaced by the branch that PHASE takes."""
    out = []
    for s in stmts:
        taken = _phase_test(s.node.test, phase) if isinstance(s.node, ast.If) else None
        if taken is None:
            out.append(s)
            continue
        branch = s.node.body if taken else s.node.orelse
        if branch:
            lines = s.src.split("\n")
            inner = _block("\n".join(lines[branch[0].lineno - 1:branch[-1].end_lineno]))
            if inner:
                inner[0].comments = s.comments + inner[0].comments
            out += _fold(inner, phase)
    return out


def _ssa(stmts: list[Stmt], outer: set[str]) -> list[Stmt]:
    """Each name written once: a later assignment to a name gets a fresh name (and the reads
    after it follow). A statement that reads and writes a name (a loop's `+=`) updates the
    current one; `x = x + ...` where x comes from outside the loop body (`dp_x = dp_x + ...`)
    or from tl.zeros (`_sum_dq`) is an accumulator (ACC) and keeps it."""
    current: dict[str, str] = {}
    accumulators: set[str] = set()
    zeros: set[str] = set()               # names assigned tl.zeros(...)
    taken = set(outer)
    for s in stmts:
        taken |= s.defs | s.uses
    out = []

    def fresh(x):
        i = 2
        while f"{x}__{i}" in taken:
            i += 1
        taken.add(f"{x}__{i}")
        return f"{x}__{i}"

    for s in stmts:
        mapping = {u: current[u] for u in s.uses if current.get(u, u) != u}
        node = s.node
        acc = False
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            x = node.targets[0].id
            if node.lineno != node.end_lineno:
                raise NoSplit(f"an assignment over lines: {x}")
            rhs = s.src[s.src.index("=") + 1:].lstrip()
            cur = current.get(x)
            if x in s.uses and (cur is None or cur in accumulators or cur in zeros):
                acc = True                # adds to a sum begun before the loop body or with zeros
                new = cur or x
                accumulators.add(new)
            elif x in current:
                new = fresh(x)
            else:
                new = x
            current[x] = new
            src = f"{new} = {rename(rhs, mapping)}"
            if isinstance(node.value, ast.Call) and call_name(node.value.func) == "tl.zeros":
                zeros.add(new)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id not in current:
            raise NoSplit(f"an augmented assignment to a name from outside: {node.target.id}")
        else:
            for x in s.defs:
                if x in s.uses:
                    continue                          # updated in place: the current name
                if x in current:
                    mapping[x] = current[x] = fresh(x)
                else:
                    current[x] = x
            src = rename(s.src, mapping)
        t = _parse(src)
        t.comments = s.comments
        if acc:
            t.kind = "ACC"
        out.append(t)
    return out


# ---- the split --------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    before: tuple[str, ...]          # statements, dedented; comments as lines
    loop: tuple[str, ...]
    after: tuple[str, ...]


def split_iteration(body: list[Stmt], *, tile: str, shapes: Shapes, outer: set[str],
                    cotangents: set[str]) -> Split:
    """Split one iteration of the tile loop (`body`, PHASE already folded; `_tv` the block)
    followed by what runs after the loop. Raises NoSplit."""
    stmts = _ssa(body, outer)
    shapes.run([s.node for s in stmts])
    tile_dim = re.compile(rf"\b_BLOCK_{re.escape(tile)}\b")

    def has_tile(sh) -> bool:
        return any(tile_dim.search(d) for d in sh)

    kind: dict[str, str] = {"_tv": "T"}
    cot: set[str] = set()
    for s in stmts:
        ks = {kind.get(u, "F") for u in s.uses}
        looped = bool(ks & {"T", "LP"})
        dep = bool(ks - {"F"})
        s_cot = bool(s.uses & cot) or bool(s.defs & cotangents)
        if s.kind == "ACC":
            s.place = {"loop"} if looped or not dep else {"post"}
        elif s.effect:
            s.kind = "EFF"
            s.place = {"loop"} if looped else {"post"}
        elif not dep:
            s.kind, s.place = "F", {"pre"}
        else:
            def_shapes = [shapes.env.get(d) for d in s.defs]
            if any(sh is None for sh in def_shapes):
                why = "; ".join(shapes.why[d] for d in sorted(s.defs) if d in shapes.why)
                raise NoSplit(f"the shape of {', '.join(sorted(s.defs))} is not known" + (f": {why}" if why else ""))
            tiled = any(has_tile(sh) for sh in def_shapes)
            if tiled:
                s.kind, s.place = "T", {"loop"}
            elif looped:
                s.kind, s.place = "LP", {"loop"}
                if s_cot and isinstance(s.node, ast.Assign):
                    extracted = _extract(s, shapes, has_tile, kind, cot)
                    if extracted is not None:
                        s.post_src, s.sums = extracted
                        s.kind, s.place = "DUAL", {"loop", "post"}
            else:
                s.kind, s.place, s.post_src = "DUAL", {"loop", "post"}, s.src
        for d in s.defs:
            kind[d] = s.kind if s.kind in ("F", "T", "LP", "DUAL", "ACC") else "F"
            if s_cot:
                cot.add(d)

    # a statement that updates a name in place (a loop's +=) runs wherever it runs after
    # the name's own first assignment: that assignment joins its places
    writer: dict[str, Stmt] = {}
    for s in stmts:
        for x in s.defs & s.uses:
            if x in writer and s.kind != "ACC":
                _join(writer[x], s.place, writer)
        for d in s.defs:
            writer.setdefault(d, s)

    # what runs after the loop may read only what the loop leaves whole
    for s in stmts:
        if "post" not in s.place:
            continue
        src = s.post_src or s.src
        bad = {u for u in _parse(src).uses if kind.get(u) in ("T", "LP")}
        if bad:
            raise NoSplit(f"{', '.join(sorted(bad))} (per block, not a sum over blocks) needed after the loop by "
                          f"{src.splitlines()[0][:70]}")

    items = []                       # (region, index in the body, Stmt)
    for i, s in enumerate(stmts):
        if "pre" in s.place:
            items.append(("pre", i, s))
    for i, s in enumerate(stmts):
        for acc, _, sh in s.sums:
            zeros = f"tl.zeros([{', '.join(sh)}], dtype=tl.float32)" if sh else \
                "tl.sum(tl.zeros([1], dtype=tl.float32), axis=0)"
            items.append(("pre", len(stmts), _parse(f"{acc} = {zeros}")))
    for i, s in enumerate(stmts):
        if "loop" in s.place:
            items.append(("loop", i, s))
        for acc, expr, _ in s.sums:
            items.append(("loop", i, _parse(f"{acc} += {expr}")))
    for i, s in enumerate(stmts):
        if "post" in s.place:
            post = _parse(s.post_src) if s.post_src else s
            post.comments, post.kind = s.comments, s.kind
            items.append(("post", i, post))
    items = _schedule(_sink(_live(_rematerialize(_live(items)))))
    text = {r: tuple(line for reg, _, s in items if reg == r for line in s.comments + [s.src])
            for r in ("pre", "loop", "post")}
    return Split(before=text["pre"], loop=text["loop"], after=text["post"])


def _rematerialize(items):
    """What the statements after the loop read from before it is computed again after it
    (down to the loads: an L2 read), so that nothing but the loop's own inputs and sums holds
    registers through the loop. fla's dq/dk kernel loads q and k after its loop likewise."""
    items = list(items)
    defined_in_loop = {d for reg, _, s in items if reg == "loop" for d in s.defs}
    pre = [(idx, s) for reg, idx, s in items if reg == "pre"]
    # a loop statement's results stay live instead: computing them again costs a loop, not a
    # load (no library spec's statements after the loop read one: the key-diagonal's
    # sub-chunk A feeds only dv, in the loop)
    kept = {d for _, s in pre if isinstance(s.node, ast.For) for d in s.defs}
    need = {u for reg, _, s in items if reg == "post" for u in s.uses}
    copied = set()
    while True:
        new = [(idx, s) for idx, s in pre if id(s) not in copied and s.defs & need
               and not (s.defs & (defined_in_loop | kept)) and s.kind in ("F", "") and not s.effect]
        if not new:
            break
        for idx, s in new:
            copied.add(id(s))
            items.append(("post", idx, s))
            need |= s.uses
    order = {"pre": 0, "loop": 1, "post": 2}
    return sorted(items, key=lambda it: (order[it[0]], it[1]))


def _schedule(items):
    """The loop's statements in the order its sinks (stores, the sums' updates) demand them,
    each as late as it can be: a value is made just before its first reader (dv's products
    after the contractions, not held through them)."""
    loop = [(idx, s) for reg, idx, s in items if reg == "loop"]
    defs = {}
    for k, (idx, s) in enumerate(loop):
        for d in s.defs:
            defs.setdefault(d, []).append(k)
    done, out = set(), []

    def emit(k):
        if k in done:
            return
        done.add(k)
        for u in sorted(loop[k][1].uses):
            for j in defs.get(u, []):
                if j < k:
                    emit(j)
        out.append(loop[k])
    for k, (idx, s) in enumerate(loop):
        if s.effect or s.kind == "ACC" or isinstance(s.node, ast.AugAssign):
            emit(k)
    for k in range(len(loop)):
        emit(k)
    return [it for it in items if it[0] == "pre"] + [("loop", idx, s) for idx, s in out] + \
        [it for it in items if it[0] == "post"]


def _sink(items):
    """What runs before the loop and is read only after it moves after it (a value live
    across the loop holds registers through it: the gradient sums' zeros, the decays only dq
    reads)."""
    items = list(items)
    for i in range(len(items) - 1, -1, -1):
        reg, idx, s = items[i]
        if reg != "pre" or s.effect or s.kind == "ACC" or sum(t is s for _, _, t in items) > 1:
            continue
        users = [r for r, _, t in items if t is not s and t.uses & s.defs]
        if users and all(r == "post" for r in users):
            items[i] = ("post", idx, s)
    order = {"pre": 0, "loop": 1, "post": 2}
    return sorted(items, key=lambda it: (order[it[0]], it[1]))


def _join(s: Stmt, place: set[str], writer: dict) -> None:
    new = place - s.place
    if not new:
        return
    if s.kind in ("T", "LP") and "post" in new:
        raise NoSplit(f"{sorted(s.defs)} is updated after the loop but computed per block")
    s.place |= new
    for x in s.defs & s.uses:
        if x in writer and writer[x] is not s:
            _join(writer[x], place, writer)


def _extract(s: Stmt, shapes: Shapes, has_tile, kind: dict, cot: set):
    """The after-the-loop form of an assignment that lacks the tile dim and reads the block:
    each maximal sub-expression that contracts the tile axis (a dot over it, a sum over it)
    and carries a cotangent becomes an accumulator. None if block values remain outside
    them (a max over the block, a forward value)."""
    node = s.node
    target = node.targets[0].id
    found = []

    def loop_names(e) -> set[str]:
        return {n for n in _names(e) if kind.get(n) in ("T", "LP") or n == "_tv"}

    def contracts(e) -> bool:
        if not isinstance(e, ast.Call):
            return False
        f = call_name(e.func)
        if f == "tl.sum":
            inner = shapes.of(e.args[0])
            axis = {k.arg: k.value for k in e.keywords}.get("axis", e.args[1] if len(e.args) > 1 else None)
            if axis is None:
                return has_tile(inner)
            k = ast.literal_eval(axis)
            return bool(tile_in(inner[k]))
        if f in ("_mixc_dot", "tl.dot"):
            return bool(tile_in(shapes.of(e.args[0])[-1]))
        return False

    def tile_in(d: str) -> bool:
        return has_tile((d,))

    def visit(e):
        if not loop_names(e):
            return
        if isinstance(e, ast.expr) and contracts(e) and not has_tile(shapes.of(e)) and (_names(e) & cot):
            found.append(e)
            return
        for child in ast.iter_child_nodes(e):
            visit(child)

    visit(node.value)
    if not found:
        return None
    src = s.src
    inside = set()
    for e in found:
        inside |= {id(n) for n in ast.walk(e)}
    rest = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and id(n) not in inside}
    if {n for n in rest if kind.get(n) in ("T", "LP") or n == "_tv"}:
        return None
    sums, post = [], src
    for i, e in enumerate(sorted(found, key=lambda e: e.col_offset, reverse=True)):
        acc = f"{target}_sum{len(found) - 1 - i or ''}"
        if e.lineno != 1 or e.end_lineno != 1:
            raise NoSplit(f"a contraction over lines in {target}")
        sums.append((acc, src[e.col_offset:e.end_col_offset], shapes.of(e)))
        post = post[:e.col_offset] + acc + post[e.end_col_offset:]
    return post, sums[::-1]


def _live(items):
    """Drop what nothing after it reads (the per-block copies no loop statement needs, the
    forward's readouts no adjoint reads); stores and accumulators stay. One backward pass over
    before + loop + after: after the SSA only in-place updates carry a name across blocks, and
    they read what they write."""
    live: set[str] = set()
    keep = []
    for reg, idx, s in reversed(items):
        if not (s.effect or s.kind == "ACC" or s.defs & live):
            continue
        keep.append((reg, idx, s))
        live -= s.defs - s.uses
        live |= s.uses
    return keep[::-1]


# ---- the kernel -------------------------------------------------------------------------

def split_phase2(source: str, kernel: str, tile: str | None, cotangents: set[str],
                 aliases: dict[str, str] | None = None) -> str:
    """The kernel `kernel` in `source` with PHASE 2's tile loop split (the rendered loop kept
    for PHASE 0 and 1); where the split does not apply, the source with a comment why.
    aliases: dim -> the dim it aliases (same block)."""
    if tile is None:
        return source
    return _split_phase2(source, kernel, tile, frozenset(cotangents), tuple(sorted((aliases or {}).items())))


@lru_cache(maxsize=256)         # a process generates a spec's module again per cache folder (tests)
def _split_phase2(source: str, kernel: str, tile: str, cotangents: frozenset, alias_items: tuple) -> str:
    aliases = dict(alias_items)
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == kernel)
    lines = source.split("\n")
    shapes = Shapes({a.arg: () for a in fn.args.args}, aliases)
    tile = (aliases or {}).get(tile, tile)
    chunk_loop = None
    for st in fn.body:
        if isinstance(st, ast.For) and call_name(st.iter.func) == "range" and st.target.id == "_cc":
            chunk_loop = st
            break
        shapes.run(_fold_nodes([st]))
    if chunk_loop is None:
        raise AssertionError(f"{kernel}: no chunk loop")
    # the split takes the chunk's whole body: what precedes the tile loop (the rows, the sums'
    # zeros), the loop's body as one iteration, and what follows it (the sums' stores)
    tv = next((i for i, st in enumerate(chunk_loop.body) if isinstance(st, ast.For) and st.target.id == "_tv"), None)
    if tv is None:
        return source
    shapes.env[chunk_loop.target.id] = ()
    shapes.env["_tv"] = ()
    head, loop, rest = chunk_loop.body[:tv], chunk_loop.body[tv], chunk_loop.body[tv + 1:]
    first, last = chunk_loop.body[0].lineno, chunk_loop.body[-1].end_lineno
    indent = lines[first - 1][:chunk_loop.body[0].col_offset]
    outer = set(shapes.env)

    def text(nodes):
        return "\n".join(lines[nodes[0].lineno - 1:nodes[-1].end_lineno]) if nodes else ""
    try:
        body = [s for part in (head, loop.body, rest) if part for s in _fold(_block(text(part)), PHASE)]
        sp = split_iteration(body, tile=tile, shapes=shapes, outer=outer, cotangents=cotangents)
    except (NoSplit, UnknownShape) as e:
        return _kept(lines, first, indent, str(e))
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, SyntaxError) as e:
        # a statement this pass misreads: the rendered loop is the checked kernel, so keep it
        # and say so (the library specs' split is asserted by tests/codegen/test_tile_split.py)
        return _kept(lines, first, indent, f"the pass could not read it: {type(e).__name__}: {e}")
    header = lines[loop.lineno - 1].strip()
    inner = indent + INDENT
    new = [f"{indent}if PHASE == 2:",
           f"{inner}# the tile loop split (codegen/tile_split.py): what no block changes once, before the",
           f"{inner}# loop; per block what carries it and the contractions over it, summed; the rest once,",
           f"{inner}# after the loop, from the sums"]
    new += [textwrap.indent(x, inner) for x in sp.before]
    new += [inner + header]
    new += [textwrap.indent(x, inner + INDENT) for x in sp.loop] or [inner + INDENT + "pass"]
    new += [textwrap.indent(x, inner) for x in sp.after]
    new += [f"{indent}else:"]
    new += [INDENT + ln if ln.strip() else ln for ln in lines[first - 1:last]]
    return "\n".join(lines[:first - 1] + new + lines[last:])


def _kept(lines: list[str], first: int, indent: str, why: str) -> str:
    note = f"{indent}# PHASE 2 keeps the walk's tile loop (codegen/tile_split.py: {_one_line(why)})"
    return "\n".join(lines[:first - 1] + [note] + lines[first - 1:])


def _fold_nodes(nodes):
    """Statements with `if PHASE ...` replaced by PHASE 2's branch (for the shapes before the loop)."""
    out = []
    for n in nodes:
        taken = _phase_test(n.test, PHASE) if isinstance(n, ast.If) else None
        if taken is None:
            out.append(n)
        else:
            out += _fold_nodes(n.body if taken else n.orelse)
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())[:160]

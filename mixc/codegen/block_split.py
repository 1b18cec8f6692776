"""Code motion around a loop over the blocks of one dim: the machinery of codegen/tile_split.py
(the backward tiles kernel's loop over the tile dim, rendered by the template) and codegen/
key_split.py (the forward's loop over the key dim's blocks, made by the pass).

The statements of one iteration (one chunk's body, the loop's body inlined) are read with
Python's `ast`, each name given one assignment (SSA), their symbolic block shapes inferred
(block_shapes.py), and each placed by data flow: before the loop what no block changes, in
the loop what carries the block and the contractions over it, summed into accumulators, after
the loop the rest from the sums (split_iteration). What a caller's kernel text holds is never
run: constexpr tests are folded node by node (_constexpr_test)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .block_shapes import Shapes, call_name, rename
from .block_statements import NoSplit, Stmt, _names, _parse


def _ssa(stmts: list[Stmt], outer: set[str], fresh_outer: bool = False, final: dict | None = None,
         first: dict | None = None) -> list[Stmt]:
    """Each name written once: a later assignment to a name gets a fresh name (and the reads
    after it follow). A statement that reads and writes a name (a loop's `+=`) updates the
    current one; `x = x + ...` where x comes from outside the loop body (`dp_x = dp_x + ...`)
    or from tl.zeros (`_sum_dq`) is an accumulator (ACC) and keeps it. fresh_outer: a name from
    outside gets a fresh name at its first assignment too (Triton's loops keep a variable's
    type: `_offs_K` of a key block must not rebind the whole dim's). final: filled with each
    name's last SSA name; first: with the name each one's first assignment got."""
    current: dict[str, str] = {} if final is None else final
    first = {} if first is None else first
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
            if fresh_outer and cur is None and x in outer and x not in s.uses:
                new = fresh(x)
            elif x in s.uses and (cur is None or cur in accumulators or cur in zeros):
                acc = True                # adds to a sum begun before the loop body or with zeros
                new = cur or x
                accumulators.add(new)
            elif x in current:
                new = fresh(x)
            else:
                new = x
            current[x] = new
            first.setdefault(x, new)
            src = f"{new} = {rename(rhs, mapping)}"
            if isinstance(node.value, ast.Call) and call_name(node.value.func) == "tl.zeros":
                zeros.add(new)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id not in current:
            raise NoSplit(f"an augmented assignment to a name from outside: {node.target.id}")
        else:
            for x in s.defs:
                if x in s.uses:
                    continue                          # updated in place: the current name
                if x in current or (fresh_outer and x in outer):
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
    whole: frozenset[str] = frozenset()   # of live_out: the names whole after the loop
    carried: tuple[tuple[str, str, str], ...] = ()   # (name, its first SSA name, its last) per carried name


def split_iteration(body: list[Stmt], *, tile: str | None = None, shapes: Shapes, outer: set[str],
                    cotangents: set[str] | None, block: str | None = None, block_var: str = "_tv",
                    flags: frozenset[str] = frozenset(), live_out: frozenset[str] = frozenset(),
                    carried: frozenset[str] = frozenset()) -> Split:
    """Split one iteration of a loop over a dim's blocks (`body`, constexprs already folded;
    `block_var` the block's index) followed by what runs after the loop. Raises NoSplit.

    The block's dim is `block` (the name of its block size) or _BLOCK_<tile>. cotangents: the
    backward's (tile_split.py): only contractions that carry one are summed, the rest of the
    loop stays per block. None: the forward (key_split.py), where every contraction over the
    block is summed, a loop (`for`) that adds contractions into a zeroed name accumulates
    across blocks, and nothing in the loop may read a value that is a sum over the blocks or
    a reduction over one block, but for `flags` (base names: the non-finite tests, whose
    per-block value zeroes that block's rows).

    live_out: names that code after the split reads (the backward's tile loop reads what its
    key-blocked prefix computes): each one the loop leaves whole (what lacks the block, a sum
    over the blocks) is kept under its own name; Split.whole says which. The rest are per
    block: the reader computes them again.

    carried: names each block keeps from one iteration of the body to the next (a state's key
    rows, static key blocks: key_split.py): their last per-block value stays live in the loop;
    Split.carried names their first and last SSA names."""
    forward = cotangents is None
    cotangents = cotangents or set()
    final: dict[str, str] = {}
    first: dict[str, str] = {}
    stmts = _ssa(body, outer, fresh_outer=forward, final=final, first=first)
    shapes.run([s.node for s in stmts])
    tile_dim = re.compile(rf"\b{re.escape(block or f'_BLOCK_{tile}')}\b")

    def has_tile(sh) -> bool:
        return any(tile_dim.search(d) for d in sh)

    kind: dict[str, str] = {block_var: "T"}
    cot: set[str] = set()
    zeroed: set[str] = set()          # names assigned tl.zeros
    for s in stmts:
        ks = {kind.get(u, "F") for u in s.uses}
        looped = bool(ks & {"T", "LP"})
        dep = bool(ks - {"F"})
        s_cot = forward or bool(s.uses & cot) or bool(s.defs & cotangents)
        if isinstance(s.node, ast.Assign) and isinstance(s.node.value, ast.Call) \
                and call_name(s.node.value.func) == "tl.zeros":
            zeroed |= s.defs
        if forward and s.kind == "ACC" and s.defs <= zeroed and any(has_tile(shapes.env.get(d) or ()) for d in s.defs):
            s.kind = ""                   # a sum of the block's own rows (dq's terms): per block, in place
        if forward and looped and (s.kind == "ACC" or isinstance(s.node, ast.For)):
            variant = {n for n, k in kind.items() if k in ("T", "LP", "DUAL", "ACC")}
            # a sum begun before the body (zeros before the tile loop) adds the blocks' shares too
            acc = _accumulation(s, shapes, has_tile, variant, zeroed | (outer & s.defs))
            if acc is not None:
                s.kind, s.place = "ACC", {"loop"}
                for d in s.defs:
                    kind[d] = "ACC" if d in acc else "T"      # a loop's own temporaries: per block
                continue
            if s.kind == "ACC":
                raise NoSplit(f"{sorted(s.defs)} adds what is not a sum over the blocks")
        if s.kind == "ACC":
            # the backward's body was the tile loop's: a sum it adds to per block stays there; the
            # forward's runs once, after the loop
            s.place = {"loop"} if looped or (not dep and not forward) else {"post"}
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
                    extracted = _extract(s, shapes, has_tile, kind, cot, forward)
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
    # of live_out: what is whole after the loop (not per block); read under its own name
    last = {x: final.get(x, x) for x in live_out}
    whole = {x for x, c in last.items() if kind.get(c, "F") not in ("T", "LP")}
    keep = frozenset(last[x] for x in whole) | {final.get(x, x) for x in carried}
    items = _schedule(_sink(_live(_rematerialize(_live(items, keep)), keep)))
    if forward:
        _check_loop_reads(items, kind, flags)
    items += [("post", len(stmts), _parse(f"{x} = {last[x]}")) for x in sorted(whole) if last[x] != x]
    text = {r: tuple(line for reg, _, s in items if reg == r for line in s.comments + [s.src])
            for r in ("pre", "loop", "post")}
    return Split(before=text["pre"], loop=text["loop"], after=text["post"], whole=frozenset(whole),
                 carried=tuple((x, first.get(x, x), final.get(x, x)) for x in sorted(carried)))


def _base(name: str) -> str:
    """A name before the SSA renamed it (x__2 -> x)."""
    return re.sub(r"__\d+$", "", name)


def _check_loop_reads(items, kind: dict, flags) -> None:
    """The forward's loop computes each block's share of whole-dim values: none of its
    statements may read a partial one (a reduction over one block, a sum so far), but for the
    flags, what the flags alone make per block (V with a bad token's row zeroed by the block's
    count: it differs from the whole count's only where the outputs are NaN from that token on)
    and a loop's own accumulator."""
    derived: set[str] = set()        # per-block values of the flags alone (a value's rows they zero)
    for reg, _, s in items:
        if reg != "loop":
            continue
        if s.kind in ("LP", "DUAL") and not all(_base(d) in flags for d in s.defs):
            inputs = {u for u in s.uses if kind.get(u) in ("T", "LP", "DUAL")}
            if not inputs or not all(_base(u) in flags or u in derived for u in inputs):
                raise NoSplit(f"{', '.join(sorted(s.defs))} reduces over the blocks but is read within the loop")
            derived |= s.defs
        partial = {u for u in s.uses - s.defs if kind.get(u) == "ACC"}
        if partial:
            raise NoSplit(f"{', '.join(sorted(partial))} (a sum over the blocks) read within the loop")


def _accumulation(s: Stmt, shapes: Shapes, has_tile, looped: set[str], zeroed: set[str]) -> set[str] | None:
    """The names a statement accumulates across the blocks, or None: a loop (`for`) or an
    `x = x + e` whose every write to a name from before it adds a contraction over the block
    (a dot or a sum over it, scaled by or masked with what does not vary with the block) to a
    name assigned tl.zeros, read nowhere else in it. Summed over the blocks, such a name
    holds the contraction over the whole dim."""
    node = s.node
    if isinstance(node, ast.Assign):
        x = node.targets[0].id
        v = node.value
        ok = (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name)
              and v.left.id == x and x in zeroed and x not in _names(v.right)
              and _linear(v.right, shapes, has_tile, looped))
        return {x} if ok else None
    if not isinstance(node, ast.For):
        return None
    acc = s.defs & s.uses
    if not acc or not acc <= zeroed:
        return None
    variant = set(looped)          # names that vary with the block (the loop's index does not)
    for st in _in_order(node.body):
        if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name) and st.target.id in acc:
            if not isinstance(st.op, ast.Add) or (_names(st.value) & acc) \
                    or not _linear(st.value, shapes, has_tile, variant):
                return None
        elif isinstance(st, (ast.Assign, ast.AugAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & acc or _names(st.value) & acc:
                return None
            if _names(st.value) & variant or any(has_tile(shapes.env.get(n) or ()) for n in names):
                variant |= names
        elif not isinstance(st, (ast.For, ast.If, ast.Pass)):
            return None
    reads = [n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in acc]
    if reads:
        return None                   # the accumulator is read in the loop (an AugAssign's target is Store)
    return acc


def _in_order(body):
    """The statements of a block and of the blocks inside it, in program order."""
    for st in body:
        yield st
        if isinstance(st, (ast.For, ast.If)):
            yield from _in_order(st.body)
            yield from _in_order(st.orelse)


def _linear(e, shapes: Shapes, has_tile, variant: set[str]) -> bool:
    """Whether e is a contraction over the block (a dot over it, a sum over its axis), or
    such scaled by, masked with (where(c, x, 0)), indexed or negated by what does not vary
    with the block (names outside `variant`), or a sum of such."""
    def free(x) -> bool:
        return not (_names(x) & variant)

    def zero(x) -> bool:
        return isinstance(x, ast.Constant) and x.value == 0

    if isinstance(e, ast.Call):
        f = call_name(e.func)
        if f in ("_mixc_dot", "tl.dot"):
            return has_tile((shapes.of(e.args[0])[-1],))
        if f == "_mixc_key_rows":
            # a block's entries placed at their rows of the whole dim (zero elsewhere): summed
            # over the blocks, every entry once
            return has_tile(shapes.of(e.args[0]))
        if f == "tl.sum":
            axis = {k.arg: k.value for k in e.keywords}.get("axis", e.args[1] if len(e.args) > 1 else None)
            inner = shapes.of(e.args[0])
            if axis is None:
                return has_tile(inner)
            return has_tile((inner[ast.literal_eval(axis)],))
        if f == "tl.where" and len(e.args) == 3 and free(e.args[0]):
            a, b = e.args[1:]
            return (_linear(a, shapes, has_tile, variant) and zero(b)) or (zero(a) and _linear(b, shapes, has_tile, variant))
        if isinstance(e.func, ast.Attribute) and e.func.attr == "to":
            return _linear(e.func.value, shapes, has_tile, variant)
        return False
    if isinstance(e, ast.Subscript):
        return _linear(e.value, shapes, has_tile, variant)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return _linear(e.operand, shapes, has_tile, variant)
    if isinstance(e, ast.BinOp):
        lin = [_linear(x, shapes, has_tile, variant) for x in (e.left, e.right)]
        if isinstance(e.op, (ast.Add, ast.Sub)):
            return all(lin)
        if isinstance(e.op, ast.Mult):
            return (lin[0] and free(e.right)) or (lin[1] and free(e.left))
    return False


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


def _extract(s: Stmt, shapes: Shapes, has_tile, kind: dict, cot: set, forward: bool = False):
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
        if isinstance(e, ast.expr) and contracts(e) and not has_tile(shapes.of(e)) and (forward or _names(e) & cot):
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


def _live(items, live_out: frozenset = frozenset()):
    """Drop what nothing after it reads (the per-block copies no loop statement needs, the
    forward's readouts no adjoint reads); stores and accumulators stay. One backward pass over
    before + loop + after: after the SSA only in-place updates carry a name across blocks, and
    they read what they write."""
    live: set[str] = set(live_out)
    keep = []
    for reg, idx, s in reversed(items):
        if not (s.effect or s.kind == "ACC" or s.defs & live):
            continue
        keep.append((reg, idx, s))
        live -= s.defs - s.uses
        live |= s.uses
    return keep[::-1]

"""The chunked forward's intra and output kernels over the key dim's blocks (fla's BK).

A chunk's inputs and every value derived from them are blocks of [C, K] (q, k, the cumulative
decays, their hi and lo parts, the resets ...): at C = 64 and K = 128 each is 32 fp32 registers
a thread with 8 warps, and the intra-chunk matrix A of the key-diagonal decay reads five of
them at once (whole, the intra and output kernels spill at C = 64: bench/results/static-sm90-c64). Each of
those values is local to its key rows, and what leaves the key dim is a contraction over it
(A = Q K^T weighted, the readout's (Q * exp(b)) S0, the rank-1 setup's R L^T ...), so the
chunk runs as

    what lacks the key dim                  once, before the loop
    for each block of KEY_BLOCK keys:
        the block's loads, decays, keys ...  the top's key offsets and params, again per block
        each contraction over the keys       added to its sum (A's sub-chunk loops add theirs)
    the rest, from the sums                  the solve, A V, the output's store

The pass wraps the rendered chunk body of the intra kernel (the intra-chunk matrices) and of the output kernel
where a program takes one chunk (CKPT_EVERY == 1; a state carried through several chunks would
need every key block live: where the class asks for it, key_walk.py holds it in static key
blocks instead) in that loop, as a kernel of its own (the `_keyblocks` variant), which the
launcher runs where KEY_BLOCK is less than the key dim's block (the launch's policy:
Launcher.key_block, Launcher.variant); every other launch runs the chunk
as rendered, so C = 32 at K = 128 compiles as before. It is block_split.py's machinery in its
forward mode: what a key block's statements read must be whole, so a contraction read within
the loop (an l2 norm over K) keeps the rendered chunk, but for the non-finite counts
(_bad_<S>): a block's keys are zeroed by its own entries, as the backward's tile blocks zero
values by their own (ChunkCode.sanitize), and the output rows from such a token on are NaN by
the whole count, after the loop.

The backward's tiles kernel (split_after_tiles, called by tile_split.py) runs each part of its tile
split the same way: what precedes the tile loop over key blocks (A summed; what the tile loop
reads of it kept whole: split_iteration's live_out), the tile loop's contractions over the keys
(dv's (K exp(kw)) dL/dS) in a key loop inside it, as fla's dv kernel, and what follows it over
key blocks, the tile loop's sums that carry the key dim moved into a tile loop of each key
block's own, as fla's dq/dk kernel loops over V blocks per K block.
"""
from __future__ import annotations

import ast
import re
import textwrap
from functools import lru_cache

from .block_shapes import Shapes, UnknownShape, rename
from .block_split import split_iteration
from .block_statements import NoSplit, _block, _flow, _fold, _parse

INDENT = "    "
def key_dim(plan) -> str | None:
    """The dim the forward loops over in key blocks: the one key dim every state shares, where
    no dim aliases it (a feature map's J = K would block one side only); None: no key loop."""
    keys = {st.key_dims for st in plan.states}
    if len(keys) != 1:
        return None
    (dims,) = keys
    aliased = {plan.ir.root_dim(d.name) for d in plan.ir.dims if d.alias_of}
    return dims[0] if len(dims) == 1 and dims[0] not in aliased else None


def split_keys(source: str, kernel: str, key: str | None, flags: set[str], walk: bool = False) -> tuple[str, str | None]:
    """(the kernel `kernel` in `source` (the forward's intra or output kernel, one variant of
    it) as rendered, its chunk body over the key dim's blocks or None where that does not apply,
    the kernel as rendered then saying why in a comment). flags: the base names a block may test
    alone; walk: the output kernel's variant walking several chunks, its state in static key
    blocks (codegen/key_walk.py)."""
    if key is None:
        return source, None
    return _split_keys(source, kernel, key, frozenset(flags), walk)


@lru_cache(maxsize=256)         # a process generates a spec's module again per cache folder (tests)
def _split_keys(source: str, kernel: str, key: str, flags: frozenset, walk: bool) -> tuple[str, str | None]:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == kernel)
    lines = source.split("\n")
    at = next(i for i, st in enumerate(fn.body) if isinstance(st, ast.For) and st.target.id == "_chunk")
    chunk_loop = fn.body[at]
    first, last = chunk_loop.body[0].lineno, chunk_loop.body[-1].end_lineno
    indent = lines[first - 1][:chunk_loop.body[0].col_offset]

    def text(nodes):
        return "\n".join(lines[nodes[0].lineno - 1:nodes[-1].end_lineno]) if nodes else ""
    top, body = text(fn.body[:at]), text(chunk_loop.body)
    head = chunk_loop.lineno
    outer = lines[head - 1][:chunk_loop.col_offset]

    def kept(at_line: int, pad: str, why: str) -> str:
        return "\n".join(lines[:at_line - 1] + [f"{pad}# {why}"] + lines[at_line - 1:])
    try:
        if walk:
            # the output kernel walking several chunks: the state in static key blocks
            # (codegen/key_walk.py, which imports _split from here: imported where used)
            from .key_walk import static_walk
            new = static_walk(top, body, text(fn.body[at + 1:]), fn, key, flags,
                              lambda text, env, carried: _split(top, text, fn, key, env, flags, carried=carried))
            return source, "\n".join(lines[:head - 1] + [textwrap.indent(x, outer) for x in new] + lines[last:])
        sp = _split(top, body, fn, key, {"SEGMENTED": 0}, flags)     # (the segmented walk runs the plain kernel)
    except (NoSplit, UnknownShape) as e:
        why = str(e)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, SyntaxError) as e:
        # a statement this pass misreads: no key-blocked variant (the library specs' split is
        # asserted by tests/codegen/test_key_split.py)
        why = f"the pass could not read it: {type(e).__name__}: {e}"
    else:
        new = [f"{indent}# the key dim in blocks of KEY_BLOCK (codegen/key_split.py): what lacks it once, before",
               f"{indent}# the loop; per block its rows and the contractions over it, summed; the rest after"]
        new += [textwrap.indent(x, indent) for x in sp.before]
        new += [f"{indent}for _kb in range((_size_{key} + KEY_BLOCK - 1) // KEY_BLOCK):"]
        new += [textwrap.indent(x, indent + INDENT) for x in sp.loop] or [indent + INDENT + "pass"]
        new += [textwrap.indent(x, indent) for x in sp.after]
        return source, "\n".join(lines[:first - 1] + new + lines[last:])
    if walk:
        return kept(head, outer, f"walking chunks keeps the whole key dim (codegen/key_walk.py: {_one_line(why)})"), None
    return kept(first, indent, f"the whole key dim kept (codegen/key_split.py: {_one_line(why)})"), None


def _split(top: str, body: str, fn: ast.FunctionDef, key: str, env: dict, flags, prefix: str = "",
           live_out: frozenset = frozenset(), carried: frozenset = frozenset()):
    """The Split (before, loop, after) of one launch's chunk body over the key blocks (prefix:
    what the chunk runs before it; live_out: what code after it reads). Raises NoSplit."""
    whole = re.compile(rf"\b_BLOCK_{re.escape(key)}\b")
    shapes = Shapes({a.arg: () for a in fn.args.args})
    top_stmts = _fold(_block(top), env)
    shapes.run([s.node for s in top_stmts])
    shapes.env.update({i: () for i in ("_chunk", "_cc", "_tv", "_tvk", "_kb")})     # the loops' indices
    if prefix:
        shapes.run([s.node for s in _block(prefix)])
    # the top's values over the key dim (its offsets and mask, the states' key offsets, params
    # over it) again per block, from the block's offsets
    def keyed(s):
        return {d for d in s.defs if any(whole.search(x) for x in shapes.env.get(d) or ())}
    # a value assigned in a branch (a state's initial value) is not copied: read in a key
    # block, it keeps the whole dim (below)
    stale = {d for s in top_stmts if not isinstance(s.node, ast.Assign) for d in keyed(s)}
    # ... nor one the chunks update (a param's gradient summed over them, a state)
    stale |= {n.id for n in ast.walk(ast.parse(textwrap.dedent(body)))
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} & {d for s in top_stmts for d in keyed(s)}
    origin = []
    for s in top_stmts:
        if isinstance(s.node, ast.Assign) and keyed(s) and not s.defs & stale:
            origin.append(_blocked(s.src.replace(f"tl.arange(0, _BLOCK_{key})",
                                                 f"(_kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK))"), whole))
        elif keyed(s):
            stale |= keyed(s)
    # values of the whole key dim from before the chunk: a key block must not read one
    stale |= {d for d, sh in shapes.env.items() if sh and any(whole.search(x) for x in sh)}
    items = _fold(_block("\n".join(origin + [_blocked(textwrap.dedent(body), whole)])), env)
    # a sum over the chunks of what is over the key dim (a param's gradient [K], whole from
    # before): each block adds its entries at its rows (_mixc_key_rows)
    rows = {x for x in stale if shapes.env.get(x) == (f"_BLOCK_{key}",)}
    items = [_key_rows(s, rows, key) for s in items]
    sp = split_iteration(items, shapes=shapes, outer=set(shapes.env), cotangents=None, block="KEY_BLOCK",
                         block_var="_kb", flags=flags, live_out=live_out, carried=carried)
    read = set()
    for st in ast.parse("\n".join(sp.loop)).body:
        names = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)}
        if _adds_key_rows(st):
            names.discard(st.targets[0].id)
        read |= names & stale
    if read:
        raise NoSplit(f"{', '.join(sorted(read))} (the whole key dim) read in a key block")
    return sp


def _key_rows(s, rows: set, key: str):
    """`x = x + e` into a name of `rows` (whole over the key dim) as the block's entries of e
    added at their rows: `x = x + _mixc_key_rows(e, <the block's offsets>, _BLOCK_<key>)`."""
    node = s.node
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in rows and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add)
            and isinstance(node.value.left, ast.Name) and node.value.left.id == node.targets[0].id):
        return s
    x = node.targets[0].id
    t = _parse(f"{x} = {x} + _mixc_key_rows({ast.unparse(node.value.right)}, "
               f"(_kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)), _BLOCK_{key})")
    t.comments = s.comments
    return t


def _adds_key_rows(st) -> bool:
    v = getattr(st, "value", None)
    return isinstance(st, ast.Assign) and isinstance(v, ast.BinOp) and isinstance(v.right, ast.Call) \
        and ast.unparse(v.right.func) == "_mixc_key_rows"


def _blocked(src: str, whole: re.Pattern) -> str:
    return whole.sub("KEY_BLOCK", src)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def split_after_tiles(top: str, fn: ast.FunctionDef, key: str, before: tuple, loop: tuple, after: tuple,
                      header: str, flags) -> tuple:
    """The backward tiles kernel's chunk as tile_split.py splits it (before, the tile loop's body,
    after; header: the tile loop's `for`) over the key dim's blocks: (before, loop, the key
    loop's before, its body, after), before and loop themselves key-blocked where they split
    (_split_before_tiles; else whole, with a comment why). The sums over the tile
    blocks that carry the key dim (dO S0^T, V dh^T, sum(S0 * dh): [C, K] and [K]) leave the
    tile loop; each key block sums its rows of them in a tile loop of its own (fla's dq/dk
    kernel: a program per K block, V blocks inside), then its rows of dq, dk, dg. Raises
    NoSplit."""
    whole = re.compile(rf"\b_BLOCK_{re.escape(key)}\b")
    pre, body = _block("\n".join(before)), _block("\n".join(loop))

    def zeroed(s):
        v = getattr(s.node, "value", None)
        return isinstance(s.node, ast.Assign) and isinstance(v, ast.Call) and ast.unparse(v.func) == "tl.zeros"
    keyed = {d for s in pre if zeroed(s) and whole.search(s.src) for d in s.defs}
    updates = [s for s in body if isinstance(s.node, ast.AugAssign) and s.node.target.id in keyed]
    if not updates:
        raise NoSplit("no sum over the tile blocks carries the key dim")
    # what the moved sums read, in the tile loop's order
    need, moved = set(), []
    for s in reversed(body):
        if s in updates or (s.defs & need and not s.effect):
            moved.append(s)
            need |= s.uses
    moved.reverse()
    # the tile loop without them: what a store, another sum or an in-place update still reads
    live, kept = set(), []
    for s in reversed([s for s in body if s not in updates]):
        if s.effect or s.defs & s.uses or s.defs & live:
            kept.append(s)
            live = (live - (s.defs - s.uses)) | s.uses
    kept.reverse()
    head = header.replace("for _tv in", "for _tvk in", 1)
    nested = head + "\n" + textwrap.indent("\n".join(rename(s.src, {"_tv": "_tvk"}) for s in moved), INDENT)
    zeros = [s.src for s in pre if s.defs & keyed]
    pre_src = [x for s in pre if not s.defs & keyed for x in s.comments + [s.src]]
    kept_src = [x for s in kept for x in s.comments + [s.src]]
    rest = zeros + [nested] + list(after)
    try:
        pre_src, kept_src = _split_before_tiles(top, fn, key, pre_src, kept_src, rest, header, flags)
    except (NoSplit, UnknownShape) as e:
        pre_src = [f"# the whole key dim before the tile loop (codegen/key_split.py: {_one_line(str(e))})"] + pre_src
    prefix = "\n".join(pre_src + [header] + [textwrap.indent(x, INDENT) for x in kept_src or ["pass"]])
    sp = _split(top, "\n".join(rest), fn, key, {}, flags, prefix=prefix)
    return tuple(pre_src), tuple(kept_src), sp.before, sp.loop, sp.after


def _split_before_tiles(top: str, fn: ast.FunctionDef, key: str, pre_src: list, kept_src: list, rest: list,
                        header: str, flags) -> tuple[list, list]:
    """What precedes the tile loop over the key blocks (the intra-chunk matrix A: a sum of
    the blocks' contractions; the non-finite counts), and the tile loop's body with the
    contractions over the keys that it reads per tile (dv's (K * exp(kw)) dL/dS) summed in a
    key loop of its own, from the block's keys and decays computed again (fla's dv kernel: a
    program per V block, K blocks inside). (before the tile loop, the tile loop's body); raises
    NoSplit where what follows would read a per-block value."""
    pre = _block("\n".join(pre_src))
    defs = {d for s in pre for d in s.defs}
    tile_reads = _exposed(kept_src) & defs
    rest_reads = _exposed(rest) & defs
    # what the tile loop computes again per key block reads what lacks the key dim whole
    again_reads = {u for s in pre for u in s.uses} & defs
    sp = _split(top, "\n".join(pre_src), fn, key, {}, flags,
                live_out=frozenset(tile_reads | rest_reads | again_reads))
    if rest_reads - sp.whole:
        raise NoSplit(f"{', '.join(sorted(rest_reads - sp.whole))} (per key block) read after the tile loop")
    before = list(sp.before) + [f"for _kb in range((_size_{key} + KEY_BLOCK - 1) // KEY_BLOCK):"] + \
        [textwrap.indent(x, INDENT) for x in sp.loop or ("pass",)] + list(sp.after)
    if not tile_reads - sp.whole:
        return before, kept_src
    # the tile loop's body: the per-block values it reads computed again, per key block
    again = [x for s in pre if not s.defs & sp.whole and not s.effect for x in s.comments + [s.src]]
    tile = _block("\n".join(kept_src))
    body = again + [_as_assign(s) for s in tile]
    tp = _split(top, "\n".join(body), fn, key, {}, flags, prefix="\n".join(before))
    kept = [_as_aug(x) for x in tp.before] + [f"for _kb in range((_size_{key} + KEY_BLOCK - 1) // KEY_BLOCK):"] + \
        [textwrap.indent(_as_aug(x), INDENT) for x in tp.loop or ("pass",)] + [_as_aug(x) for x in tp.after]
    return before, kept


def _as_aug(line: str) -> str:
    """_as_assign's form back as written: `x = x + (e)` -> `x += e` (only where e is the whole
    parenthesized operand: `x = x + (a) * (b)` stays)."""
    m = re.fullmatch(r"(\w+) = \1 \+ \((.*)\)", line)
    if not m:
        return line
    try:
        ast.parse(m[2], mode="eval")
    except SyntaxError:
        return line
    return f"{m[1]} += {m[2]}"


def _exposed(src: list) -> set[str]:
    """The names a block of statements reads before it writes them."""
    return _flow([s.node for s in _block("\n".join(src))], set())[0]


def _as_assign(s) -> str:
    """`x += e` as `x = x + e` (a sum into a name from before the loop body: the split's
    accumulator form), comments kept."""
    node = s.node
    src = s.src
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name) \
            and "\n" not in src:
        x = node.target.id
        src = f"{x} = {x} + ({src[src.index('+=') + 2:].strip()})"
    return "\n".join(s.comments + [src])

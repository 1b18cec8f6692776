"""The chunked forward's output kernel walking R chunks (CKPT_EVERY > 1) with its state in static key
blocks (fla's b_h1 .. b_h4, here up to eight): its `_rewalk_staged_keyblocks` variant.

Where a program takes R chunks from one checkpoint, the state [K, V-block] advances through
them in registers, so a dynamic loop over the key blocks (key_split.py) cannot index it, and
whole at C = 64 and K = 128 the walk spills (gla 464 B, rwkv6 992 on sm_90). Each of the
key-diagonal decay's statements is local to its key rows but the readout's contraction, so the
walk runs as

    the state's key blocks: S_k0, S_k1 ...      loaded from the checkpoint, before the chunks
    for each chunk:
        what lacks the key dim                  once
        key block 0: its rows, its share of the readout, S_k0 advanced
        if 1 * KEY_BLOCK < K:   key block 1 ...   (constexpr tests: a K of one block has one)
        ...
        the rest, from the sums                 A V, the output's store

Each block's statements are key_split's loop body (the forward-mode split, with the state's
rows carried from one chunk to the next: split_iteration's `carried`) written once per block
with its index for _kb; up to STATIC_BLOCKS blocks (K <= 8 KEY_BLOCK, asserted statically; the
launch's KEY_BLOCK is at least K / 8, Launcher.key_block, and the launcher picks this variant
only then), else the rendered walk runs (the output kernel's `_rewalk` variant without
`_keyblocks`). A class whose advance reads a contraction over the keys (the
rank-1 class's W S) has no such split (NoSplit: the walk stays whole).
"""
from __future__ import annotations

import ast
import re
import textwrap

from .block_shapes import Shapes, rename
from .block_statements import NoSplit, Stmt, _block, _flow, _fold

INDENT = "    "
STATIC_BLOCKS = 8


def static_walk(top: str, body: str, rest: str, fn: ast.FunctionDef, key: str, flags, split) -> list[str]:
    """The lines (dedented) that replace the chunk loop `for _chunk in range(_c_lo, _c_hi):` of
    the output kernel's walking variant (rest: what follows it in the kernel; split:
    key_split._split): the state's blocks loaded, then the chunk loop with one copy of the key
    loop's body per block. Raises NoSplit."""
    env: dict = {"SEGMENTED": 0}     # (the segmented walk runs the plain kernel: Launcher.variant)
    whole = re.compile(rf"\b_BLOCK_{re.escape(key)}\b")
    top_stmts = _fold(_block(top), env)
    body_stmts = _fold(_block(textwrap.dedent(body)), env)
    exposed, written = _flow([s.node for s in body_stmts], set())
    shapes = Shapes({a.arg: () for a in fn.args.args})
    shapes.run([s.node for s in top_stmts])
    # the state: what the chunks read and update, over the key dim, loaded last before them
    carried = {}
    for s in top_stmts:
        for d in s.defs & exposed & written:
            carried[d] = s
    other = [d for d, s in carried.items() if not (isinstance(s.node, ast.Assign) and "tl.load(" in s.src
                                                   and whole.search((shapes.env.get(d) or ("",))[0]))]
    if not carried or other:
        raise NoSplit(f"the chunks carry {', '.join(sorted(other)) or 'no state'}: not a state over the key "
                      "dim loaded from its checkpoint")
    after = set(_flow([s.node for s in _fold(_block(rest), env)], set())[0]) & set(carried) if rest.strip() else set()
    if after:
        raise NoSplit(f"{', '.join(sorted(after))} read whole after the chunks")
    sp = split("\n".join([s.src for s in carried.values()] + [textwrap.dedent(body)]), env,
               carried=frozenset(carried))
    loop = _block("\n".join(sp.loop))
    names = {x: (first, last) for x, first, last in sp.carried}
    hoisted, copies = [], []
    for i in range(STATIC_BLOCKS):
        hoist, copy = [], []
        for at, st in enumerate(loop):
            x = next((x for x, (f, _) in names.items() if st.defs == {f} and isinstance(st.node, ast.Assign)), None)
            if x is None:
                copy.append(st)
                continue
            # the block's rows of the state: loaded before the chunks (with what the load reads),
            # then carried
            hoist += _slice(loop[:at], st, f"_h{i}", f"{x}_k{i}")
            copy.append(_stmt(f"{names[x][0]} = {x}_k{i}", st.comments))
        copy += [_stmt(f"{x}_k{i} = {last}") for x, (_, last) in names.items()]
        copy = _prune(copy, {f"{x}_k{i}" for x in names})
        hoisted.append(_at(hoist, i))
        copies.append(_at(copy, i))
    lines = [f"# the state's key rows in static blocks of KEY_BLOCK (codegen/key_walk.py), carried through",
             "# the chunks: what lacks the key dim once a chunk, each block's rows and its share of the",
             f"# contractions, the rest from the sums; at most {STATIC_BLOCKS} blocks (the launcher picks this",
             "# kernel only then: Launcher.kernel)",
             f"tl.static_assert(_BLOCK_{key} <= {STATIC_BLOCKS} * KEY_BLOCK)"]
    lines += _guarded(hoisted, key)
    lines += ["for _chunk in range(_c_lo, _c_hi):"]
    inner = list(sp.before) + _guarded(copies, key) + list(sp.after)
    lines += [textwrap.indent(x, INDENT) for x in inner]
    return lines


def _stmt(src: str, comments=()) -> Stmt:
    st = _block(src)[0]
    st.comments = list(comments)
    return st


def _slice(before: list[Stmt], load: Stmt, suffix: str, target: str) -> list[Stmt]:
    """The load and what it reads of the statements before it, their names suffixed (the
    load's own target: `target`)."""
    need, out = set(load.uses), [load]
    for st in reversed(before):
        if st.defs & need and not st.effect:
            out.append(st)
            need |= st.uses
    out.reverse()
    defs = {d for st in out[:-1] for d in st.defs}
    mapping = {d: d + suffix for d in defs} | {next(iter(load.defs)): target}
    return [_stmt(rename(st.src, mapping), st.comments) for st in out]


def _prune(stmts: list[Stmt], keep: set[str]) -> list[Stmt]:
    """Without what nothing after it reads (the load's offsets, once the state is carried)."""
    live, out = set(keep), []
    for st in reversed(stmts):
        if st.effect or isinstance(st.node, (ast.AugAssign, ast.For)) or st.defs & live:
            out.append(st)
            live = (live - (st.defs - st.uses)) | st.uses
    return out[::-1]


def _at(stmts: list[Stmt], i: int) -> list[str]:
    """The statements' lines for key block i (its index for _kb)."""
    return [re.sub(r"\b_kb\b", str(i), x) for st in stmts for x in st.comments + [st.src]]


def _guarded(blocks: list[list[str]], key: str) -> list[str]:
    """Block 0's lines, then each other's under its constexpr test (a block past K: none)."""
    out = [f"# key block 0"] + blocks[0]
    for i, b in enumerate(blocks[1:], 1):
        out += [f"if {i} * KEY_BLOCK < _size_{key}:      # key block {i}"]
        out += [textwrap.indent(x, INDENT) for x in b or ["pass"]]
    return out


"""The chunked backward's tiles kernel, split around its tile loop as fla's dq/dk kernels are.

The tiles kernel writes one chunk's gradients, looping over the blocks of the tile dim (V: a [K, V]
state block is what fits in registers). As rendered, the loop body is the walk's: every
statement runs once per block, so the loads of q, k and g, the cumulative decays, the
intra-chunk matrices and the adjoints that lack the tile dim are recomputed per block, their
partials summed (and the registers of both kinds live at once: the spills of issue 16). This
pass rewrites the rendered tiles kernel into

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
would need a per-block value, or a statement has no shape rule (block_shapes.py), the tiles
kernel keeps its rendered loop (NoSplit, the reason in a comment of the kernel).
"""
from __future__ import annotations

import ast
import textwrap
from functools import lru_cache

from .block_shapes import Shapes, UnknownShape, call_name
from .block_split import split_iteration
from .block_statements import NoSplit, _block
from .key_split import split_after_tiles

INDENT = "    "


# ---- the kernel -------------------------------------------------------------------------

def split_tiles(source: str, kernel: str, tile: str | None, cotangents: set[str],
                aliases: dict[str, str] | None = None, key: str | None = None,
                flags: set[str] = frozenset()) -> tuple[str, str | None]:
    """(the tiles kernel `kernel` in `source` with its tile loop split, where the split does not
    apply the source with a comment why; its variant with the key dim in blocks after the split
    or None where that does not apply, the first then saying why). aliases: dim -> the dim it
    aliases (same block)."""
    if tile is None:
        return source, None
    return _split_tiles(source, kernel, tile, frozenset(cotangents), tuple(sorted((aliases or {}).items())), key,
                        frozenset(flags))


@lru_cache(maxsize=256)         # a process generates a spec's module again per cache folder (tests)
def _split_tiles(source: str, kernel: str, tile: str, cotangents: frozenset, alias_items: tuple,
                 key: str | None = None, flags: frozenset = frozenset()) -> tuple[str, str | None]:
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
        shapes.run([st])
    if chunk_loop is None:
        raise AssertionError(f"{kernel}: no chunk loop")
    # the split takes the chunk's whole body: what precedes the tile loop (the rows, the sums'
    # zeros), the loop's body as one iteration, and what follows it (the sums' stores)
    tv = next((i for i, st in enumerate(chunk_loop.body) if isinstance(st, ast.For) and st.target.id == "_tv"), None)
    if tv is None:
        return source, None
    shapes.env[chunk_loop.target.id] = ()
    shapes.env["_tv"] = ()
    head, loop, rest = chunk_loop.body[:tv], chunk_loop.body[tv], chunk_loop.body[tv + 1:]
    first, last = chunk_loop.body[0].lineno, chunk_loop.body[-1].end_lineno
    indent = lines[first - 1][:chunk_loop.body[0].col_offset]
    outer = set(shapes.env)

    def text(nodes):
        return "\n".join(lines[nodes[0].lineno - 1:nodes[-1].end_lineno]) if nodes else ""
    try:
        body = [s for part in (head, loop.body, rest) if part for s in _block(text(part))]
        sp = split_iteration(body, tile=tile, shapes=shapes, outer=outer, cotangents=cotangents)
    except (NoSplit, UnknownShape) as e:
        return _kept(lines, first, indent, str(e)), None
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, SyntaxError) as e:
        # a statement this pass misreads: the rendered loop is the checked kernel, so keep it
        # and say so (the library specs' split is asserted by tests/codegen/test_tile_split.py)
        return _kept(lines, first, indent, f"the pass could not read it: {type(e).__name__}: {e}"), None
    header = lines[loop.lineno - 1].strip()
    keyed, why = None, []
    if key is not None:
        # the variant with what follows the tile loop over the key dim's blocks (codegen/key_split.py)
        top = text(fn.body[:fn.body.index(chunk_loop)])
        try:
            pre, kept, kb, kl, ka = split_after_tiles(top, fn, key, sp.before, sp.loop, sp.after, header, flags)
            new = [f"{indent}# the tile loop split (codegen/tile_split.py), then the key dim in blocks of KEY_BLOCK",
                   f"{indent}# (codegen/key_split.py): each block sums its rows of the tile blocks' contractions",
                   f"{indent}# that carry the key dim in a tile loop of its own, then its rows of the rest"]
            new += [textwrap.indent(x, indent) for x in pre]
            new += [indent + header]
            new += [textwrap.indent(x, indent + INDENT) for x in kept] or [indent + INDENT + "pass"]
            new += [textwrap.indent(x, indent) for x in kb]
            new += [f"{indent}for _kb in range((_size_{key} + KEY_BLOCK - 1) // KEY_BLOCK):"]
            new += [textwrap.indent(x, indent + INDENT) for x in kl] or [indent + INDENT + "pass"]
            new += [textwrap.indent(x, indent) for x in ka]
            keyed = "\n".join(lines[:first - 1] + new + lines[last:])
        except (NoSplit, UnknownShape) as e:
            why = [f"{indent}# the whole key dim after the tile loop (codegen/key_split.py: {_one_line(str(e))})"]
        except (ValueError, IndexError, KeyError, TypeError, AttributeError, SyntaxError) as e:
            why = [f"{indent}# the whole key dim after the tile loop (codegen/key_split.py: the pass could not "
                   f"read it: {_one_line(f'{type(e).__name__}: {e}')})"]
    new = why + [f"{indent}# the tile loop split (codegen/tile_split.py): what no block changes once, before the",
                 f"{indent}# loop; per block what carries it and the contractions over it, summed; the rest once,",
                 f"{indent}# after the loop, from the sums"]
    new += [textwrap.indent(x, indent) for x in sp.before]
    new += [indent + header]
    new += [textwrap.indent(x, indent + INDENT) for x in sp.loop] or [indent + INDENT + "pass"]
    new += [textwrap.indent(x, indent) for x in sp.after]
    return "\n".join(lines[:first - 1] + new + lines[last:]), keyed


def _kept(lines: list[str], first: int, indent: str, why: str) -> str:
    note = f"{indent}# the walk's tile loop kept (codegen/tile_split.py: {_one_line(why)})"
    return "\n".join(lines[:first - 1] + [note] + lines[first - 1:])


def _one_line(text: str) -> str:
    return " ".join(text.split())[:160]

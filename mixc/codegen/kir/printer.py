"""The one printer: kernel IR -> Triton source. Parentheses where Python's binding needs them
(and nowhere else), a shape comment after every block a Let defines (`# [K, V]`, its dtype
when it is not float32), arguments laid out as standalone/kernel_args.py's lines."""
from __future__ import annotations

from . import nodes as n

ATOM = 100
UNARY = 13
INDENT = "    "


def precedence(e: n.Expr) -> int:
    if isinstance(e, n.BinOp):
        return n.BINARY[e.op]
    if isinstance(e, n.Neg):
        return UNARY
    if isinstance(e, n.Num) and isinstance(e.value, (int, float)) and e.value < 0 and e.value != float("-inf"):
        return UNARY
    if isinstance(e, n.Template):
        return 0            # registry text: parenthesized wherever it is an operand
    # a broadcast to its own dims and a renaming print their operand alone: its binding
    if isinstance(e, n.Broadcast) and (not e.x.dims or e.x.dims == e.to):
        return precedence(e.x)
    if isinstance(e, n.Permute) and e.frm == e.to:
        return precedence(e.x)
    return ATOM


def number(v: int | float) -> str:
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if v != v:
        return "float('nan')"
    if v in (float("inf"), float("-inf")):
        return "float('inf')" if v > 0 else "float('-inf')"
    return repr(float(v))


def _paren(e: n.Expr, at_least: int) -> str:
    text = expr(e)
    return f"({text})" if precedence(e) < at_least else text


def _index(have: n.Dims, want: n.Dims) -> str:
    return ", ".join(":" if d in have else "None" for d in want)


def expr(e: n.Expr) -> str:
    """The Triton text of one expression."""
    if isinstance(e, n.Name):
        return e.id
    if isinstance(e, n.Num):
        return number(e.value)
    if isinstance(e, (n.Const, n.Raw)):
        return e.text
    if isinstance(e, n.Arange):
        return f"tl.arange(0, {' * '.join(n.blocks(e.dim))})"
    if isinstance(e, n.Zeros):
        assert e.dims_, "a scalar zero is a number, not tl.zeros"
        return f"tl.zeros([{', '.join(' * '.join(n.blocks(d)) for d in e.dims_)}], dtype=tl.float32)"
    if isinstance(e, n.BinOp):
        p = n.BINARY[e.op]
        # left-associative: the right operand needs parentheses at equal binding too (and a
        # comparison's operands at equal binding on both sides: no chained comparisons)
        left = _paren(e.left, p + 1 if e.op in n.COMPARISONS else p)
        return f"{left} {e.op} {_paren(e.right, p + 1)}"
    if isinstance(e, n.Neg):
        return f"-{_paren(e.x, UNARY)}"
    if isinstance(e, n.Broadcast):
        if not e.x.dims or e.x.dims == e.to:
            return expr(e.x)
        return f"{_paren(e.x, ATOM)}[{_index(e.x.dims, e.to)}]"
    if isinstance(e, n.Permute):
        if e.frm == e.to:
            return expr(e.x)
        return f"tl.permute({expr(e.x)}, {tuple(e.frm.index(d) for d in e.to)})"
    if isinstance(e, (n.Reduce, n.Scan)):        # a reduction (over None: every dim), or a running sum
        if e.over is None:
            return f"{e.fn}({expr(e.x)})"
        return f"{e.fn}({expr(e.x)}, axis={e.x.dims.index(e.over)})"
    if isinstance(e, n.Dot):
        return f"_mixc_dot({expr(e.a)}, {expr(e.b)}, DOT)"
    if isinstance(e, n.Trans):
        return f"tl.trans({expr(e.x)})"
    if isinstance(e, n.Cast):
        return f"{_paren(e.x, ATOM)}.to({expr(e.to)})"
    if isinstance(e, n.ElementType):
        return f"{expr(e.ptr)}.dtype.element_ty"
    if isinstance(e, (n.Call, n.Helper)):         # a tl function, or a helper of the module
        return f"{e.fn}({', '.join(expr(a) for a in e.args)})"
    if isinstance(e, n.Template):
        return e.text.format(**{k: _paren(v, ATOM) for k, v in e.args})
    if isinstance(e, n.ZerosLike):
        if not e.f32:
            return f"tl.zeros_like({expr(e.like)})"
        return f"tl.zeros({expr(e.like)}.shape, dtype=tl.float32)"
    if isinstance(e, n.BroadcastTo):
        return f"tl.broadcast_to({expr(e.x)}, {expr(e.like)}.shape)"
    if isinstance(e, n.Gather):
        return f"tl.gather({expr(e.x)}, {expr(e.index)}, {e.axis})"
    if isinstance(e, n.SubchunkSum):
        runs = f"[_BLOCK__T // {e.size}, {e.size}, {expr(e.like)}.shape[1]]"
        return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape({expr(e.x)}, {runs}), axis=1)[:, None, :], "
                f"{runs}), {expr(e.like)}.shape)")
    if isinstance(e, n.Load):
        text = f"tl.load({_address(e.ptr, e.offsets)}"
        if e.mask is not None:
            text += f", mask={expr(e.mask)}"
        if e.other is not None:
            text += f", other={expr(e.other)}"
        return text + ")"
    raise TypeError(f"no printer for {type(e).__name__}")


def _address(ptr: n.Name, offsets) -> str:
    """A pointer plus its offsets, added in order: an offset that is itself a sum is formed
    first (parenthesized), as the kernel built it."""
    return " + ".join([expr(ptr)] + [_paren(o, n.BINARY["+"] + 1) for o in offsets])


def shape_comment(dims: n.Dims, dtype: str) -> str:
    """A block's axes and (when not float32) its dtype: `[K, V]`, `[K] i1`; nothing for a scalar."""
    if not dims:
        return ""
    return f"[{', '.join(dims)}]" + ("" if dtype == "f32" else f" {dtype}")


def stmt(s: n.Stmt, indent: str = "", comments: bool = True) -> list[str]:
    """The lines of one statement."""
    if isinstance(s, n.Let):
        line = f"{indent}{s.name} = {expr(s.value)}"
        if comments:
            note = ": ".join(x for x in (shape_comment(s.dims, s.dtype), s.comment or "") if x)
            if note:
                line += f"  # {note}"
        return [line]
    if isinstance(s, n.Acc):
        return [f"{indent}{s.name} += {expr(s.value)}"]
    if isinstance(s, n.Store):
        line = f"{indent}tl.store({_address(s.ptr, s.offsets)}, {expr(s.value)}"
        return [line + (f", mask={expr(s.mask)})" if s.mask is not None else ")")]
    if isinstance(s, n.Do):
        return [f"{indent}{expr(s.value)}"]
    if isinstance(s, n.Comment):
        return [f"{indent}# {s.text}" if s.text else ""]
    if isinstance(s, n.Text):
        return [f"{indent}{line}" if line.strip() else "" for line in s.lines]
    if isinstance(s, n.For):
        loop = "tl.static_range" if s.static else "range"
        head = f"{indent}for {s.var} in {loop}({expr(s.start)}, {expr(s.stop)}):"
        return [head] + block(s.body, indent + INDENT, comments)
    if isinstance(s, n.If):
        lines = [f"{indent}if {expr(s.cond)}:"] + block(s.body, indent + INDENT, comments)
        if s.orelse:
            lines += [f"{indent}else:"] + block(s.orelse, indent + INDENT, comments)
        return lines
    raise TypeError(f"no printer for {type(s).__name__}")


def block(stmts, indent: str, comments: bool = True) -> list[str]:
    lines = [line for s in stmts for line in stmt(s, indent, comments)]
    if not any(line.strip() and not line.strip().startswith("#") for line in lines):
        lines.append(f"{indent}pass")
    return lines


def signature(args: tuple[n.ArgLine, ...]) -> list[str]:
    """Argument lines: each its arguments (constexprs annotated) and a trailing comment at column
    38, or a comment line."""
    lines = []
    for line in args:
        if not line.args:
            lines.append(f"{INDENT}# {line.comment}")
            continue
        code = " ".join(f"{a.name}{': tl.constexpr' if a.constexpr else ''}," for a in line.args)
        lines.append(f"{INDENT}{code.ljust(34)}# {line.comment}" if line.comment else f"{INDENT}{code}")
    return lines


def kernel(k: n.Kernel) -> str:
    """A kernel's source: its header comment, @triton.jit, its signature and body."""
    lines = [f"# {h}" for h in k.header] + ["@triton.jit", f"def {k.name}("]
    lines += signature(k.args) + ["):"]
    lines += [f"{INDENT}# {x}" for x in k.notes]
    lines += block(k.body, INDENT)
    return "\n".join(lines) + "\n"

"""The kernel IR's verifier, run after every pass (passes.py):

  defined   every name is defined before it is read: a kernel argument, a Let above it or a
            loop's variable;
  scope     nothing is read outside the block that defines it: what a loop's body or one
            branch of an If defines ends with it (a name both branches define lives on);
  dims      a name is read with the dims its definition gave it; both operands of an
            elementwise op (and a tl function's, a load's mask) have the same dims or none
            (broadcasting by name is an explicit Broadcast, to dims that keep the operand's
            order); a reduction's dim is one of its operand's; a Let's value has its dims;
  re-assign a second Let of a name (a loop-carried state) keeps its dims and dtype; a sum
            into a name (Acc, +=) adds a value of its dims;
  dtypes    a Let's dtype is its value's (Triton's promotion: i1 < i32 < i64 < f32; comparisons
            i1, `/` and the float functions f32, a cast its target) where that is known;
  control   loop bounds and If conditions are scalars.

Raw text (the adapter's, never in a kernel built as IR) and Text statements (the chunked
kernels' hooks, codegen/chunk_ir.py) are not looked into. An If on a constexpr argument
(IS_VARLEN) is folded when Triton compiles the kernel, so its branches may give a name
different dtypes (the slot's index within its sequence: int64 from a packed sequence's bos,
int32 else); it lives on with the wider one.
"""
from __future__ import annotations

from . import nodes as n
from . import printer
from .dtypes import dtype_of, promote


class KirError(ValueError):
    """A kernel IR that breaks one of the rules above."""


def _is_subsequence(have: n.Dims, want: n.Dims) -> bool:
    it = iter(want)
    return all(d in it for d in have)


class _Scope:
    def __init__(self, visible: dict[str, tuple[n.Dims, str]], closed: dict[str, str],
                 constexprs: frozenset[str] = frozenset()):
        self.visible = visible          # name -> (dims, dtype)
        self.closed = closed            # name -> the block that defined it, now ended
        self.constexprs = constexprs    # the kernel's constexpr arguments


def _check_expr(e: n.Expr, scope: _Scope, where: str) -> None:
    for x in n.walk(e):
        for u in x.uses():
            if u not in scope.visible:
                if u in scope.closed:
                    raise KirError(f"{where}: reads {u}, defined inside {scope.closed[u]} and read outside it")
                raise KirError(f"{where}: reads {u}, which nothing defines before it")
        if isinstance(x, n.Name) and scope.visible[x.id][0] != x.dims:
            raise KirError(f"{where}: {x.id} is read as [{', '.join(x.dims)}], "
                           f"its definition has [{', '.join(scope.visible[x.id][0])}]")
        if isinstance(x, n.BinOp):
            _same(where, f"the operands of {x.op}", (x.left, x.right))
        elif isinstance(x, n.Call) and n.TL[x.fn] == "elementwise":
            _same(where, f"the arguments of {x.fn}", x.args)
        elif isinstance(x, n.Template):
            _same(where, "the operands of a registry function", tuple(a for _, a in x.args))
        elif isinstance(x, n.Broadcast) and not _is_subsequence(x.x.dims, x.to):
            raise KirError(f"{where}: broadcasts [{', '.join(x.x.dims)}] to [{', '.join(x.to)}], "
                           "which lacks some of its dims or has them in another order")
        elif isinstance(x, n.Permute) and (len(x.frm) != len(x.x.dims) or sorted(x.frm) != sorted(x.to)):
            raise KirError(f"{where}: renames [{', '.join(x.x.dims)}] to [{', '.join(x.frm)}] "
                           f"and permutes them to [{', '.join(x.to)}]")
        elif isinstance(x, n.Scan) and x.over not in x.x.dims:
            raise KirError(f"{where}: scans over {x.over}, not a dim of [{', '.join(x.x.dims)}]")
        elif isinstance(x, n.Reduce) and x.over is not None and x.over not in x.x.dims:
            raise KirError(f"{where}: reduces over {x.over}, not a dim of [{', '.join(x.x.dims)}]")
        elif isinstance(x, n.Dot):
            a, b = x.a.dims, x.b.dims
            if len(a) != 2 or len(b) != 2 or a[1] != b[0] or a[0] == b[1]:
                raise KirError(f"{where}: a matrix product of [{', '.join(a)}] and [{', '.join(b)}] "
                               "(wants [m, c] @ [c, n], m and n apart)")
        elif isinstance(x, n.Trans) and len(x.x.dims) != 2:
            raise KirError(f"{where}: transposes [{', '.join(x.x.dims)}], not a matrix")
        elif isinstance(x, n.BroadcastTo) and not _is_subsequence(x.x.dims, x.like.dims):
            raise KirError(f"{where}: broadcasts [{', '.join(x.x.dims)}] to the shape of "
                           f"{x.like.id} [{', '.join(x.like.dims)}]")
        elif isinstance(x, n.Gather) and (x.index.dims != x.x.dims or not 0 <= x.axis < len(x.x.dims)):
            raise KirError(f"{where}: gathers [{', '.join(x.x.dims)}] along axis {x.axis} "
                           f"at an index of [{', '.join(x.index.dims)}]")
        elif isinstance(x, n.SubchunkSum) and (x.x.dims != x.like.dims or len(x.x.dims) != 2):
            raise KirError(f"{where}: sums the sub-chunks of [{', '.join(x.x.dims)}] "
                           f"shaped as {x.like.id} [{', '.join(x.like.dims)}]")
        elif isinstance(x, n.Load):
            _same(where, "a load's offsets and mask", tuple(m for m in (*x.offsets, x.mask) if m is not None))


def _same(where: str, what: str, operands) -> None:
    dims = {o.dims for o in operands if o.dims}
    if len(dims) > 1:
        shown = " and ".join(f"[{', '.join(d)}]" for d in sorted(dims))
        raise KirError(f"{where}: {what} have different dims, {shown} (broadcast one by name first)")


def _where(s: n.Stmt) -> str:
    """The statement as printed (its first line), to name it in an error."""
    try:
        line = printer.stmt(s, comments=False)[0].strip()
    except (ValueError, TypeError, AssertionError):       # too broken to print
        line = f"{type(s).__name__} {getattr(s, 'name', '')}".strip()
    return f"`{line[:100]}`"


def _block(stmts, scope: _Scope, label: str) -> dict[str, tuple[n.Dims, str]]:
    """Check a block's statements in order; the names it defined (new ones only)."""
    new: dict[str, tuple[n.Dims, str]] = {}
    for s in stmts:
        where = _where(s)
        for e in n.stmt_exprs(s):
            _check_expr(e, scope, where)
        if isinstance(s, n.Let):
            if s.dtype not in n.DTYPES:
                raise KirError(f"{where}: dtype {s.dtype!r} is none of {', '.join(n.DTYPES)}")
            got = dtype_of(s.value, lambda x: scope.visible[x][1] if x in scope.visible else None)
            if got is not None and got != s.dtype:
                raise KirError(f"{where}: declared {s.dtype}, its value is {got}")
            if s.value.dims != s.dims:
                raise KirError(f"{where}: the value has dims [{', '.join(s.value.dims)}], "
                               f"the Let says [{', '.join(s.dims)}]")
            if s.name in scope.visible:
                if scope.visible[s.name] != (s.dims, s.dtype):
                    old = scope.visible[s.name]
                    raise KirError(f"{where}: re-assigns {s.name} as [{', '.join(s.dims)}] {s.dtype}, "
                                   f"defined as [{', '.join(old[0])}] {old[1]}")
            else:
                new[s.name] = (s.dims, s.dtype)
                scope.visible[s.name] = (s.dims, s.dtype)
                scope.closed.pop(s.name, None)
        elif isinstance(s, n.Acc):
            if s.name not in scope.visible:
                raise KirError(f"{where}: adds into {s.name}, which nothing defines before it")
            if scope.visible[s.name][0] != s.value.dims:
                raise KirError(f"{where}: adds [{', '.join(s.value.dims)}] into {s.name} "
                               f"[{', '.join(scope.visible[s.name][0])}]")
        elif isinstance(s, n.Store):
            _same(where, "a store's offsets, value and mask",
                  tuple(x for x in (*s.offsets, s.value, s.mask) if x is not None))
        elif isinstance(s, n.For):
            if s.start.dims or s.stop.dims:
                raise KirError(f"{where}: a loop's bounds must be scalars")
            inner = _Scope(dict(scope.visible), scope.closed, scope.constexprs)
            look = lambda x: scope.visible[x][1] if x in scope.visible else None     # noqa: E731
            var_dtype = dtype_of(n.BinOp("+", s.start, s.stop), look) or "i64"
            if s.var not in inner.visible:
                inner.visible[s.var] = ((), var_dtype)
            defined = _block(s.body, inner, f"the loop over {s.var}")
            if s.var not in scope.visible:
                defined[s.var] = ((), var_dtype)
            for name in defined:
                scope.closed[name] = f"the loop over {s.var}"
        elif isinstance(s, n.If):
            if s.cond.dims:
                raise KirError(f"{where}: an If's condition must be a scalar")
            then = _block(s.body, _Scope(dict(scope.visible), scope.closed, scope.constexprs), "an If")
            other = _block(s.orelse, _Scope(dict(scope.visible), scope.closed, scope.constexprs), "an else")
            for name in then.keys() | other.keys():
                if name in then and name in other:
                    both = then[name]
                    if then[name] != other[name]:
                        folded = isinstance(s.cond, n.Name) and s.cond.id in scope.constexprs
                        if not folded or then[name][0] != other[name][0]:
                            raise KirError(f"{where}: the branches define {name} with different dims or dtypes")
                        both = (then[name][0], promote(then[name][1], other[name][1]))
                    new[name] = both
                    scope.visible[name] = both
                else:
                    scope.closed[name] = f"one branch of `if {printer.expr(s.cond)}`"
    return new


def verify_block(stmts, defined: dict[str, tuple[n.Dims, str]] | None = None,
                 constexprs: frozenset[str] = frozenset()) -> None:
    """Check statements given the names defined before them (name -> (dims, dtype)) and the
    constexpr arguments among them."""
    _block(tuple(stmts), _Scope(dict(defined or {}), {}, constexprs), "the kernel")


def verify(kernel: n.Kernel) -> n.Kernel:
    """Check a kernel (its arguments are scalars and pointers); returns it, or raises KirError
    naming the statement and the rule."""
    names = kernel.arg_names
    if len(set(names)) != len(names):
        raise KirError(f"{kernel.name}: an argument appears twice")
    verify_block(kernel.body, {a.name: ((), a.dtype) for line in kernel.args for a in line.args},
                 frozenset(a.name for line in kernel.args for a in line.args if a.constexpr))
    return kernel

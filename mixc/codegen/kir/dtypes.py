"""The kernel IR's dtypes: Triton's promotion over the dtypes a Let may hold (nodes.DTYPES) and
the dtype of an expression's value where it is known (the verifier checks a Let against it,
the builders declare it)."""
from __future__ import annotations

from .nodes import (Arange, BinOp, Broadcast, BroadcastTo, Cast, Call, COMPARISONS, Const, Dot, Expr, Gather,
                    Helper, Name, Neg, Num, Permute, Reduce, Scan, SubchunkSum, TL, Template, Trans, Zeros, ZerosLike)

_ORDER = ("i1", "i32", "i64", "f32")            # Triton's promotion, narrowest first
_CASTS = {"tl.float32": "f32", "tl.int64": "i64", "tl.int32": "i32", "tl.int1": "i1"}
_FLOAT_FNS = ("tl.exp", "tl.log", "tl.sqrt", "tl.sigmoid", "tl.erf", "tl.floor")


def _promote(*dts: str | None) -> str | None:
    if any(d is None for d in dts):
        return None
    if "ptr" in dts:                # a pointer plus offsets: addresses
        return "ptr"
    return max(dts, key=_ORDER.index)


def promote(a: str, b: str) -> str:
    """The wider of two known dtypes (Triton's promotion)."""
    return _promote(a, b)


def dtype_of(e: Expr, names) -> str | None:
    """The dtype of an expression's value ("i1", "i32", "i64", "f32"), `names` giving each
    name's (a callable or a mapping); None where it is not known here (a load not cast, a
    buffer's element type, text)."""
    look = names if callable(names) else names.get
    if isinstance(e, Name):
        return look(e.id)
    if isinstance(e, Num):
        return "i1" if isinstance(e.value, bool) else "i32" if isinstance(e.value, int) else "f32"
    if isinstance(e, (Arange,)):
        return "i32"
    if isinstance(e, (Zeros, Template)):
        return "f32"
    if isinstance(e, Dot):
        return "f32"
    if isinstance(e, (Neg, Broadcast, Permute, Reduce, Scan, Trans, BroadcastTo, Gather, SubchunkSum)):
        return dtype_of(e.x, names)
    if isinstance(e, ZerosLike):
        return "f32" if e.f32 else dtype_of(e.like, names)
    if isinstance(e, Helper):
        return "f32"
    if isinstance(e, Cast):
        return _CASTS.get(e.to.text) if isinstance(e.to, Const) else None
    if isinstance(e, BinOp):
        if e.op in COMPARISONS or e.op in ("and", "or"):
            return "i1"
        if e.op == "/":
            return "f32"
        return _promote(dtype_of(e.left, names), dtype_of(e.right, names))
    if isinstance(e, Call):
        if TL[e.fn] == "scalar":
            return None if e.fn == "tl.debug_barrier" else "i32"
        if e.fn in _FLOAT_FNS:
            return "f32"
        args = e.args[1:] if e.fn == "tl.where" else e.args
        return _promote(*[dtype_of(a, names) for a in args])
    return None

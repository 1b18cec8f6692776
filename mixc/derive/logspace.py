"""The log of a decay on the IR, rewritten so that no exp is taken first (the IR twin of
functions.log_of, for code generation): log(exp(x)) = x, log(sigmoid(x)) = logsigmoid(x),
log(a * b) = log a + log b, log(a ** p) = p log a; lets are looked through."""
from __future__ import annotations

import math

from ..dsl import ir, scalar
from . import affine


def log_ir(mixer: ir.MixerIR, e: ir.Expr) -> ir.Expr:
    if isinstance(e, ir.Ref) and e.kind == "let":
        return log_ir(mixer, mixer.let(e.name).expr)
    if isinstance(e, ir.BinOp) and e.op == "*":
        return affine.add(log_ir(mixer, e.left), log_ir(mixer, e.right))
    if isinstance(e, ir.BinOp) and e.op == "/":
        return affine.add(log_ir(mixer, e.left), log_ir(mixer, e.right), "-")
    if isinstance(e, ir.BinOp) and e.op == "**":
        p = _constant(e.right)
        if p is not None and p == int(p) and p % 2 == 0 and not _positive(mixer, e.left):
            # an even power of a base that may be negative (tanh(g) ** 2, a decay the chunked
            # forms accept): p log a was NaN there, p log |a| is its log
            return affine.mul(e.right, ir.Call(e.left.shape, None, "log", (ir.Call(e.left.shape, None, "abs", (e.left,)),)))
        return affine.mul(e.right, log_ir(mixer, e.left))
    if isinstance(e, ir.Call) and e.fn == "exp":
        return e.args[0]
    if isinstance(e, ir.Call) and e.fn == "sigmoid":
        return ir.Call(e.shape, None, "logsigmoid", e.args)
    if isinstance(e, ir.Num) and e.value > 0:
        return affine.num(math.log(e.value))
    return ir.Call(e.shape, None, "log", (e,))


def _constant(e: ir.Expr) -> float | None:
    try:
        return scalar.evaluate(e)
    except (scalar.NotConstant, scalar.ScalarError):
        return None


def _positive(mixer: ir.MixerIR, e: ir.Expr) -> bool:
    """e > 0 for every input, by its form (exp, sigmoid, softplus of anything; products,
    quotients, sums and powers of such; a positive number); False where undecided."""
    if isinstance(e, ir.Ref) and e.kind == "let":
        return _positive(mixer, mixer.let(e.name).expr)
    if isinstance(e, ir.Num):
        return e.value > 0
    if isinstance(e, ir.Call):
        return e.fn in ("exp", "sigmoid", "softplus")
    if isinstance(e, ir.BinOp) and e.op in ("*", "/", "+"):
        return _positive(mixer, e.left) and _positive(mixer, e.right)
    if isinstance(e, ir.BinOp) and e.op == "**":
        return _positive(mixer, e.left)
    return False

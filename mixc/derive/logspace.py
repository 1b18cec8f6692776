"""The log of a decay on the IR, rewritten so that no exp is taken first (the IR twin of
functions.log_of, for code generation): log(exp(x)) = x, log(sigmoid(x)) = logsigmoid(x),
log(a * b) = log a + log b, log(a ** p) = p log a; lets are looked through."""
from __future__ import annotations

import math

from ..dsl import ir
from . import affine


def log_ir(mixer: ir.MixerIR, e: ir.Expr) -> ir.Expr:
    if isinstance(e, ir.Ref) and e.kind == "let":
        return log_ir(mixer, mixer.let(e.name).expr)
    if isinstance(e, ir.BinOp) and e.op == "*":
        return affine.add(log_ir(mixer, e.left), log_ir(mixer, e.right))
    if isinstance(e, ir.BinOp) and e.op == "/":
        return affine.add(log_ir(mixer, e.left), log_ir(mixer, e.right), "-")
    if isinstance(e, ir.BinOp) and e.op == "**":
        return affine.mul(e.right, log_ir(mixer, e.left))
    if isinstance(e, ir.Call) and e.fn == "exp":
        return e.args[0]
    if isinstance(e, ir.Call) and e.fn == "sigmoid":
        return ir.Call(e.shape, None, "logsigmoid", e.args)
    if isinstance(e, ir.Num) and e.value > 0:
        return affine.num(math.log(e.value))
    return ir.Call(e.shape, None, "log", (e,))

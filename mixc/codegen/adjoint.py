"""Reverse mode over the kernel IR of one token: from the forward Emitter's record of which
IR node each temporary holds, emit the kir statements that carry an output gradient back to
every leaf (inputs, params, lets, states). Broadcasting by dim name makes each rule a
product followed by a masked sum over the dims the operand lacks."""
from __future__ import annotations

import math
from collections import defaultdict

from ..dsl import ir
from ..dsl.functions import FUNCTIONS
from .kir import nodes as K
from .triton_expr import Emitter, canon, constant_exponent


def leaf_key(e: ir.Expr) -> tuple[str, str] | None:
    """Leaves whose gradients leave the expression: ('input'|'param'|'let'|'state'|'readout'|'prev', name)."""
    if isinstance(e, ir.Ref) and e.kind in ("input", "param", "let", "state", "readout"):
        return e.kind, e.name
    if isinstance(e, ir.Prev):
        return "prev", e.state
    return None


def combine(em: Emitter, parts) -> tuple[str, tuple[str, ...]] | None:
    """The sum of gradient contributions (broadcast to the union of their dims), emitted in em."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    dims = canon(em.order, set().union(*[set(p[1]) for p in parts]))
    total = em.bcast(*parts[0], dims)
    for v, d in parts[1:]:
        total = K.BinOp("+", total, em.bcast(v, d, dims))
    return em.emit(total, dims)


def _mul(*xs: K.Expr) -> K.Expr:
    out = xs[0]
    for x in xs[1:]:
        out = K.BinOp("*", out, x)
    return out


class Adjoint:
    """Emit the backward of expressions computed by `fwd` (its statements, in a second Emitter
    that shares fwd's environment and values)."""

    def __init__(self, fwd: Emitter, prefix: str):
        self.f = fwd
        self.order = fwd.order
        self.out = Emitter(fwd.m, fwd.env, indent=fwd.indent, prefix=prefix, order=fwd.order, values=fwd.values)
        self.leaves: dict[tuple[str, str], list[tuple[str, tuple[str, ...]]]] = defaultdict(list)

    @property
    def lines(self) -> list[str]:
        return self.out.lines

    @property
    def stmts(self) -> list[K.Let]:
        return self.out.stmts

    def emit(self, code: K.Expr, dims):
        return self.out.emit(code, tuple(dims))

    def unbroadcast(self, g: tuple[str, tuple[str, ...]], want: tuple[str, ...]):
        """Sum g over the dims `want` lacks (broadcasting's adjoint); where g lacks some of
        want's dims, broadcasting is implicit."""
        var, dims = g
        extra = tuple(d for d in dims if d not in want)
        if extra:
            var, dims = self.out.reduce(var, dims, extra)
        return var, dims

    def backward(self, root: ir.Expr, seed: tuple[str, tuple[str, ...]]) -> None:
        """Accumulate d(root) = seed into every leaf of root."""
        nodes = self._topo(root)
        grads: dict[ir.Expr, list[tuple[str, tuple[str, ...]]]] = defaultdict(list)
        # a seed may carry axes the value lacks (a unit axis, a broadcast): sum them away
        grads[root].append(self.unbroadcast(seed, self.f(root)[1]))
        for node in reversed(nodes):
            if node not in grads:
                continue
            g = combine(self.out, grads.pop(node))
            key = leaf_key(node)
            if key is not None:
                self.leaves[key].append(g)
                continue
            for child, contrib in self._rule(node, g):
                grads[child].append(contrib)

    def leaf_parts(self, key) -> list[tuple[str, tuple[str, ...]]]:
        """The contributions to a leaf's gradient (summed by the caller, where it needs them)."""
        return list(self.leaves.get(key, ()))

    # ---- helpers ----
    def _topo(self, root: ir.Expr) -> list[ir.Expr]:
        """Nodes of root, children before parents (each distinct node once)."""
        order, seen = [], set()
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                if node not in seen:
                    seen.add(node)
                    order.append(node)
                continue
            if node in seen:
                continue
            stack.append((node, True))
            for c in ir.children(node):
                stack.append((c, False))
        return order

    def val(self, node: ir.Expr):
        return self.f(node)          # cached: the forward value of node

    def full(self, node: ir.Expr, dims) -> K.Expr:
        """The forward value of node broadcast to dims."""
        v, d = self.f(node)
        return self.out.bcast(v, d, dims)

    def _rule(self, node: ir.Expr, g):
        gv, gd = g
        G = self.out.value(gv, gd)
        if isinstance(node, ir.Neg):
            return [(node.x, self.emit(K.Neg(G), gd))]
        if isinstance(node, ir.BinOp):
            return self._binop(node, g)
        if isinstance(node, ir.Contract):
            # axes of the forward values (a chunk's values carry the token axis too)
            out = []
            ld, rd = self.val(node.left)[1], self.val(node.right)[1]
            full = canon(self.order, set(ld) | set(rd) | set(gd))
            for this, other, td in ((node.left, node.right, ld), (node.right, node.left, rd)):
                prod = self.emit(K.BinOp("*", self.out.bcast(gv, gd, full), self.full(other, full)), full)
                out.append((this, self.unbroadcast(prod, td)))
            return out
        if isinstance(node, ir.Call):
            return self._call(node, g)
        if isinstance(node, ir.Reduce):
            xv, xd = self.val(node.x)
            X = self.f.value(xv, xd)
            g_full = self.out.bcast(gv, gd, xd)
            if node.fn == "sum":
                return [(node.x, self.emit(K.BinOp("+", g_full, K.BinOp("*", K.Num(0.0), X)), xd))]
            O = self.full(node, xd)
            if node.fn == "norm":
                return [(node.x, self.emit(K.BinOp("/", K.BinOp("*", g_full, X), O), xd))]
            return [(node.x, self.emit(K.Call("tl.where", (K.BinOp("==", X, O), g_full, K.Num(0.0))), xd))]
        if isinstance(node, ir.Rename):
            back = {b: a for a, b in node.mapping}
            renamed = tuple(back.get(d, d) for d in gd)
            want = canon(self.order, renamed)
            view = K.Permute(G, renamed, want)
            if renamed == want:
                self.out.values[(gv, want)] = view
                return [(node.x, (gv, want))]
            return [(node.x, self.emit(view, want))]
        return []                     # numbers, dims, head: no gradient

    def _binop(self, node: ir.BinOp, g):
        gv, gd = g
        a, b = node.left, node.right
        ad, bd = self.val(a)[1], self.val(b)[1]
        full = canon(self.order, set(ad) | set(bd) | set(gd))
        G, A, B = self.out.bcast(gv, gd, full), self.full(a, full), self.full(b, full)
        unb = self.unbroadcast
        if node.op == "+":
            return [(a, unb(g, ad)), (b, unb(g, bd))]
        if node.op == "-":
            return [(a, unb(g, ad)), (b, unb(self.emit(K.Neg(self.out.value(gv, gd)), gd), bd))]
        if node.op == "*":
            return [(a, unb(self.emit(_mul(G, B), full), ad)), (b, unb(self.emit(_mul(G, A), full), bd))]
        if node.op == "/":
            ga = self.emit(K.BinOp("/", G, B), full)
            gb = self.emit(K.BinOp("/", _mul(K.Neg(G), A), _mul(B, B)), full)
            return [(a, unb(ga, ad)), (b, unb(gb, bd))]
        # power
        O = self.full(node, full)
        p = constant_exponent(b)
        if p is not None:
            if p == int(p):             # p a^(p-1), itself an integer power: right for a <= 0
                if p == 0:
                    return []
                code = _mul(G, K.Num(float(p)), self.out.int_power_expr(A, full, int(p) - 1))
            elif p == 0.5:
                code = K.BinOp("/", _mul(G, K.Num(0.5)), O)
            else:                       # p a^(p-1) as a power, not p O / a: 0/0 at a = 0
                code = _mul(G, K.Num(float(p)), K.Call("tl.exp", (_mul(K.Num(float(p - 1)), K.Call("tl.log", (A,))),)))
            return [(a, unb(self.emit(code, full), ad))]
        out = []
        if isinstance(a, ir.Num):
            out.append((b, unb(self.emit(_mul(G, O, K.Num(math.log(a.value))), full), bd)))
            return out
        out.append((a, unb(self.emit(K.BinOp("/", _mul(G, B, O), A), full), ad)))
        out.append((b, unb(self.emit(_mul(G, O, K.Call("tl.log", (A,))), full), bd)))
        return out

    def _call(self, node: ir.Call, g):
        gv, gd = g
        if node.fn in ("max", "min"):
            a, b = node.args
            ad, bd = self.val(a)[1], self.val(b)[1]
            full = canon(self.order, set(ad) | set(bd) | set(gd))
            A, B, G = self.full(a, full), self.full(b, full), self.out.bcast(gv, gd, full)
            pick = self.out.value(*self.emit(K.BinOp(">=" if node.fn == "max" else "<=", A, B), full))
            return [(a, self.unbroadcast(self.emit(K.Call("tl.where", (pick, G, K.Num(0.0))), full), ad)),
                    (b, self.unbroadcast(self.emit(K.Call("tl.where", (pick, K.Num(0.0), G)), full), bd))]
        if node.fn == "detach":         # held constant: no gradient passes
            return []
        x = node.args[0]
        # the registry's derivative, dsl/functions.py
        deriv = K.Template(FUNCTIONS[node.fn].triton_derivative,
                           (("x", self.f.value(*self.val(x))), ("y", self.f.value(*self.val(node)))))
        return [(x, self.emit(K.BinOp("*", self.out.value(gv, gd), deriv), self.val(x)[1]))]

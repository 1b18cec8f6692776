"""Reverse mode over the Triton code of one token: from the forward Emitter's record of which
IR node each temporary holds, emit the statements that carry an output gradient back to
every leaf (inputs, params, lets, states). Broadcasting by dim name makes each rule a
product followed by a masked sum over the dims the operand lacks."""
from __future__ import annotations

import math
from collections import defaultdict

from ..dsl import ir
from ..dsl.functions import FUNCTIONS
from .triton_expr import Emitter, canon, constant_exponent, expand, number


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
    return em.emit(" + ".join(expand(v, d, dims) for v, d in parts), dims)


class Adjoint:
    """Emit the backward of expressions computed by `fwd` into fwd's statement list style."""

    def __init__(self, fwd: Emitter, prefix: str):
        self.f = fwd
        self.order = fwd.order
        self.out = Emitter(fwd.m, fwd.env, indent=fwd.indent, prefix=prefix, order=fwd.order)
        self.leaves: dict[tuple[str, str], list[tuple[str, tuple[str, ...]]]] = defaultdict(list)

    @property
    def lines(self) -> list[str]:
        return self.out.lines

    def emit(self, code: str, dims):
        return self.out.emit(code, tuple(dims))

    def unbroadcast(self, g: tuple[str, tuple[str, ...]], want: tuple[str, ...]):
        """Sum g over the dims `want` lacks (broadcasting's adjoint)."""
        var, dims = g
        extra = tuple(d for d in dims if d not in want)
        if extra:
            var, dims = self.out.reduce(var, dims, extra)
        if set(dims) != set(want):          # g lacks some of want's dims: broadcast is implicit
            return var, dims
        return var, dims

    def backward(self, root: ir.Expr, seed: tuple[str, tuple[str, ...]]) -> None:
        """Accumulate d(root) = seed into every leaf of root."""
        nodes = self._topo(root)
        grads: dict[ir.Expr, list[tuple[str, tuple[str, ...]]]] = defaultdict(list)
        # a seed may carry axes the value lacks (a unit axis, a broadcast): sum them away
        grads[root].append(self.unbroadcast(seed, self.val(root)[1]))
        for node in reversed(nodes):
            if node not in grads:
                continue
            g = self._sum(grads.pop(node), node.shape)
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

    def _sum(self, parts, shape=None):
        return combine(self.out, parts)

    def val(self, node: ir.Expr):
        return self.f(node)          # cached: the forward value of node

    def _rule(self, node: ir.Expr, g):
        gv, gd = g
        if isinstance(node, ir.Neg):
            return [(node.x, self.emit(f"-{gv}", gd))]
        if isinstance(node, ir.BinOp):
            return self._binop(node, g)
        if isinstance(node, ir.Contract):
            # axes of the forward values (a chunk's values carry the token axis too)
            out = []
            ld, rd = self.val(node.left)[1], self.val(node.right)[1]
            full = canon(self.order, set(ld) | set(rd) | set(gd))
            for this, other, td in ((node.left, node.right, ld), (node.right, node.left, rd)):
                ov, od = self.val(other)
                prod = self.emit(f"{expand(gv, gd, full)} * {expand(ov, od, full)}", full)
                out.append((this, self.unbroadcast(prod, td)))
            return out
        if isinstance(node, ir.Call):
            return self._call(node, g)
        if isinstance(node, ir.Reduce):
            xv, xd = self.val(node.x)
            g_full = expand(gv, gd, xd)
            if node.fn == "sum":
                return [(node.x, self.emit(f"{g_full} + 0.0 * {xv}", xd))]
            ov, od = self.val(node)
            if node.fn == "norm":
                return [(node.x, self.emit(f"{g_full} * {xv} / {expand(ov, od, xd)}", xd))]
            return [(node.x, self.emit(f"tl.where({xv} == {expand(ov, od, xd)}, {g_full}, 0.0)", xd))]
        if isinstance(node, ir.Rename):
            back = {b: a for a, b in node.mapping}
            renamed = tuple(back.get(d, d) for d in gd)
            want = canon(self.order, renamed)
            if renamed == want:
                return [(node.x, (gv, want))]
            return [(node.x, self.emit(f"tl.permute({gv}, {tuple(renamed.index(d) for d in want)})", want))]
        return []                     # numbers, dims, head: no gradient

    def _binop(self, node: ir.BinOp, g):
        gv, gd = g
        a, b = node.left, node.right
        (av, ad), (bv, bd) = self.val(a), self.val(b)
        full = canon(self.order, set(ad) | set(bd) | set(gd))
        G, A, B = expand(gv, gd, full), expand(av, ad, full), expand(bv, bd, full)
        unb = self.unbroadcast
        if node.op == "+":
            return [(a, unb(g, ad)), (b, unb(g, bd))]
        if node.op == "-":
            return [(a, unb(g, ad)), (b, unb(self.emit(f"-{gv}", gd), bd))]
        if node.op == "*":
            return [(a, unb(self.emit(f"{G} * {B}", full), ad)), (b, unb(self.emit(f"{G} * {A}", full), bd))]
        if node.op == "/":
            ga = self.emit(f"{G} / {B}", full)
            gb = self.emit(f"-{G} * {A} / ({B} * {B})", full)
            return [(a, unb(ga, ad)), (b, unb(gb, bd))]
        # power
        ov, od = self.val(node)
        O = expand(ov, od, full)
        p = constant_exponent(b)
        if p is not None:
            if p == int(p):             # p a^(p-1), itself an integer power: right for a <= 0
                if p == 0:
                    return []
                pm1, _ = self.out.int_power(A, full, int(p) - 1)
                code = f"{G} * {number(p)} * {pm1}"
            elif p == 0.5:
                code = f"{G} * 0.5 / {O}"
            else:                       # p a^(p-1) as a power, not p O / a: 0/0 at a = 0
                code = f"{G} * {number(p)} * tl.exp({number(p - 1)} * tl.log({A}))"
            return [(a, unb(self.emit(code, full), ad))]
        out = []
        if isinstance(a, ir.Num):
            out.append((b, unb(self.emit(f"{G} * {O} * {number(math.log(a.value))}", full), bd)))
            return out
        out.append((a, unb(self.emit(f"{G} * {B} * {O} / {A}", full), ad)))
        out.append((b, unb(self.emit(f"{G} * {O} * tl.log({A})", full), bd)))
        return out

    def _call(self, node: ir.Call, g):
        gv, gd = g
        if node.fn in ("max", "min"):
            a, b = node.args
            (av, ad), (bv, bd) = self.val(a), self.val(b)
            full = canon(self.order, set(ad) | set(bd) | set(gd))
            A, B, G = expand(av, ad, full), expand(bv, bd, full), expand(gv, gd, full)
            cmp = ">=" if node.fn == "max" else "<="
            pick = self.emit(f"{A} {cmp} {B}", full)
            return [(a, self.unbroadcast(self.emit(f"tl.where({pick[0]}, {G}, 0.0)", full), ad)),
                    (b, self.unbroadcast(self.emit(f"tl.where({pick[0]}, 0.0, {G})", full), bd))]
        if node.fn == "detach":         # held constant: no gradient passes
            return []
        x = node.args[0]
        xv, xd = self.val(x)
        ov, _ = self.val(node)
        deriv = FUNCTIONS[node.fn].triton_derivative.format(x=xv, y=ov)    # the registry, dsl/functions.py
        return [(x, self.emit(f"{gv} * ({deriv})", xd))]

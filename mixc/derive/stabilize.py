"""The max-stabilizer of exponential input gates (mLSTM's exp(i)).

A state written through an exponential gate, S_t = a_t S_{t-1} + exp(i_t) k_t v_t^T, grows
like exp(i) and overflows fp32 for i above ~88. The kernels keep instead

    S~_t = S_t exp(-m_t),    m_t = max(log a_t + m_{t-1}, i_t),    m_0 = 0,

so that every weight they form, exp(log a_t + m_{t-1} - m_t) and exp(i_t - m_t), is <= 1:

    S~_t = exp(log a_t + m_{t-1} - m_t) S~_{t-1} + exp(i_t - m_t) k_t v_t^T.

The output reads S_t = exp(m_t) S~_t. It is rewritten by positive homogeneity so that the
scale exp(m_t) cancels where it can: |E x| = E |x|, max(E x, y) = E max(x, y / E), and
(E x) / (E y) = x / y. mLSTM's  (q . C) / max(|q . n|, 1)  becomes
(q . C~) / max(|q . n~|, exp(-m)), the form of the xLSTM paper, with no exp(m) left.

m is a scale, not a value: the output is the same function of the inputs for any m, so the
backward holds m constant (`detach`) and the gradients stay exact.

States whose input term has a scalar exp(x) factor form one group when they share the gate x
and the decay (mLSTM's C and n); the group shares one m. Two different gates are not
stabilized (a note says so)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..dsl import ir
from . import affine
from .classes import PREFIX_SUM, SCALAR

M = "_m"                  # the stabilizer's name in the kernels (spec names never start with '_')


@dataclass(frozen=True)
class Stabilizer:
    states: tuple[str, ...]            # the group sharing m
    log_gate: ir.Expr                  # i_t: the exponent of the gate, a scalar per token
    log_decay: ir.Expr                 # log a_t of the group (0 for a prefix sum)
    keys: tuple[tuple[str, ir.Expr, ir.Expr | None], ...]   # (state, key, value) without exp(i)
    combine_ir: ir.Expr                # the output's combine over the stabilized readouts
    kernel_ir: ir.MixerIR              # the spec over S~ and the extra state _m (recurrent kernels)

    def key_value(self, state: str) -> tuple[ir.Expr, ir.Expr | None]:
        return next((k, v) for s, k, v in self.keys if s == state)


def m_ref(kind: str = "state") -> ir.Ref:
    return ir.Ref((), None, M, kind)


def call(fn: str, *args: ir.Expr) -> ir.Call:
    return ir.Call(affine.union(*(a.shape for a in args)), None, fn, tuple(args))


def _factors(e: ir.Expr) -> list[ir.Expr]:
    if isinstance(e, ir.BinOp) and e.op == "*":
        return _factors(e.left) + _factors(e.right)
    return [e]


def split_gate(e: ir.Expr | None) -> tuple[ir.Expr | None, ir.Expr | None]:
    """(x, rest) when e = exp(x) * rest with x a scalar per token; (None, e) otherwise."""
    if e is None:
        return None, None
    fs = _factors(e)
    for i, f in enumerate(fs):
        if isinstance(f, ir.Call) and f.fn == "exp" and not f.shape:
            rest = fs[:i] + fs[i + 1:]
            return f.args[0], functools.reduce(affine.mul, rest) if rest else None
    return None, e


def find(spec: ir.MixerIR, states, combine_ir: ir.Expr, readouts, notes: list[str]) -> Stabilizer | None:
    """The stabilizer of a plan's states (StatePlans), or None where no state has an
    exponential input gate."""
    gated = []
    for st in states:
        p = st.ir_pieces
        if p is None or p.key is None:
            continue
        gate, key = split_gate(p.key)
        value = p.value
        if gate is None:
            gate, value = split_gate(p.value)
        if gate is None:
            continue
        if st.transition not in (SCALAR, PREFIX_SUM):
            notes.append(f"state {st.name} has an exponential input gate but a {st.transition}: not stabilized")
            return None
        log_decay = p.log_decay if st.transition == SCALAR else affine.num(0)
        gated.append((st.name, gate, log_decay, key if key is not None else affine.num(1), value))
    if not gated:
        return None
    if len({(g, d) for _, g, d, _, _ in gated}) > 1:
        notes.append("states with different exponential input gates or decays: not stabilized")
        return None
    _, gate, log_decay, _, _ = gated[0]
    group = tuple(s for s, _, _, _, _ in gated)
    keys = tuple((s, k, v) for s, _, _, k, v in gated)
    readers = {r.name for r in readouts if r.state in group}
    combine = rewrite(combine_ir, lambda e: isinstance(e, ir.Ref) and e.kind == "readout" and e.name in readers,
                      m_ref("stabilizer"))
    return Stabilizer(group, gate, log_decay, keys, combine, _kernel_ir(spec, group, gate, log_decay, keys))


def _kernel_ir(spec: ir.MixerIR, group, gate, log_decay, keys) -> ir.MixerIR:
    """The spec over the stabilized states S~ and the extra state _m (read by prev rules:
    Ref(_m) in an update is m_{t-1}, in the output m_t)."""
    m_prev = call("detach", m_ref())
    m_new = call("detach", call("max", affine.add(log_decay, m_prev), gate))
    updates = []
    for u in spec.updates:
        if u.state not in group:
            updates.append(u)
            continue
        key, value = next((k, v) for s, k, v in keys if s == u.state)
        S = ir.Ref(spec.state(u.state).shape, None, u.state, "state")
        carry = affine.mul(call("exp", affine.add(affine.add(log_decay, m_prev), m_new, "-")), S)
        write = affine.mul(affine.mul(call("exp", affine.add(gate, m_new, "-")), key), value)
        updates.append(replace(u, expr=affine.add(carry, write)))
    updates.append(ir.Update(M, m_new, None))

    def leaf(e):
        return ((isinstance(e, ir.Ref) and e.kind == "state" and e.name in group)
                or (isinstance(e, ir.Prev) and e.state in group))

    m_t = call("detach", m_ref())
    out = rewrite(spec.output.expr, leaf, m_t,
                  prev_scale=call("exp", affine.add(call("detach", ir.Prev((), None, M)), m_t, "-")))
    return replace(spec, states=spec.states + (ir.TensorDecl(M, (), None),), updates=tuple(updates),
                   output=replace(spec.output, expr=out))


def rewrite(e: ir.Expr, is_scaled, m: ir.Expr, prev_scale: ir.Expr | None = None) -> ir.Expr:
    """e with every leaf L where is_scaled(L) replaced by exp(m) L, the factor pulled out by
    positive homogeneity (module docstring), and what is left of it applied at the end.
    A Prev leaf is exp(m_{t-1}) L = exp(m) (prev_scale L)."""
    def scale(x: ir.Expr, d: float) -> ir.Expr:
        if d == 0:
            return x
        e = call("exp", m if d == 1 else ir.Neg((), None, m) if d == -1 else affine.mul(affine.num(d), m))
        return e if isinstance(x, ir.Num) and x.value == 1 else affine.mul(x, e)

    def pull(node: ir.Expr) -> tuple[float, ir.Expr]:
        if is_scaled(node):
            return 1.0, affine.mul(prev_scale, node) if isinstance(node, ir.Prev) else node
        kids = ir.children(node)
        if not kids:
            return 0.0, node
        parts = [pull(k) for k in kids]
        degs = [d for d, _ in parts]
        xs = [x for _, x in parts]
        if not any(degs):
            return 0.0, affine._with_children(node, xs)
        if isinstance(node, (ir.Neg, ir.Rename)) or (isinstance(node, ir.Reduce)) or \
                (isinstance(node, ir.Call) and node.fn in ("abs", "detach")):
            return degs[0], affine._with_children(node, xs)
        if isinstance(node, ir.Call) and node.fn == "sqrt":
            return degs[0] / 2, affine._with_children(node, xs)
        if isinstance(node, ir.Contract) or (isinstance(node, ir.BinOp) and node.op == "*"):
            return degs[0] + degs[1], affine._with_children(node, xs)
        if isinstance(node, ir.BinOp) and node.op == "/":
            return degs[0] - degs[1], affine._with_children(node, xs)
        if isinstance(node, ir.BinOp) and node.op == "**" and isinstance(node.right, ir.Num) and degs[1] == 0:
            return degs[0] * node.right.value, affine._with_children(node, xs)
        if (isinstance(node, ir.BinOp) and node.op in "+-") or (isinstance(node, ir.Call) and node.fn in ("max", "min")):
            d = max(degs)                       # the larger scale comes out, the other operand
            return d, affine._with_children(node, [scale(x, dx - d) for x, dx in zip(xs, degs)])
        return 0.0, affine._with_children(node, [scale(x, dx) for x, dx in zip(xs, degs)])

    d, out = pull(e)
    return scale(out, d)

"""The max-stabilizer of exponential input gates (mLSTM's exp(i)).

A state written through an exponential gate, S_t = a_t S_{t-1} + exp(i_t) k_t v_t^T, grows
like exp(i) and overflows fp32 for i above ~88. The kernels keep instead

    S~_t = S_t exp(-m_t),    m_t = max(log a_t + m_{t-1}, i_t),    m_0 = 0,

so that every weight they form, exp(log a_t + m_{t-1} - m_t) and exp(i_t - m_t), is <= 1:

    S~_t = exp(log a_t + m_{t-1} - m_t) S~_{t-1} + exp(i_t - m_t) k_t v_t^T.

The output reads S_t = exp(m_t) S~_t. It is rewritten by positive homogeneity so that the
scale exp(m_t) cancels where it can: |E x| = E |x|, max(E x, y) = E max(x, y / E), and
(E x) / (E y) = x / y. mLSTM's  (q . C) / max(|q . n|, 1)  becomes
(q . C~) / max(|q . n~|, exp(-m)), the form of the xLSTM paper, with no exp(m) left (taken
over the scale M = max(m, 0) below, as its 1 has the scale 0).

An exponential the output adds to a stabilized readout (RWKV-4's WKV:
(prev(a) + exp(u + k) v) / (prev(b) + exp(u + k))) overflows on its own for u + k above ~88,
and inf / inf is NaN. The output takes one scale M, the largest log scale of its terms (m of
the readouts of S~, m_{t-1} of those of prev(S~), x of each such exp(x), 0 of a term with none
of these: mLSTM's 1), and every term is rewritten relative to it: S~ exp(m - M), exp(x - M),
exp(-M), each <= 1, so exp(M) cancels as above. This is M = max(pp, u + k) of RWKV-4's own
kernel.

m and M are scales, not values: the output is the same function of the inputs for any m, so
the backward holds them constant (`detach`) and the gradients stay exact.

States whose input term has a scalar exp(x) factor form one group when they share the gate x
and the decay (mLSTM's C and n); the group shares one m. Two different gates are not
stabilized (a note says so)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..dsl import ir
from . import affine
from .. import classes

M = "_m"                  # the stabilizer's name in the kernels (spec names never start with '_')
M_PREV = "_mp"            # in the chunked forms' combine: m_{t-1} per token, prev(S~)'s scale
# m of an empty state (no initial state given): below any log weight, so the first token sets m
# (m_0 = max(log a + M_EMPTY, i_0) = i_0) and a prev() readout at t = 0 weighs exp(M_EMPTY - M) = 0
# beside the output's other terms. m = 0 there made M = max(0, u + k) for RWKV-4's first token,
# whose only term exp(u + k - M) is 0 for u + k < -103: 0 / 0. Finite, not -inf: m - m is 0.
M_EMPTY = -1e30


@dataclass(frozen=True)
class Stabilizer:
    states: tuple[str, ...]            # the group sharing m
    log_gate: ir.Expr                  # i_t: the exponent of the gate, a scalar per token
    log_decay: ir.Expr                 # log a_t of the group (0 for a prefix sum)
    keys: tuple[tuple[str, ir.Expr, ir.Expr | None], ...]   # (state, key, value) without exp(i)
    combine_ir: ir.Expr                # the output's combine over the stabilized readouts
    output_exps: tuple[ir.Expr, ...]   # the output's exp(x) (or lets of one) brought to its scale M
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
        if not classes.unit(st.transition).stabilizable:
            notes.append(f"state {st.name} has an exponential input gate but a {st.transition}: not stabilized")
            return None
        log_decay = p.log_decay if classes.unit(st.transition).stabilizer_keeps_decay else affine.num(0)
        gated.append((st.name, gate, log_decay, key if key is not None else affine.num(1), value))
    if not gated:
        return None
    if len({(g, d) for _, g, d, _, _ in gated}) > 1:
        notes.append("states with different exponential input gates or decays: not stabilized")
        return None
    _, gate, log_decay, _, _ = gated[0]
    group = tuple(s for s, _, _, _, _ in gated)
    keys = tuple((s, k, v) for s, _, _, k, v in gated)
    readers = {r.name: r.prev for r in readouts if r.state in group}

    def readout_scale(e):
        """A readout of S~_t is at scale m_t, one of S~_{t-1} (prev) at its own m_{t-1}: taken
        at m_t instead, its weights exp(. - m_t) underflow where m jumps (a large gate) while
        the output's other terms are small (RWKV-4 with u < -87: 0 / 0)."""
        if isinstance(e, ir.Ref) and e.kind == "readout" and e.name in readers:
            return ir.Ref((), None, M_PREV, "stabilizer") if readers[e.name] else m_ref("stabilizer")
        return None

    exps = output_exps(spec, combine_ir, readout_scale)
    combine = common_scale(combine_ir, readout_scale, exps)
    return Stabilizer(group, gate, log_decay, keys, combine, tuple(exps),
                      _kernel_ir(spec, group, gate, log_decay, keys))


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

    def state_scale(e):          # S_t = exp(m_t) S~_t, S_{t-1} = exp(m_{t-1}) S~_{t-1}
        if isinstance(e, ir.Ref) and e.kind == "state" and e.name in group:
            return call("detach", m_ref())
        if isinstance(e, ir.Prev) and e.state in group:
            return call("detach", ir.Prev((), None, M))
        return None

    out = common_scale(spec.output.expr, state_scale, output_exps(spec, spec.output.expr, state_scale))
    return replace(spec, states=spec.states + (ir.TensorDecl(M, (), None),), updates=tuple(updates),
                   output=replace(spec.output, expr=out))


def _additive(node: ir.Expr) -> bool:
    """A sum, difference, max or min: its operands must share a scale."""
    return (isinstance(node, ir.BinOp) and node.op in "+-") or (isinstance(node, ir.Call) and node.fn in ("max", "min"))


def output_exps(spec: ir.MixerIR, e: ir.Expr, scale_of) -> dict[ir.Expr, ir.Expr]:
    """{exp(x) (or a let of one): x} for the scalar exponentials that a sum, max or min of e
    adds to a stabilized leaf (scale_of(leaf) is not None), as factors of a term free of such
    leaves: RWKV-4's exp(u + k) in (prev(a) + exp(u + k) * v) / (prev(b) + exp(u + k)). An
    exponential elsewhere (a factor of a readout's term, inside another function) is left as
    written: scaled by exp(-M) there it could underflow where the spec's value does not."""
    lets = {let.name: let.expr for let in spec.lets}

    def has_scaled(n):
        return any(scale_of(x) is not None for x in ir.walk(n))

    def exponent(n):
        if isinstance(n, ir.Ref) and n.kind == "let":
            n = lets.get(n.name)
        if isinstance(n, ir.Call) and n.fn == "exp" and not n.shape and not has_scaled(n.args[0]):
            return n.args[0]
        return None

    def factors(n):              # the exponentials the term n multiplies by
        if exponent(n) is not None:
            return [n]
        if isinstance(n, ir.BinOp) and n.op == "*" or isinstance(n, ir.Contract):
            return factors(n.left) + factors(n.right)
        if isinstance(n, ir.BinOp) and n.op == "/":
            return factors(n.left)
        if isinstance(n, (ir.Neg, ir.Rename)) or isinstance(n, ir.Reduce) and n.fn == "sum":
            return factors(n.x)
        return []

    found = {}
    for node in ir.walk(e):
        if _additive(node):
            kids = ir.children(node)
            scaled = [has_scaled(k) for k in kids]
            for k, s in zip(kids, scaled):
                if not s and any(scaled):
                    found.update((f, exponent(f)) for f in factors(k))
    return found


def common_scale(e: ir.Expr, scale_of, exps: dict[ir.Expr, ir.Expr]) -> ir.Expr:
    """e over one scale M: a leaf L with scale_of(L) = s stands for exp(s) L, an exponential
    of `exps` for exp(x); M is the largest of these log scales (detached), each leaf becomes
    exp(M) (L exp(s - M)) or exp(M) exp(x - M), and rewrite pulls exp(M) out. With one scale
    and no exponential M is that scale and the leaves stay as they are."""
    logs = list(dict.fromkeys([s for n in ir.walk(e) if (s := scale_of(n)) is not None] + list(exps.values())))
    if not logs:
        return e
    if _unscaled_term(e, lambda n: n in exps or scale_of(n) is not None):
        # a term with no scale (mLSTM's 1 in max(|q . n|, 1)) is at 0: in M too, so that its
        # exp(-M) stays <= 1 where m falls far below 0 (an empty state's m starts at M_EMPTY)
        logs.append(affine.num(0))
    big = functools.reduce(lambda a, b: call("max", a, b), logs)
    top = logs[0] if len(logs) == 1 else call("detach", big)

    def relative(n):
        s = exps[n] if n in exps else scale_of(n)
        if s == top:
            return affine.num(1) if n in exps else n
        w = call("exp", affine.add(s, top, "-"))
        return w if n in exps else affine.mul(w, n)

    return rewrite(e, lambda n: n in exps or scale_of(n) is not None, top, relative=relative)


def _unscaled_term(e: ir.Expr, is_scaled) -> bool:
    """Whether a sum, max or min in e adds a term with no scaled leaf (a constant, an input) to
    one with."""
    for node in ir.walk(e):
        if _additive(node):
            scaled = [any(is_scaled(x) for x in ir.walk(k)) for k in ir.children(node)]
            if any(scaled) and not all(scaled):
                return True
    return False


def rewrite(e: ir.Expr, is_scaled, m: ir.Expr, relative=None) -> ir.Expr:
    """e with every leaf L where is_scaled(L) replaced by exp(m) L (exp(m) relative(L) where
    relative is given), the factor pulled out by positive homogeneity (module docstring), and
    what is left of it applied at the end."""
    def scale(x: ir.Expr, d: float) -> ir.Expr:
        if d == 0:
            return x
        e = call("exp", m if d == 1 else ir.Neg((), None, m) if d == -1 else affine.mul(affine.num(d), m))
        return e if isinstance(x, ir.Num) and x.value == 1 else affine.mul(x, e)

    def pull(node: ir.Expr) -> tuple[float, ir.Expr]:
        if is_scaled(node):
            return 1.0, relative(node) if relative is not None else node
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
        if _additive(node):
            d = max(degs)                       # the larger scale comes out, the other operand
            return d, affine._with_children(node, [scale(x, dx - d) for x, dx in zip(xs, degs)])
        return 0.0, affine._with_children(node, [scale(x, dx) for x, dx in zip(xs, degs)])

    d, out = pull(e)
    return scale(out, d)

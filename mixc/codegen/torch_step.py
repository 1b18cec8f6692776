"""Plan -> the hooks of templates/torch_step.py.j2: the torch backend's recurrence, one token
at a time (decode, and the token loop of a prefill).

Three functions are printed per spec, all from the same statements:

- torch_step: one token, functional (autograd flows): the lets, every state's new value from
  the previous states, the output;
- torch_step_: the same token with the state buffers updated in place (mul_, addcmul_, add_:
  no new state tensor), where every state's update has the plan's affine pieces (decay, key,
  value, rank-1 terms) free of other states; torch_step_ is None otherwise;
- torch_tokens: a loop of torch_step over T tokens, everything that does not read a state
  (lets, gates, decays, keys, values, the output's state-free terms) computed once for the
  whole sequence (the driver passes blocks of tokens) before the loop; without autograd each
  token's output is copied into its row of a buffer the driver gives (_out), and a held-constant
  value is not detached (the loop's emitter prints detach so: nothing rewrites printed lines).

A state's update is printed from its affine pieces (S <- a * S + sum_i l_i (x) (r_i @ S) +
k (x) v, each outer product one addcmul over S: two passes over S for a gated update, where
the spec's text as written takes three), or from the spec's update expression as written
where it has no such pieces. The output is the spec's output expression; its terms that read
prev(S) are computed before any state changes (the in-place step overwrites prev(S)).

A stabilized spec (derive/stabilize.py: an exponential input gate) runs its kernel spec
(plan.kernel_ir): the states S~ = S exp(-m) and the scale m, so that its outputs stay finite
where the chunked and recurrent forms keep them finite; the runtime gives m = 0 with a given
state and returns the spec's S = S~ exp(m) (runtime/torch_step.py)."""
from __future__ import annotations

import re

from .. import classes
from ..derive.plan import Plan
from ..derive.stabilize import M_EMPTY
from ..dsl import ir
from .torch_expr import TorchEmitter, input_loads
from .triton_expr import canon

I1, I2 = "    ", "        "


def _reads(e: ir.Expr | None, kinds: set[str], prev: bool = False) -> bool:
    """Whether e reads a name of these kinds (a let counts as what it is, state-free), or,
    with prev, prev() of a state."""
    if e is None:
        return False
    for node in ir.walk(e):
        if isinstance(node, ir.Prev) and prev:
            return True
        if isinstance(node, ir.Ref) and node.kind in kinds:
            return True
    return False


class StepEmitter(TorchEmitter):
    """TorchEmitter over [B, H, *dims] (lead 2) or [B, T, H, *dims] (lead 3), with a vector
    contracted against a matrix as a matmul (q @ S: one pass over S, no [K, V] temporary)."""

    def __init__(self, mixer, env, scalars=(), indent=I1, prefix="_s", lead=2):
        super().__init__(mixer, env, scalars, indent=indent, prefix=prefix, lead=lead)
        self.lets: dict[str, ir.Expr] = {x.name: x.expr for x in mixer.lets}
        self.texts: dict[tuple, tuple[str, tuple[str, ...]]] = {}     # code -> its variable (one statement each)
        # states whose every value is held constant (the stabilizer's m = detach(...)): their
        # detach() is the value itself
        self.constant = {u.state for u in mixer.updates if isinstance(u.expr, ir.Call) and u.expr.fn == "detach"}

    def expand(self, var: str, have, want) -> str:
        """var broadcast against `want`: unsqueeze at each missing axis (cheaper than indexing
        with None, which goes through Python's indexing; a step is a few microseconds of ops)."""
        if self.is_scalar(var) or have == want or not want:
            return var
        missing = [self.lead + i for i, d in enumerate(want) if d not in have]
        return var + "".join(f".unsqueeze({i})" for i in missing)

    def emit(self, code: str, dims):
        key = (code, tuple(dims))
        if key not in self.texts:
            self.texts[key] = super().emit(code, dims)
        return self.texts[key]

    def x_Call(self, e: ir.Call):
        x = e.args[0] if e.args else None
        if e.fn == "detach" and ((isinstance(x, ir.Ref) and x.kind == "state" and x.name in self.constant)
                                 or (isinstance(x, ir.Prev) and x.state in self.constant)):
            return self(x)
        return super().x_Call(e)

    def x_Ref(self, e: ir.Ref):
        if e.kind == "let" and e.name not in self.env:
            self.env[e.name] = self(self.lets[e.name])
            return self.env[e.name]
        return super().x_Ref(e)

    def x_BinOp(self, e: ir.BinOp):
        # x * 1 (the stabilizer's keys without their gate) is x: no pass over it
        if e.op == "*" and isinstance(e.right, ir.Num) and e.right.value == 1 and e.left.shape == e.shape:
            return self(e.left)
        if e.op == "*" and isinstance(e.left, ir.Num) and e.left.value == 1 and e.right.shape == e.shape:
            return self(e.right)
        if e.op == "+":             # x + y * z in one addcmul (one pass, one temporary less)
            for prod, other in ((e.right, e.left), (e.left, e.right)):
                if isinstance(prod, ir.BinOp) and prod.op == "*" and prod not in self.cache:
                    (a, da), (b, db), (c, dc) = self(other), self(prod.left), self(prod.right)
                    if not (self.is_scalar(a) or self.is_scalar(b) or self.is_scalar(c)):
                        out = canon(self.order, set(da) | set(db) | set(dc))
                        return self.emit(f"torch.addcmul({self.expand(a, da, out)}, {self.expand(b, db, out)}, "
                                         f"{self.expand(c, dc, out)})", out)
        return super().x_BinOp(e)

    def x_Contract(self, e: ir.Contract):
        (a, da), (b, db) = self(e.left), self(e.right)
        return self.contract(a, da, b, db, e.over)

    def contract(self, a, da, b, db, over):
        """a @ b over `over`: a matmul where one side is the vector over `over` and the other a
        matrix with `over` as its first or last axis, else the product summed."""
        if len(over) == 1 and not self.is_scalar(a) and not self.is_scalar(b):
            for (x, dx), (y, dy) in (((a, da), (b, db)), ((b, db), (a, da))):
                if dx == tuple(over) and len(dy) == 2 and dy[0] == over[0]:
                    return self.emit(f"({x}.unsqueeze(-2) @ {y}).squeeze(-2)", dy[1:])
                if dx == tuple(over) and len(dy) == 2 and dy[1] == over[0]:
                    return self.emit(f"({y} @ {x}.unsqueeze(-1)).squeeze(-1)", dy[:1])
        full = canon(self.order, set(da) | set(db))
        prod, _ = self.emit(f"{self.expand(a, da, full)} * {self.expand(b, db, full)}", full)
        return self.reduce(prod, full, tuple(over))

    def forget_state_var(self, var: str) -> None:
        """Drop the cached statements that read the variable var (a state buffer just changed in
        place): the same text must read it again."""
        self.texts = {k: v for k, v in self.texts.items() if not re.search(rf"\b{re.escape(var)}\b", k[0])}

    def forget_states(self) -> None:
        """Drop every cached value that read a state as it is now (after the states change);
        the values read from prev() were computed before (StepWriter._prev_terms)."""
        self.cache = {e: v for e, v in self.cache.items() if not _reads(e, {"state"})}
        # the same text now reads the new state (the in-place step keeps the variable's name)
        self.texts = {}


def _pieces_of(plan: Plan, st) -> list | None:
    """The outer products of a state's update besides its decay, as (left, right @ S or a
    term, dims) recipes: [("key", key, value)] and [("rank1", left, right, scale)], or None
    where the update has no such pieces free of the states (printed as written then)."""
    p = st.ir_pieces
    if p is None:
        return None
    unit = classes.unit(st.transition)
    parts = [p.decay, p.key, p.value, p.left, p.right, p.left_scale,
             *(x for pair in p.terms + p.inputs for x in pair)]
    if any(_reads(x, {"state"}, prev=True) for x in parts):
        return None
    kd = set(st.key_dims)
    # a projection the pieces do not hold (ir_pieces keeps one that contracts the key dims; the
    # general class's sum(S, V) contracts a value dim and has no left there): printed as written
    if any(set(r.over) != kd for r in st.rank1) or (st.rank1 and p.left is None and not unit.term_axes):
        return None
    if unit.term_axes:
        if not p.inputs or any(set(r.shape) - kd for _, r in p.terms):
            return None
        return ([("rank1", left, right, None) for left, right in p.terms]
                + [("key", k, v) for k, v in p.inputs])
    if p.key is None or p.value is None:
        return None
    if p.left is None:
        return [("key", p.key, p.value)]
    if set(p.right.shape) - kd:
        return None
    if p.left_scale is not None:           # left = c * key: one outer product key (x) (value + c r)
        return [("folded", p.key, p.value, p.right, p.left_scale)]
    return [("rank1", p.left, p.right, None), ("key", p.key, p.value)]


class StepWriter:
    """The statements of one token: `em` evaluates the state-free values (over [B, H] or, in
    the token loop, slices of values computed over the whole sequence)."""

    def __init__(self, plan: Plan, em: StepEmitter, inplace: bool):
        self.plan, self.em, self.inplace = plan, em, inplace
        self.m = plan.kernel_ir
        self.structured = {}
        if plan.stabilizer is None:
            for st in plan.states:
                self.structured[st.name] = _pieces_of(plan, st)

    def state_dims(self, name: str) -> tuple[str, ...]:
        return canon(self.m.dim_names, self.m.state(name).shape)

    def lines(self, state_vars: dict[str, str]) -> tuple[list[str], dict[str, str], str]:
        """(statements, new state variables, the output variable) from the states' variables
        (their dims in canonical order)."""
        em, m = self.em, self.m
        for decl in m.states:
            cd = self.state_dims(decl.name)
            em.env[decl.name] = (state_vars[decl.name], cd)
            em.env["prev " + decl.name] = (state_vars[decl.name], cd)
        start = len(em.lines)
        # 1. what reads the previous states: the output's prev() terms, the rank-1 projections,
        # and the new value of every state printed as written
        self._prev_terms(m.output.expr)
        plans, new = {}, {}
        for upd in m.updates:
            pieces = self.structured.get(upd.state)
            if pieces is None:
                var, have = em(upd.expr)
                new[upd.state] = self._full(var, have, self.state_dims(upd.state))
            else:
                plans[upd.state] = self._products(upd.state, pieces, state_vars[upd.state])
        # 2. the states change
        out_vars = {}
        for upd in m.updates:
            s = state_vars[upd.state]
            if upd.state in plans:
                decay, products = plans[upd.state]
                out_vars[upd.state] = self._update(upd.state, s, decay, products)
            elif self.inplace:
                em.lines.append(f"{em.indent}{s}.copy_({new[upd.state]})")
                out_vars[upd.state] = s
            else:
                out_vars[upd.state] = new[upd.state]
        # 3. the output from the new states (and the prev() terms computed in 1)
        em.forget_states()
        for decl in m.states:
            em.env[decl.name] = (out_vars[decl.name], self.state_dims(decl.name))
        var, have = em(m.output.expr)
        want = canon(m.dim_names, m.output.expr.shape)
        out = self._full(var, have, want)
        return em.lines[start:], out_vars, out

    def _full(self, var, have, want) -> str:
        """A value with every axis of `want` (size 1 where it does not vary)."""
        if self.em.is_scalar(var) or have != want:
            shape = ", ".join(f"_sizes[{d!r}]" for d in want)
            lead = "_B, _H" if self.em.lead == 2 else "_B, _T, _H"
            return self.em.emit(f"_t({self.em.expand(var, have, want)}).to(_x0.dtype).expand({lead}"
                                f"{', ' + shape if shape else ''})", want)[0]
        return var

    def _prev_terms(self, e: ir.Expr) -> None:
        """Compute the largest terms of the output that read prev() and no current state, now."""
        current = {d.name for d in self.m.states}
        if not _reads(e, set(), prev=True):
            return
        reads_now = any(isinstance(n, ir.Ref) and n.kind == "state" and n.name in current for n in ir.walk(e))
        if not reads_now:
            var, have = self.em(e)
            if isinstance(e, ir.Prev) and self.inplace:      # the buffer itself: keep its value
                self.em.cache[e] = self.em.emit(f"{var}.clone()", have)
            return
        for child in ir.children(e):
            self._prev_terms(child)

    def _products(self, name, pieces, s):
        """(decay variable or None, [(x, y)] outer products to add to S), read before S changes."""
        em, cd = self.em, self.state_dims(name)
        st = self.plan.state(name)
        decay = None
        if not (isinstance(st.ir_pieces.decay, ir.Num) and st.ir_pieces.decay.value == 1):
            var, have = em(st.ir_pieces.decay)
            decay = em.expand(var, have, cd)
        kd = canon(self.m.dim_names, st.key_dims)
        products = []
        for piece in pieces:
            if piece[0] == "key":
                _, x, y = piece
                products.append((em(x), em(y)))
            elif piece[0] == "rank1":
                _, left, right, _ = piece
                r = em.contract(*em(right), s, cd, kd)
                products.append((em(left), r))
            else:                                   # folded: key (x) (value + c (right @ S))
                _, key, value, right, c = piece
                later = _after_decay(st.ir_pieces.decay, right, c, self.m.dim_names) if decay is not None else None
                if later is not None:               # right @ S read from the decayed S (_update)
                    products.append(("after decay", key, value, *later))
                    continue
                products.append((em(key), self._corrected(value, em.contract(*em(right), s, cd, kd), c)))
        return decay, [p if p[0] == "after decay" else
                       (em.expand(p[0][0], p[0][1], cd), em.expand(p[1][0], p[1][1], cd),
                        em.is_scalar(p[0][0]) or em.is_scalar(p[1][0])) for p in products]

    def _corrected(self, value: ir.Expr, read, c: ir.Expr):
        """value + c * read (read = right @ S: its variable and dims) in as few passes as the
        factors allow: F * (x - read) where value = F x and c = -F (the delta rules' beta (v - k^T
        S): two ops, as a person writes it), else one addcmul."""
        em = self.em
        rv, rd = read
        split = _common_factor(value, c, self.m.dim_names)
        if split is not None:
            x, f, sign = split
            (xv, xd), (fv, fd) = em(x), em(f)
            inner_dims = canon(self.m.dim_names, set(xd) | set(rd))
            inner = em.emit_as(f"{em.expand(xv, xd, inner_dims)} {sign} {em.expand(rv, rd, inner_dims)}",
                               inner_dims, [xv, rv])
            out = canon(self.m.dim_names, set(inner_dims) | set(fd))
            return em.emit_as(f"{em.expand(inner[0], inner_dims, out)} * {em.expand(fv, fd, out)}", out,
                              [inner[0], fv])
        (cv, cdims), (vv, vd) = em(c), em(value)
        out = canon(self.m.dim_names, set(vd) | set(rd) | set(cdims))
        return em.emit_as(f"torch.addcmul({em.expand(vv, vd, out)}, {em.expand(cv, cdims, out)}, "
                          f"{em.expand(rv, rd, out)})", out, [vv, cv, rv])

        return decay, [(em.expand(x, dx, cd), em.expand(y, dy, cd), em.is_scalar(x) or em.is_scalar(y))
                       for (x, dx), (y, dy) in products]

    @staticmethod
    def _product(x: str, y: str) -> str:
        """x * y where one is a number (1.0 * y is y)."""
        return y if x == "1.0" else x if y == "1.0" else f"{x} * {y}"

    def _update(self, name: str, s: str, decay, products) -> str:
        """The state's new value: decayed, then each outer product added (the products whose
        right-hand read waits for the decayed state, _after_decay, are computed in between)."""
        em = self.em
        waiting = [p for p in products if p[0] == "after decay"]
        if waiting:
            if self.inplace:
                em.lines.append(f"{em.indent}{s}.mul_({decay})")
                em.forget_state_var(s)
                decayed = s
            else:
                decayed = em.emit(f"{s} * {decay}", ())[0]
            decay = None
            cd = self.state_dims(name)
            kd = canon(self.m.dim_names, self.plan.state(name).key_dims)
            ready = [p for p in products if p[0] != "after decay"]
            for _, key, value, right, c in waiting:
                read = em.contract(*em(right), decayed, cd, kd)
                (kv, kdims), (yv, yd) = em(key), self._corrected(value, read, c)
                ready.append((em.expand(kv, kdims, cd), em.expand(yv, yd, cd), em.is_scalar(kv) or em.is_scalar(yv)))
            products = ready
            s = decayed
        if self.inplace:
            if decay is not None:
                em.lines.append(f"{em.indent}{s}.mul_({decay})")
            for x, y, scalar in products:
                em.lines.append(f"{em.indent}{s}.add_({self._product(x, y)})" if scalar else
                                f"{em.indent}{s}.addcmul_({x}, {y})")
            return s
        acc = f"{s} * {decay}" if decay is not None else s
        for x, y, scalar in products:
            acc = em.emit(f"{acc} + {self._product(x, y)}" if scalar else f"torch.addcmul({acc}, {x}, {y})", ())[0]
        if acc == s and not waiting:                  # nothing added (a pure decay): a new tensor still
            acc = em.emit(f"{s} * 1.0", ())[0]
        elif not products:
            acc = em.emit(acc, ())[0]
        return acc


def _factors(e: ir.Expr) -> tuple[float, list[ir.Expr]]:
    """e as a number times a list of factors (a product tree flattened)."""
    if isinstance(e, ir.Num):
        return e.value, []
    if isinstance(e, ir.BinOp) and e.op == "*":
        (a, fa), (b, fb) = _factors(e.left), _factors(e.right)
        return a * b, fa + fb
    return 1.0, [e]


def _without(factors: list, remove: list) -> list | None:
    """factors less each of `remove` (as a multiset), or None where one is missing."""
    rest = list(factors)
    for f in remove:
        if f not in rest:
            return None
        rest.remove(f)
    return rest


def _times(coef: float, factors: list, dim_names) -> ir.Expr:
    """coef * the factors as one expression (Num(1.0) where nothing is left)."""
    out = None if coef == 1 else ir.Num((), None, coef)
    for f in factors:
        out = f if out is None else ir.BinOp(canon(dim_names, set(out.shape) | set(f.shape)), None, "*", out, f)
    return ir.Num((), None, 1.0) if out is None else out


def _after_decay(decay: ir.Expr, right: ir.Expr, c: ir.Expr, dim_names):
    """(right', c') with c (right @ S) = c' (right' @ (decay * S)), or None: the decay is a
    factor of right (per key: kda's k * exp(g)) or, a scalar, of c (the gated delta rule's
    alpha * -beta). Then the step decays S first and reads it once, as a person writes it
    (S *= alpha; S += k (beta (v - k^T S))^T), one op less than reading the old S."""
    dcoef, dfac = _factors(decay)
    if dcoef != 1 or not dfac:
        return None
    rcoef, rfac = _factors(right)
    rest = _without(rfac, dfac)
    if rest is not None and rest:
        return _times(rcoef, rest, dim_names), c
    if decay.shape == ():
        ccoef, cfac = _factors(c)
        rest = _without(cfac, dfac)
        if rest is not None:
            return right, _times(ccoef, rest, dim_names)
    return None


def _common_factor(value: ir.Expr, c: ir.Expr, dim_names):
    """(x, F, sign) with value = F x and c = sign1 * F, or None: value + c r = F (x sign r)."""
    vcoef, vfac = _factors(value)
    ccoef, cfac = _factors(c)
    if vcoef != 1 or ccoef not in (1.0, -1.0) or not cfac:
        return None
    rest = _without(vfac, cfac)
    if not rest:
        return None
    return _times(1.0, rest, dim_names), _times(1.0, cfac, dim_names), "-" if ccoef == -1 else "+"


def _inputs(plan: Plan, lead: int) -> tuple[list[str], dict, set]:
    """Loads of the kernel spec's inputs, params and options (torch_expr.input_loads)."""
    return input_loads(plan.kernel_ir, lead, I1)


def _head_line(lines: list[str], lead: int) -> list[str]:
    if any("_head" in x for x in lines):
        shape = "1, _H" if lead == 2 else "1, 1, _H"
        return [f"{I1}_head = torch.arange(_H, dtype=_x0.dtype, device=_x0.device).reshape({shape})"]
    return []


def _state_loads(plan: Plan, indent: str) -> tuple[list[str], dict[str, str]]:
    m, lines, names = plan.kernel_ir, [], {}
    for decl in m.states:
        cd = canon(m.dim_names, decl.shape)
        perm = "" if cd == decl.shape else f".permute(0, 1, {', '.join(str(2 + decl.shape.index(a)) for a in cd)})"
        lines.append(f"{indent}s_{decl.name} = _s[{decl.name!r}]{perm}")
        names[decl.name] = f"s_{decl.name}"
    return lines, names


def _state_dict(plan: Plan, out_vars: dict[str, str]) -> str:
    m, parts = plan.kernel_ir, []
    for decl in m.states:
        cd = canon(m.dim_names, decl.shape)
        perm = "" if cd == decl.shape else f".permute(0, 1, {', '.join(str(2 + cd.index(a)) for a in decl.shape)})"
        parts.append(f"{decl.name!r}: {out_vars[decl.name]}{perm}")
    return "{" + ", ".join(parts) + "}"


def _step(plan: Plan, inplace: bool) -> str:
    lines, env, scalars = _inputs(plan, 2)
    em = StepEmitter(plan.kernel_ir, env, scalars, indent=I1, prefix="_s")
    writer = StepWriter(plan, em, inplace)
    loads, names = _state_loads(plan, I1)
    body, out_vars, out = writer.lines(names)
    ret = f"{I1}return {out}" if inplace else f"{I1}return {out}, {_state_dict(plan, out_vars)}"
    return "\n".join(_used(lines + _head_line(body, 2), body) + loads + body + [ret])


def _used(loads: list[str], body: list[str]) -> list[str]:
    """The loads the body reads (an unread option or _x0 costs a dict lookup per token)."""
    text = "\n".join(body)
    kept = []
    for line in reversed(loads):
        name = line.strip().split(" = ")[0]
        if name in text:
            kept.append(line)
            text += "\n" + line
    return kept[::-1]


def inplace_supported(plan: Plan) -> bool:
    """The in-place step writes the spec's own state: not with a stabilizer (its states are
    S~ and m; the runtime copies S~ exp(m) back), nor where a state's update is printed as
    written and another state's update reads it (its copy_ would come first)."""
    if plan.stabilizer is not None:
        return False
    writer = StepWriter(plan, StepEmitter(plan.kernel_ir, {}), True)
    asis = [u for u in plan.kernel_ir.updates if writer.structured.get(u.state) is None]
    return not any(_reads(u.expr, {"state"}) and ir.refs(u.expr, "state") - {u.state} for u in asis)


def _hoisted(e: ir.Expr) -> bool:
    """A value the token loop computes before it: it reads no state (a number, a dim or an
    option is printed in place)."""
    return not _reads(e, {"state"}, prev=True) and not isinstance(e, ir.Num) and not (
        isinstance(e, ir.Ref) and e.kind in ("dim", "option"))


class LoopEmitter(StepEmitter):
    """The token loop's body: a state-free node it meets is computed by `outer` over the whole
    sequence ([B, T, H, ...], before the loop) and read here as that token's slice (_u<n>[_i],
    from unbind: a tuple index per token); one that varies with no token (params, the head
    index) as its single row. The rest is computed per token."""

    def __init__(self, mixer, outer: StepEmitter, env, scalars):
        super().__init__(mixer, env, scalars, indent=I2, prefix="_s", lead=2)
        # a held-constant value needs no detach() where no graph is recorded (_rows: the
        # driver's output buffer, given without autograd)
        self.calls = {"detach": "({x}.detach() if _rows is None else {x})"}
        self.outer = outer
        self.slices: list[str] = []                 # the statements before the loop that slice
        self.sliced: dict[str, str] = {}            # outer variable -> its slices' name

    def varies(self, e: ir.Expr) -> bool:
        """Whether e changes from token to token (reads an input, directly or through a let)."""
        return any(isinstance(n, ir.Ref) and (n.kind == "input" or (n.kind == "let" and self.varies(self.lets[n.name])))
                   for n in ir.walk(e))

    def __call__(self, e: ir.Expr):
        if e not in self.cache and _hoisted(e):
            var, have = self.outer(e)
            if self.outer.is_scalar(var):
                self.scalars.add(var)
                self.cache[e] = (var, have)
            else:
                if var not in self.sliced:
                    name = self.sliced[var] = f"_u{len(self.sliced) + 1}"
                    taken = f"{var}.unbind(1)" if self.varies(e) else f"{var}[:, 0]"
                    self.slices.append(f"{I1}{name} = {taken}")
                name = self.sliced[var]
                self.cache[e] = (f"{name}[_i]" if self.varies(e) else name, have)
        return super().__call__(e)


def _tokens(plan: Plan) -> str:
    """torch_tokens: the state-free values over [B, T, H, ...] once, then the loop."""
    m = plan.kernel_ir
    lines, env, scalars = _inputs(plan, 3)
    outer = StepEmitter(m, env, scalars, indent=I1, prefix="_a", lead=3)
    body_em = LoopEmitter(m, outer, {k: v for k, v in env.items() if v[0] in scalars}, scalars)
    writer = StepWriter(plan, body_em, False)
    loads, names = _state_loads(plan, I1)
    body, out_vars, out = writer.lines(names)
    # _out given (no autograd, _rows its rows): each token's output is copied into its row of
    # the caller's buffer (a list of T outputs, each fresh memory, and their stack cost more:
    # issue 33)
    loop = [f"{I1}_outs = []", f"{I1}_rows = _out.unbind(1) if _out is not None else None",
            f"{I1}for _i in range(_T):"] + body
    loop += [f"{I2}if _rows is None:", f"{I2}    _outs.append({out})", f"{I2}else:",
             f"{I2}    _rows[_i].copy_({out})"]
    loop += [f"{I2}{names[d.name]} = {out_vars[d.name]}" for d in m.states if out_vars[d.name] != names[d.name]]
    want = canon(m.dim_names, m.output.expr.shape)
    sizes = ", ".join(f"_sizes[{d!r}]" for d in want)
    empty = f"_x0.new_zeros(_B, 0, _H{', ' + sizes if sizes else ''})"
    ret = [f"{I1}if _out is not None:", f"{I1}    return _out, {_state_dict(plan, names)}",
           f"{I1}_o = torch.stack(_outs, 1) if _outs else {empty}",
           f"{I1}return _o, {_state_dict(plan, names)}"]
    # `head` may reach the loop only through a slice of it (_u = _head[:, 0]) or the body
    head = _head_line(outer.lines + body_em.slices + body, 3)
    return "\n".join(lines + head + outer.lines + body_em.slices + loads + loop + ret)


def torch_step_hooks(plan: Plan) -> dict:
    inplace = inplace_supported(plan)
    return {
        "step": _step(plan, False),
        "step_inplace": _step(plan, True) if inplace else None,
        "tokens": _tokens(plan),
        "kernel_states": repr(tuple(s.name for s in plan.kernel_ir.states)),
        "stabilized": repr(tuple(plan.stabilizer.states) if plan.stabilizer is not None else ()),
        "m_empty": repr(M_EMPTY),
    }

"""Affine structure of updates and readouts, on the IR.

An update `S = f(S, ...)` is affine in S when f(S) = sum of linear terms + a constant.
Each linear term is put in the normal form  scale * sum_over(proj * S)  (no projection:
scale * S). The classes of DESIGN.md section 1 are read off these terms.

A contraction of an expression that is itself affine in S is distributed over its terms
(DeltaProduct's k2 @ (a S + b1 k1 (v1 - k1 @ (a S)))): a projected term projected again
becomes one term whose scale takes what the outer contraction sums against
(k2 @ (c k1 (k1 @ S)) = (k2 @ c k1) (k1 @ S)). An update's terms with the same projection
are then merged (merge_projections), so that diag(a) S + sum_i u_i (w_i @ S) + b has one term
per distinct w_i: its rank r.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..dsl import ir
from ..dsl.errors import SpecError


class NotAffine(Exception):
    """linear: the expression is linear in the state, but not in a form mixc can normalize."""

    def __init__(self, message: str, node: ir.Expr, linear: bool = False):
        super().__init__(message)
        self.message = message
        self.node = node
        self.linear = linear


@dataclass(frozen=True)
class LinTerm:
    """scale * sum_over(proj * S); proj None means scale * S; scale None means 1."""

    scale: ir.Expr | None
    proj: ir.Expr | None
    over: ir.Shape


@dataclass(frozen=True)
class AffineForm:
    terms: tuple[LinTerm, ...]
    const: ir.Expr | None


# ---- small IR builders (spans None: these nodes are derived, not written) ----

def union(*shapes) -> ir.Shape:
    """Dims of a broadcast, in first-seen order (derived nodes use shapes as sets)."""
    return tuple(dict.fromkeys(d for s in shapes for d in s))


def num(v: float) -> ir.Num:
    return ir.Num((), None, float(v))


def mul(a: ir.Expr | None, b: ir.Expr | None) -> ir.Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return ir.BinOp(union(a.shape, b.shape), None, "*", a, b)


def neg(a: ir.Expr | None) -> ir.Expr:
    return num(-1) if a is None else ir.Neg(a.shape, None, a)


def add(a: ir.Expr | None, b: ir.Expr | None, op: str = "+") -> ir.Expr | None:
    if b is None:
        return a
    if a is None:
        return b if op == "+" else neg(b)
    return ir.BinOp(union(a.shape, b.shape), None, op, a, b)


def total(xs: list[ir.Expr]) -> ir.Expr | None:
    """The sum of xs as a balanced tree (a left-deep chain of hundreds of terms, as a written-out
    system can have, would exhaust Python's stack in every recursive walk); up to three terms
    it is the left-deep ((a + b) + c)."""
    if len(xs) <= 1:
        return xs[0] if xs else None
    half = len(xs) - len(xs) // 2
    return add(total(xs[:half]), total(xs[half:]))


def recip(a: ir.Expr) -> ir.Expr:
    return ir.BinOp(a.shape, None, "/", num(1), a)


def factors(e: ir.Expr | None) -> list[ir.Expr]:
    """The factors of a product (a - sign as the factor -1)."""
    if e is None:
        return []
    if isinstance(e, ir.BinOp) and e.op == "*":
        return factors(e.left) + factors(e.right)
    if isinstance(e, ir.Neg):
        return [num(-1)] + factors(e.x)
    return [e]


def product(fs: list[ir.Expr]) -> ir.Expr | None:
    out = None
    for f in fs:
        out = mul(out, f)
    return out


def source_text(ir_: ir.MixerIR, e: ir.Expr) -> str:
    sp_ = e.span
    if sp_ is None or sp_.line != sp_.end_line:
        return "..."
    return ir_.source.line(sp_.line)[sp_.column - 1:sp_.end_column - 1]


# ---- the decomposition ----

class _Affine:
    def __init__(self, mixer: ir.MixerIR, is_state, state_shape: ir.Shape):
        self.mixer = mixer
        self.is_state = is_state          # node -> bool: is this node the state variable?
        self.state_shape = state_shape

    def depends(self, e: ir.Expr) -> bool:
        return any(self.is_state(n) for n in ir.walk(e))

    def text(self, e):
        return source_text(self.mixer, e)

    def operand(self, e):
        """An operand's text, in parentheses where it is a sum or a contraction (whose own span
        leaves out the parentheses the spec wrote): found S * (k @ S)."""
        t = self.text(e)
        # (a name standing for a sum: another state's new value, written out by the checker)
        sum_ = isinstance(e, ir.Contract) or (isinstance(e, ir.BinOp) and e.op in "+-")
        return f"({t})" if sum_ and not t.isidentifier() else t

    def form(self, e: ir.Expr) -> AffineForm:
        if self.is_state(e):
            return AffineForm((LinTerm(None, None, ()),), None)
        if not self.depends(e):
            return AffineForm((), e)
        if isinstance(e, (ir.Ref, ir.Prev)):
            raise NotAffine(f"reads {self.text(e)} in a way that is not supported", e)
        if isinstance(e, ir.Neg):
            return self.scaled(self.form(e.x), num(-1))
        if isinstance(e, ir.BinOp):
            a_dep, b_dep = self.depends(e.left), self.depends(e.right)
            if e.op in "+-":
                fa, fb = self.form(e.left), self.form(e.right)
                if e.op == "-":
                    fb = self.scaled(fb, num(-1))
                return AffineForm(fa.terms + fb.terms, add(fa.const, fb.const))
            if e.op == "*":
                if a_dep and b_dep:
                    raise NotAffine(f"found {self.operand(e.left)} * {self.operand(e.right)}", e)
                return self.scaled(self.form(e.right), e.left) if b_dep else self.scaled(self.form(e.left), e.right)
            if e.op == "/":
                if b_dep:
                    raise NotAffine(f"divides by the state: {self.text(e)}", e)
                return self.scaled(self.form(e.left), recip(e.right))
            raise NotAffine(f"raises to a power: {self.text(e)}", e)
        if isinstance(e, ir.Contract):
            if self.depends(e.left) and self.depends(e.right):
                raise NotAffine(f"found {self.operand(e.left)} @ {self.operand(e.right)}", e)
            w, x = (e.right, e.left) if self.depends(e.left) else (e.left, e.right)
            return self.projected(self.form(x), w, e.over, e)
        if isinstance(e, ir.Reduce):
            if e.fn != "sum":
                raise NotAffine(f"applies {e.fn}() to the state: {self.text(e)}", e)
            return self.projected(self.form(e.x), None, e.over, e)
        if isinstance(e, ir.Call):
            raise NotAffine(f"applies {e.fn}() to the state: {self.text(e)}", e)
        raise NotAffine(f"uses the state in {self.text(e)}, which is not supported", e)

    def scaled(self, f: AffineForm, c: ir.Expr) -> AffineForm:
        terms = tuple(replace(t, scale=mul(t.scale, c)) for t in f.terms)
        const = mul(f.const, c) if f.const is not None else None
        return AffineForm(terms, const)

    def projected(self, f: AffineForm, w: ir.Expr | None, over: ir.Shape, e: ir.Expr) -> AffineForm:
        """sum_over(w * X) for X in affine form (w None: a plain sum)."""
        terms = []
        for t in f.terms:
            if t.proj is not None:
                terms.append(self.reprojected(t, w, over, e))
                continue
            scale = t.scale
            inner = set(scale.shape) & set(over) if scale is not None else set()
            outer = set(scale.shape) - set(over) if scale is not None else set()
            if inner and outer:
                # A factor over both kept and summed dims stays inside the projection.
                terms.append(LinTerm(None, mul(w, scale) or num(1), over))
            elif inner:
                terms.append(LinTerm(None, mul(w, scale), over))
            else:
                terms.append(LinTerm(scale, w if w is not None else num(1), over))
        const = None
        if f.const is not None:
            if w is None:
                const = ir.Reduce(tuple(d for d in f.const.shape if d not in over), None, "sum", f.const, over)
            else:
                shape = tuple(d for d in union(w.shape, f.const.shape) if d not in over)
                const = ir.Contract(shape, None, w, f.const, over)
        return AffineForm(tuple(terms), const)


    def reprojected(self, t: LinTerm, w: ir.Expr | None, over: ir.Shape, e: ir.Expr) -> LinTerm:
        """sum_over(w * t) of a projected term t = c * Y, Y = sum_{t.over}(p * S): distributed.

        D, the summed dims that Y has, make one projection over t.over + D; E, the rest (dims
        of w and c only), contract w with c into the new scale. Y's own summed dims are bound
        inside it: a factor of c over them is a different index, kept outside the sum."""
        y_dims = set(union(self.state_shape, t.proj.shape)) - set(t.over)
        D = tuple(d for d in over if d in y_dims)
        E = tuple(d for d in over if d not in y_dims)
        c = mul(w, t.scale)
        if E:               # E is in both w and c (a contraction's dims are shared; a sum's, c's)
            shape = tuple(d for d in c.shape if d not in E)
            c = (ir.Contract(shape, None, w, t.scale, E) if w is not None and t.scale is not None
                 else ir.Reduce(shape, None, "sum", c, E))
        if not D:
            return LinTerm(c, t.proj, t.over)
        inside = [x for x in factors(c) if set(x.shape) & set(D)]
        outside = [x for x in factors(c) if not set(x.shape) & set(D)]
        if any(set(x.shape) & set(t.over) for x in inside):
            raise NotAffine(f"projects the state twice over {', '.join(t.over)}, and a factor that "
                            f"depends on {', '.join(t.over)} would have to move inside the inner sum: "
                            f"{self.text(e)} (write the projections out, or rename the dims)", e, linear=True)
        return LinTerm(product(outside), mul(product(inside), t.proj), union(t.over, D))


def merge_projections(f: AffineForm, same=None) -> AffineForm:
    """One term per distinct projection: scale_1 (w @ S) + scale_2 (w @ S) = (scale_1 + scale_2)
    (w @ S), for projections over the same dims that are structurally equal (spans aside) or
    that `same(w1, w2)` says are equal (plan.py compares their sympy forms). The first term's
    place is kept, so an update with one term per projection is unchanged."""
    out: list[LinTerm] = []
    scales: list[list[ir.Expr]] = []        # the scales merged into each term (summed at the end)
    for t in f.terms:
        j = next((i for i, u in enumerate(out) if t.proj is not None and u.proj is not None
                  and set(u.over) == set(t.over)
                  and (u.proj == t.proj or (same is not None and set(u.proj.shape) == set(t.proj.shape)
                                            and same(u.proj, t.proj)))), None)
        if j is None:
            out.append(t)
            scales.append([t.scale])
        else:
            scales[j].append(t.scale)
    return AffineForm(tuple(t if len(s) == 1 else LinTerm(total([x or num(1) for x in s]), t.proj, t.over)
                            for t, s in zip(out, scales)), f.const)


def affine_in(mixer: ir.MixerIR, e: ir.Expr, state: str, version: str = "any") -> AffineForm:
    """Decompose e as affine in `state`. version: 'any' (updates: S and prev(S) are both
    the previous state), 'current' (S only) or 'prev' (prev(S) only)."""
    def is_state(n):
        if isinstance(n, ir.Ref) and n.kind == "state" and n.name == state:
            return version in ("any", "current")
        if isinstance(n, ir.Prev) and n.state == state:
            return version in ("any", "prev")
        return False

    return _Affine(mixer, is_state, mixer.state(state).shape).form(e)


def update_form(mixer: ir.MixerIR, upd: ir.Update, same=None) -> AffineForm:
    """The affine form of an update, one term per distinct projection (merge_projections;
    `same` compares two projections beyond structural equality)."""
    try:
        return merge_projections(affine_in(mixer, upd.expr, upd.state), same)
    except NotAffine as err:
        what = "is linear in {0}, but mixc cannot put it in its normal form" if err.linear else "is not linear in {0}"
        raise SpecError(f"the update of {upd.state} {what.format(upd.state)}: {err.message}",
                        mixer.source, err.node.span or upd.expr.span,
                        ("mixc compiles updates of the form S = A_t(S) + B_t with A_t linear in S",)) from None


# ---- readouts of the output ----

@dataclass(frozen=True)
class Readout:
    """A state-linear piece of the output: sum of terms applied to S_t (or S_{t-1})."""

    name: str                 # the placeholder in the combine expression
    state: str
    prev: bool
    terms: tuple[LinTerm, ...]
    shape: ir.Shape
    expr: ir.Expr             # the piece of the output it replaces


def _versions(e: ir.Expr) -> set[tuple[str, bool]]:
    out = set()
    for n in ir.walk(e):
        if isinstance(n, ir.Ref) and n.kind == "state":
            out.add((n.name, False))
        elif isinstance(n, ir.Prev):
            out.add((n.state, True))
    return out


def split_output(mixer: ir.MixerIR, e: ir.Expr,
                 keep: dict[str, frozenset[str]] | None = None) -> tuple[ir.Expr, tuple[Readout, ...]]:
    """Replace each maximal state-linear subexpression with a placeholder Ref (kind
    'readout', named _r0, _r1 ...): returns (combine expression, readouts).

    keep: {state: dims} that a readout of the state may not contract: a sum or contraction over
    them stays in the combine, over a smaller readout (layer_norm(C @ S, P)'s sum(C @ S, P) is
    sum(_r0, P) with _r0 = C @ S, so that every read of S contracts the same key dims N)."""
    readouts: list[Readout] = []
    keep = keep or {}

    def visit(node: ir.Expr) -> ir.Expr:
        vs = _versions(node)
        if not vs:
            return node
        if len(vs) == 1:
            (state, prev), = vs
            try:
                f = affine_in(mixer, node, state, "prev" if prev else "current")
            except NotAffine:
                f = None
            if f is not None and any(set(t.over) & keep.get(state, frozenset()) for t in f.terms):
                f = None
            if f is not None and f.const is None:
                for r in readouts:
                    if r.expr == node:
                        return ir.Ref(node.shape, node.span, r.name, "readout")
                name = f"_r{len(readouts)}"
                readouts.append(Readout(name, state, prev, f.terms, node.shape, node))
                return ir.Ref(node.shape, node.span, name, "readout")
        kids = ir.children(node)
        if not kids:
            raise SpecError("the output uses a state in a way mixc cannot split into readouts",
                            mixer.source, node.span)
        new = [visit(k) for k in kids]
        return _with_children(node, new)

    return visit(e), tuple(readouts)


# the node with new children (an IR helper; the name kept for its users here and in stabilize.py)
_with_children = ir.with_children


def specialize(mixer: ir.MixerIR, flags: dict[str, bool]) -> ir.MixerIR:
    """Resolve every `if FLAG then a else b` with the given flag values (defaults otherwise)."""
    values = {o.name: o.default for o in mixer.flags}
    values.update(flags)

    def resolve(node: ir.Expr) -> ir.Expr:
        # iterative post-order would be overkill: depth is bounded by the parser's limit
        if isinstance(node, ir.Cond):
            return resolve(node.then if values[node.flag] else node.otherwise)
        kids = ir.children(node)
        if not kids:
            return node
        return _with_children(node, [resolve(k) for k in kids])

    return replace(
        mixer,
        lets=tuple(replace(x, expr=resolve(x.expr)) for x in mixer.lets),
        updates=tuple(replace(u, expr=resolve(u.expr)) for u in mixer.updates),
        output=replace(mixer.output, expr=resolve(mixer.output.expr)),
    )

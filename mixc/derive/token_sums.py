"""A linear combination of readouts as a sum over tokens: the lint's proof that a normalizer
such as Based's z0 + qs @ z1 + qq @ z2 / 2 + eps is positive, where bounding each readout on
its own (bounds.py: qs @ z1 is of either sign) cannot show it.

A state S_t = a_t S_{t-1} + B_t (no projection terms, not part of a coupled system) started
from zero is S_t = sum_{j <= t} w_tj B_j with w_tj = a_{j+1} ... a_t. Where the readouts of a
denominator  sum_r c_r (proj_r @ S_r) + b  all read states with one and the same decay a >= 0,
not varying over a dim the readouts sum over, the weights are common and >= 0, and

    den_t = sum_{j <= t} w_tj P(t, j) + b_t,    P(t, j) = sum_r c_r (proj_r(t) @ B_r(j))

P is a sum of products of per-token values: each contraction proj(t) @ B(j) over a dim splits
into groups of factors that share the dims summed (a product of sums over disjoint dims), and
each group is one real number, one symbol for every group equal as written (a rename K -> J
undone first: qq @ (k (x) k) = (q . k)^2). Based's P = 1 + s + s^2 / 2 with s = scale q . k_j.
Then den > 0 where P >= 0 for all values and b > 0, or P > 0 for all values, b >= 0 and the
token's own term (w_tt = 1) is in the sum (not a prev() readout).

P is proven over all real values of its symbols (each contraction, each value outside one),
more than they can take, so a proof holds for every input: sympy's polynomial tools decide it,
P grouped into parts over disjoint symbols, each part a polynomial in one monomial m (Based's
m = scale s): a positive value at one point and no real root (Sturm sequences, exact in the
rationals) for the whole of it, or the vertex of a quadratic for a part of several.

Initial states: the proof is about states summed from zero, or from the final state of an
earlier call of the same mixer (which continues the same sums). An initial state passed from
elsewhere adds w_t0 (proj @ S_0), of any sign: the lint says nothing about it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp

from .bounds import lower_bound

# symbol kinds that are the same at every token (a proj at token t and a B at token j share them)
_SHARED_KINDS = ("option", "param", "dim", "head")
# give up on a denominator or P larger than this (operations), a contraction of more products
# of monomials, or P of a higher degree in its monomial: the lint stays quick on any spec
MAX_OPS = 400
MAX_PRODUCTS = 64
MAX_DEGREE = 8


@dataclass(frozen=True)
class TokenSum:
    """den_t = sum_{j <= t} w_tj per_token + rest, w_tj >= 0 (w_tt = 1 unless prev)."""

    per_token: sp.Expr     # P(t, j) over contraction symbols and the two tokens' values
    rest: sp.Expr          # b_t: the part free of readouts
    prev: bool             # the readouts read S_{t-1}: the sum is over j < t (empty at t = 0)


def token_sum(plan, den: sp.Expr) -> TokenSum | None:
    """den as a weighted sum over tokens of one per-token expression, or None where its
    readouts do not share weights (different decays, a decay over a summed dim, a decay that
    can be negative, projection terms, coupled states, prev() beside the current state) or a
    contraction does not split into products of sums."""
    by_symbol = {sp.Symbol(r.name, real=True): r for r in plan.output.readouts}
    present = [s for s in by_symbol if s in den.free_symbols]
    if not present or sp.count_ops(den) > MAX_OPS:
        return None
    coefs = {s: sp.diff(den, s) for s in present}
    if any(c.free_symbols & set(by_symbol) for c in coefs.values()):
        return None                     # not linear in the readouts
    rest = den.xreplace({s: 0 for s in present})
    if sp.expand(den - rest - sum(c * s for s, c in coefs.items())) != 0:
        return None
    states = {st.name: st for st in plan.states}
    coupled = {name for sy in plan.systems for name in sy.states}
    readouts = [by_symbol[s] for s in present]
    group = [states[r.state] for r in readouts]
    decay = group[0].decay
    if any(st.rank1 or st.name in coupled or st.decay != decay for st in group) or \
            len({r.prev for r in readouts}) != 1 or lower_bound(decay, plan.table) < 0:
        return None
    contract = _Contractions(plan.table)
    decay_dims = contract.dims(decay)
    per_token = []
    for s, r, st in zip(present, readouts, group):
        for scale, proj, over in r.terms:
            if decay_dims & set(over) or not decay_dims <= set(st.shape):
                return None             # the weight differs between the terms of the sum
            term = contract(scale * (proj if proj is not None else sp.S.One), st.input_term, set(over))
            if term is None:
                return None
            per_token.append(coefs[s] * term)
    return TokenSum(sp.Add(*per_token), rest, readouts[0].prev)


class _Contractions:
    """sum over dims of (query side at token t) * (input term at token j), as an expression in
    one real symbol per group of factors that share summed dims."""

    def __init__(self, table):
        self.t = table
        self.symbols: dict[tuple, sp.Symbol] = {}
        self.tags: dict[sp.Symbol, sp.Dummy] = {}

    def dims(self, e: sp.Expr) -> set[str]:
        return {d for s in e.free_symbols for d in self.t.shape(s)}

    def __call__(self, query: sp.Expr, term: sp.Expr, over: set[str]) -> sp.Expr | None:
        out = []
        queries = sp.Add.make_args(sp.expand(query, deep=False))
        terms = sp.Add.make_args(sp.expand(term, deep=False))
        if len(queries) * len(terms) > MAX_PRODUCTS:
            return None
        for a in queries:
            for b in terms:
                factors = [(f, "t") for f in sp.Mul.make_args(a)] + [(f, "j") for f in sp.Mul.make_args(b)]
                product = self.product(factors, over)
                if product is None:
                    return None
                out.append(product)
        return sp.Add(*out)

    def product(self, factors: list[tuple[sp.Expr, str]], over: set[str]) -> sp.Expr | None:
        """The sum over `over` of a product of factors, each of token t or j."""
        outside, inside = [], []
        for f, side in factors:
            (inside if self.dims(f) & over else outside).append((f, side))
        if over - {d for f, _ in inside for d in self.dims(f)}:
            return None                 # a summed dim that no factor varies over: a dim size
        value = sp.Mul(*[f if side == "t" else self.tag(f) for f, side in outside])
        for group, dims in _components(inside, over, self.dims):
            g = self.group(group, dims)
            if g is None:
                return None
            value *= g
        return value

    def group(self, factors: list[tuple[sp.Expr, str]], dims: set[str]) -> sp.Expr | None:
        renames = {s for f, _ in factors for s in f.free_symbols
                   if (nd := self.t.nodes.get(s)) is not None and nd.kind == "rename" and set(nd.shape) & dims}
        if renames:
            return self.undo_rename(factors, dims, renames)
        key = (sp.Mul(*[f for f, side in factors if side == "t"]),
               sp.Mul(*[f for f, side in factors if side == "j"]), tuple(sorted(dims)))
        if key not in self.symbols:
            self.symbols[key] = sp.Dummy(f"<{key[0]} | {key[1]}>_{''.join(key[2])}", real=True)
        return self.symbols[key]

    def undo_rename(self, factors, dims: set[str], renames: set[sp.Symbol]) -> sp.Expr | None:
        """sum_J rename(x, K -> J) rename(y, K -> J) = sum_K x y: where every summed dim is a
        target of the one mapping and nothing else in the group reads its sources or targets."""
        mappings = {self.t.nodes[s].mapping for s in renames}
        if len(mappings) != 1:
            return None
        mapping = dict(next(iter(mappings)))
        if not dims <= set(mapping.values()):
            return None
        touched = set(mapping) | set(mapping.values())
        if any(self.t.shape(s) and set(self.t.shape(s)) & touched
               for f, _ in factors for s in f.free_symbols if s not in renames):
            return None
        back = {s: self.t.nodes[s].operands[0] for s in renames}
        undone = [(g, side) for f, side in factors for g in sp.Mul.make_args(sp.expand(f.xreplace(back), deep=False))]
        if any(g.is_Add for g, _ in undone):
            return None
        inverse = {b: a for a, b in mapping.items()}
        return self.product(undone, {inverse[d] for d in dims})

    def tag(self, e: sp.Expr) -> sp.Expr:
        """e at token j: its per-token symbols replaced by their own (a scalar input x at t and
        at j are two numbers)."""
        swap = {}
        for s in e.free_symbols:
            if self.t.kinds.get(s) not in _SHARED_KINDS:
                swap[s] = self.tags.setdefault(s, sp.Dummy(f"{s}_j", real=True))
        return e.xreplace(swap)


def _components(inside, over: set[str], dims_of) -> list[tuple[list, set[str]]]:
    """The factors grouped so that no two groups share a summed dim (a product of sums)."""
    groups: list[tuple[list, set[str]]] = []
    for f, side in inside:
        mine = dims_of(f) & over
        joined = [g for g in groups if g[1] & mine]
        merged = ([(f, side)] + [x for g in joined for x in g[0]], mine.union(*(g[1] for g in joined)))
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return groups


def polynomial_sign(p: sp.Expr) -> str | None:
    """'positive' where p > 0, 'nonnegative' where p >= 0 for all real values of its symbols and
    functions (each taken as a free real: more values than they take), else None."""
    if sp.count_ops(p) > MAX_OPS or any(e.exp.is_Integer and abs(e.exp) > MAX_DEGREE for e in p.atoms(sp.Pow)):
        return None                 # (1 + s) ** 1000 is small as written, not expanded
    p = sp.expand(p)
    p = p.xreplace({f: sp.Rational(f) for f in p.atoms(sp.Float)})
    if not p.free_symbols:
        return "positive" if p > 0 else "nonnegative" if p == 0 else None
    if sp.count_ops(p) > MAX_OPS:
        return None
    try:
        poly = sp.Poly(p)
    except sp.PolynomialError:
        return None
    if not poly.domain.is_QQ and not poly.domain.is_ZZ:
        return None
    const = poly.coeff_monomial(1)
    parts = _parts([(m, c) for m, c in poly.terms() if any(m)])
    if len(parts) == 1:
        q = _in_one_monomial(parts[0])
        return None if q is None else _univariate_sign(q + const)
    lows = [_quadratic_minimum(q) for q in map(_in_one_monomial, parts) if q is not None]
    if len(lows) != len(parts) or any(x is None for x in lows):
        return None
    least = const + sum(lows)
    return "positive" if least > 0 else "nonnegative" if least == 0 else None


_M = sp.Symbol("m", real=True)


def _parts(terms):
    """The terms grouped so that no two groups share a symbol."""
    groups: list[tuple[list, set[int]]] = []
    for m, c in terms:
        mine = {i for i, e in enumerate(m) if e}
        joined = [g for g in groups if g[1] & mine]
        merged = ([(m, c)] + [x for g in joined for x in g[0]], mine.union(*(g[1] for g in joined)))
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [g[0] for g in groups]


def _in_one_monomial(terms) -> sp.Poly | None:
    """sum c x^(k e) as a polynomial in m = x^e (e the first term's exponents over their gcd),
    or None where a term is not a power of that m."""
    first = terms[0][0]
    step = math.gcd(*first)
    e = [x // step for x in first]
    i = next(i for i, x in enumerate(e) if x)
    coeffs = {}
    for m, c in terms:
        k, r = divmod(m[i], e[i])
        if r or k <= 0 or any(m[n] != k * e[n] for n in range(len(e))):
            return None
        coeffs[k] = c
    if max(coeffs) > MAX_DEGREE:
        return None
    return sp.Poly(sum(c * _M ** k for k, c in coeffs.items()), _M, domain="QQ")


def _univariate_sign(q: sp.Poly) -> str | None:
    """The sign of a polynomial in one real m: positive where it has no real root and is > 0 at
    0; nonnegative where its real roots are all of even multiplicity and it is > 0 somewhere."""
    if q.degree() <= 0:
        c = q.LC() if not q.is_zero else 0
        return "positive" if c > 0 else "nonnegative" if c == 0 else None
    if q.degree() % 2 or q.LC() < 0:
        return None
    if q.count_roots() == 0:
        return "positive"
    _, factors = q.sqf_list()
    if all(f.count_roots() == 0 for f, mult in factors if mult % 2):
        return "nonnegative"
    return None


def _quadratic_minimum(q: sp.Poly | None) -> sp.Rational | None:
    """The least value over the reals of c1 m + c2 m^2 (c0 = 0: the constants are summed apart)."""
    if q is None or q.degree() > 2:
        return None
    c2, c1 = q.coeff_monomial(_M ** 2), q.coeff_monomial(_M)
    if c2 < 0 or (c2 == 0 and c1 != 0):
        return None
    return -c1 ** 2 / (4 * c2) if c2 else sp.S.Zero

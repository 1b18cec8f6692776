"""The normalizer prover over tokens (derive/token_sums.py, read by derive/lint.py): a
denominator of readouts of states that sum the same tokens' outer products, with one decay >= 0,
is sum_j w_tj P(t, j) + b; P over the per-token contractions (s = scale q . k_j) is proven
positive with sympy's polynomial tools. Specs one sign or one decay away from a proof must
still warn."""
import math

import pytest
import sympy as sp

from mixc.derive.lint import lint
from mixc.derive.token_sums import polynomial_sign, token_sum
from mixc.pipeline import from_text
from mixc.runtime.inputs import random_args

# Based's normalizer (mixc/specs/based.mix), with its pieces open to change
TAYLOR = """mixer n
  dims   K, V, J = K
  input  q[K], k[K], v[V], g[]
  option scale = K ** -0.5
  let    qs = q * scale
  let    qq = qs * rename(qs, K -> J), kk = k * rename(k, K -> J)
  state  s1[K, V], z0[], z1[K], z2[K, J]
  update s1 = {decay} * s1 + k * v
  update z0 = {decay} * z0 + {one}
  update z1 = {z1_decay} * z1 + k
  update z2 = {decay} * z2 + kk
  output o = (qs @ s1) / ({den})
"""


def _divides_warning(decay="1", z1_decay=None, one="1", den="z0 + qs @ z1 + qq @ z2 / 2 + 1e-6") -> bool:
    text = TAYLOR.format(decay=decay, z1_decay=z1_decay or decay, one=one, den=den)
    return any("divides by" in w.message for w in lint(from_text(text, "n.mix").plan()))


@pytest.mark.parametrize("kw", [
    {},                                                             # 1 + s + s^2 / 2 + eps
    {"den": "z0 - qs @ z1 + qq @ z2 / 2"},                          # 1 - s + s^2 / 2 > 0 without eps
    {"den": "z0 + qs @ z1 + qq @ z2 / 2"},                          # > 0 from the token's own term
    {"decay": "sigmoid(g)"},                                        # common weights in (0, 1)
    {"one": "0.5"},                                                 # (s + 1)^2 / 2 >= 0, + eps
    {"den": "prev(z0) + qs @ prev(z1) + qq @ prev(z2) / 2 + 1e-6"},  # empty at t = 0, eps > 0
    {"den": "2 * z0 + 2 * (qs @ z1) + qq @ z2 + 1e-6"},             # any positive multiple
], ids=["based-taylor", "minus-linear-no-eps", "no-eps-token-own-term", "gated-sigmoid",
        "perfect-square-with-eps", "prev-with-eps", "scaled"])
def test_a_normalizer_positive_over_tokens_gives_no_warning(kw):
    """Proven, and so it is: the denominator itself as the output is > 0 on fresh random inputs
    (q, k scaled so that s = scale q . k_j sweeps through the Taylor polynomial's minimum)."""
    assert not _divides_warning(**kw)
    fill = {"decay": "1", "one": "1", "den": "z0 + qs @ z1 + qq @ z2 / 2 + 1e-6"} | kw
    fill.setdefault("z1_decay", fill["decay"])
    text = TAYLOR.format(**fill).replace(f"(qs @ s1) / ({fill['den']})", f"({fill['den']}) * (v * 0 + 1)")
    op = from_text(text)
    low = math.inf
    for seed, size in [(0, 0.3), (1, 1.0), (2, 3.0)]:
        args, _ = random_args(op.ir, B=2, T=12, H=2, sizes={"K": 3, "V": 2}, seed=seed)
        args = {n: x * size if n in ("q", "k") else x for n, x in args.items()}
        low = min(low, op(**args, mode="reference")[0].min().item())
    assert low > 0


@pytest.mark.parametrize("kw", [
    {"den": "z0 + 3 * qs @ z1 + qq @ z2 / 2 + 1e-6"},               # 1 + 3 s + s^2 / 2: roots at -3 +- sqrt 7
    {"den": "z0 + qs @ z1 - qq @ z2 / 2 + 1e-6"},                   # leading coefficient < 0
    {"one": "0.4"},                                                 # 0.4 + s + s^2 / 2: roots
    {"one": "0.5", "den": "z0 + qs @ z1 + qq @ z2 / 2"},            # (s + 1)^2 / 2: 0 at s = -1, no eps
    {"den": "prev(z0) + qs @ prev(z1) + qq @ prev(z2) / 2"},        # the empty sum at t = 0
    {"den": "z0 + qs @ prev(z1) + qq @ z2 / 2 + 1e-6"},             # prev beside the current state
    {"decay": "tanh(g)"},                                           # a decay that can be negative
    {"z1_decay": "sigmoid(g)"},                                     # weights differ between the states
    {"den": "qs @ z1 + qq @ z2 / 2 + 1e-6"},                        # s + s^2 / 2 < 0 at s = -1
], ids=["indefinite-3s", "negative-leading", "constant-too-small", "perfect-square-no-eps", "prev-no-eps",
        "prev-mixed", "negative-decay", "different-decays", "no-constant"])
def test_a_normalizer_one_change_away_is_still_warned(kw):
    assert _divides_warning(**kw)


SCALAR = """mixer x
  dims   V
  input  x[], v[V]
  state  S[V], z[]
  update S = S + x * v
  update z = z + {term}
  output o = S / ({den})
"""


@pytest.mark.parametrize("term,den,warned", [("x", "x * z + 1e-6", True), ("x * x", "z + 1e-6", False),
                                             ("x", "x * x * z + 1e-6", True), ("exp(x)", "exp(x) * z", False)],
                         ids=["x_t-times-x_j", "square-per-token", "x_t-squared-times-x_j", "exp-both-tokens"])
def test_the_query_token_and_the_summed_token_are_two_values(term, den, warned):
    """x_t x_j is of either sign: the same input read at t (outside the state) and at j (inside
    it) are two numbers, never x^2."""
    ws = lint(from_text(SCALAR.format(term=term, den=den)).plan())
    assert any("divides by" in w.message for w in ws) == warned


def test_a_key_diagonal_decay_has_no_common_weight():
    """z = a[K] * z + k: the weight of token j differs across K, so q . z is no sum over tokens
    of q . k_j; the prover gives up (the form is not taken) rather than prove."""
    text = """mixer d
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  state  S[K, V], z0[], z1[K]
  update S = S + k * v
  update z0 = z0 + 1
  update z1 = sigmoid(g) * z1 + k
  output o = (q @ S) / (z0 + (q @ z1) + 1e-6)
"""
    plan = from_text(text).plan()
    _, den = sp.fraction(sp.together(plan.output.combine))
    assert token_sum(plan, den) is None


def test_based_per_token_form_is_the_taylor_polynomial():
    import mixc
    plan = mixc.load("based").plan()
    _, den = sp.fraction(sp.together(plan.output.combine))
    form = token_sum(plan, den)
    (s,) = [x for x in form.per_token.free_symbols if x.name != "scale"]   # one contraction: q . k_j
    scale = sp.Symbol("scale", real=True)
    assert sp.expand(form.per_token - (1 + scale * s + (scale * s) ** 2 / 2)) == 0
    assert form.rest == sp.Float(1e-6) and not form.prev
    assert lint(plan) == []


s, t, a, x = sp.symbols("s t a x", real=True)


@pytest.mark.parametrize("p,sign", [
    (1 + s + s ** 2 / 2, "positive"),
    ((s + 1) ** 2, "nonnegative"),
    (1 + 3 * s + s ** 2 / 2, None),
    (1 + s - s ** 2, None),
    (1 + s, None),
    (1 + a * s + (a * s) ** 2 / 2, "positive"),
    (1 + sp.Function("sigmoid")(x) * s + (sp.Function("sigmoid")(x) * s) ** 2, "positive"),
    (s ** 4 - s ** 2 + 1, "positive"),
    ((s ** 2 - 1) ** 2, "nonnegative"),
    ((s - 1) ** 2 * (s + 2), None),
    (2 + s + s ** 2 / 2 + t + t ** 2 / 2, "positive"),
    (1 + s + s ** 2 / 2 + t + t ** 2 / 2, "nonnegative"),
    (sp.Rational(9, 10) + s + s ** 2 / 2 + t + t ** 2 / 2, None),
    (1 + s * t, None),
    (1 + s * t + s ** 2 * t ** 2, "positive"),
    (1 + s ** 2 + t ** 2 + s * t, None),         # positive, but not a polynomial in one monomial: not proven
    (sp.Float(1e-6), "positive"),
    (sp.S.Zero, "nonnegative"),
], ids=["taylor", "square", "indefinite", "negative-leading", "linear", "one-monomial", "function-generator",
        "quartic", "square-of-quadratic", "odd-degree", "two-parts", "two-parts-touching-zero", "two-parts-negative",
        "bilinear", "bilinear-taylor", "coupled-quadratic-not-proven", "float", "zero"])
def test_polynomial_sign(p, sign):
    assert polynomial_sign(p) == sign


SAME_INPUT = """mixer c
  dims   K, V, J = K
  input  q[K], v[V]
  state  S[K, V], z0[], z1[K], z2[K, J]
  update S = S + q * v
  update z0 = z0 + 1
  update z1 = z1 + q
  update z2 = z2 + q * rename(q, K -> J)
  output o = (q @ S) / ({den})
"""


@pytest.mark.parametrize("den,warned", [("z1 @ q + 1e-6", True),
                                        ("z0 + 2 * (q @ z1) + (q * rename(q, K -> J)) @ z2 + 1e-6", False)],
                         ids=["q_t-dot-q_j", "square-of-1-plus-q_t-dot-q_j"])
def test_a_contraction_of_the_same_input_at_two_tokens_is_no_square(den, warned):
    """q_t . q_j (z1 sums q) is of either sign, not |q|^2 >= 0: warned; (1 + q_t . q_j)^2 is
    >= 0 whatever the two tokens' q are: proven."""
    ws = lint(from_text(SAME_INPUT.format(den=den)).plan())
    assert any("divides by" in w.message for w in ws) == warned

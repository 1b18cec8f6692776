"""Functions over a dim (mixc/dsl/dim_functions.py): softmax, logsumexp, mean, layer_norm,
rms_norm, l2norm. Their shapes, the nodes they are written out into (the stable forms: the max
subtracted, eps inside the root), positioned errors for their misuse, and the docs that name
them. Their values against torch's own functions in every mode: tests/ops/test_dim_functions.py."""
from __future__ import annotations

from pathlib import Path

import pytest

import mixc
from mixc.derive.plan import derive
from mixc.dsl import ir
from mixc.dsl.dim_functions import DIM_FNS
from mixc.dsl.unparse import expr_text

from .spec_checks import assert_user_words

ROOT = Path(__file__).resolve().parents[2]

HEAD = """mixer m
  dims   K, V, M
  input  q[K], k[K], v[V], x[K, M]
  option e = 1e-3
  state  S[K, V]
  update S = S + k * v
"""


def let_of(expr: str) -> ir.Expr:
    m = mixc.parse(HEAD + f"  let f = {expr}\n  output o = q @ S\n", "t.mix")
    return m.let("f").expr


@pytest.mark.parametrize("expr,shape", [
    ("softmax(x, M)", ("K", "M")), ("softmax(x, K, M)", ("K", "M")), ("logsumexp(x, M)", ("K",)),
    ("logsumexp(x, K, M)", ()), ("mean(x, K)", ("M",)), ("layer_norm(x, M)", ("K", "M")),
    ("rms_norm(q, K)", ("K",)), ("l2norm(x, K, M)", ("K", "M")), ("l2norm(q, K, eps=e)", ("K",))])
def test_shapes(expr, shape):
    assert let_of(expr).shape == shape


@pytest.mark.parametrize("expr,text", [
    ("softmax(q, K)", "exp(q - max(q, K)) / sum(exp(q - max(q, K)), K)"),
    ("logsumexp(q, K)", "max(q, K) + log(sum(exp(q - max(q, K)), K))"),
    ("mean(x, K, M)", "sum(x, K, M) / (K * M)"),
    ("rms_norm(q, K)", "q / sqrt(sum(q * q, K) / K + 1e-05)"),
    ("rms_norm(q, K, eps=2 * e)", "q / sqrt(sum(q * q, K) / K + 2 * e)"),
    ("l2norm(q, K)", "q / sqrt(sum(q * q, K) + 1e-06)"),
    ("layer_norm(q, K)", "(q - sum(q, K) / K) / sqrt(sum((q - sum(q, K) / K) * (q - sum(q, K) / K), K) / K + 1e-05)"),
])
def test_written_out_in_the_stable_forms(expr, text):
    """The max over the dim is subtracted before exp (no overflow); eps (fla's defaults:
    l2norm 1e-6, the others 1e-5, or eps=) is added inside the root."""
    assert expr_text(let_of(expr)) == text


def test_every_node_points_at_the_call():
    """An error or warning about a written-out part (the log of the sum, the division) points
    at the call the user wrote."""
    e = let_of("softmax(q, K)")
    spans = {(n.span.line, n.span.column) for n in ir.walk(e) if not isinstance(n, ir.Ref)}
    assert spans == {(7, 11)}


HEAD_ERR = HEAD + "  output o = q @ S\n"


def first_error(text: str) -> mixc.SpecError:
    with pytest.raises(mixc.SpecError) as info:
        derive(mixc.parse(text, "bad.mix"))
    return info.value


@pytest.mark.parametrize("expr,column,words", [
    ("softmax(q)", 11, "softmax() takes a value and the dims it works over, e.g. softmax(x, K); got 1 argument"),
    ("l2norm()", 11, "l2norm() takes a value and the dims it works over, e.g. l2norm(x, K, eps=1e-6); got 0"),
    ("softmax(q, Kk)", 22, "softmax() works over dims: expected a dim name here (did you mean 'K'?)"),
    ("mean(q, q)", 19, "mean() works over dims: expected a dim name here"),
    ("softmax(q, V)", 22, "softmax() over V, but its argument has shape [K]"),
    ("logsumexp(x, M, M)", 27, "logsumexp() names dim M twice"),
    ("softmax(q, K, eps=1e-3)", 25, "softmax() takes no argument by name, not 'eps='"),
    ("rms_norm(q, K, scale=2)", 26, "rms_norm() takes only 'eps=' by name, not 'scale='"),
    ("l2norm(q, K, eps=1, eps=2)", 31, "l2norm() takes 'eps=' once"),
    ("l2norm(q, eps=1e-3, K)", 21, "l2norm(): 'eps=' comes after the value and its dims"),
    ("layer_norm(q, K, eps=k)", 32, "layer_norm()'s eps must be a scalar, but it has shape [K]"),
    ("softmax(q, K -> V)", 22, "softmax() works over dims: expected a dim name here"),
])
def test_misuse_is_an_error_at_its_place(expr, column, words):
    err = first_error(HEAD_ERR + f"  let f = {expr}\n")
    assert words in err.message, str(err)
    assert (err.line, err.column) == (8, column), str(err)
    assert_user_words(err)


@pytest.mark.parametrize("fn", sorted(DIM_FNS))
def test_a_function_name_is_reserved(fn):
    err = first_error(HEAD_ERR + f"  let {fn} = q\n")
    assert (err.line, err.column) == (8, 7)
    assert fn in err.message


def test_docs_name_every_function_with_an_example():
    """docs/language.md has a section with a mix example that calls each function."""
    text = (ROOT / "docs" / "language.md").read_text()
    section = text[text.index("#### Functions over a dim"):]
    section = section[:section.index("\n#### ", 5)]
    blocks = [b.split("```", 1)[0] for b in section.split("```mix")[1:]]
    for fn in DIM_FNS:
        assert any(f"{fn}(" in b for b in blocks), f"no example calls {fn}"
    for b in blocks:            # every example checks
        mixc.parse(b, "example.mix")

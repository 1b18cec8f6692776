"""Declared ranges (`input beta[] in (0, 2)`, `param lb[V] in [0, 1]`): parsed into the IR,
printed back, and refused at their place where they make no sense."""
import math

import pytest

import mixc
from mixc.dsl import ir
from mixc.dsl.unparse import spec_text

HEAD = "mixer m\n  dims   K, V\n"
TAIL = "  state  S[K, V]\n  update S = S + k * v\n  output o = q @ S\n"


def spec(inputs: str = "  input  q[K], k[K], v[V]\n", extra: str = "") -> str:
    return HEAD + inputs + extra + TAIL


@pytest.mark.parametrize("text,want", [
    ("[0, 1]", ir.ValueRange(0.0, 1.0, True, True)),
    ("(0, 2)", ir.ValueRange(0.0, 2.0, False, False)),
    ("(-inf, 0]", ir.ValueRange(-math.inf, 0.0, False, True)),
    ("[0, inf)", ir.ValueRange(0.0, math.inf, True, False)),
    ("[1 / 16, 2 ** 3)", ir.ValueRange(0.0625, 8.0, True, False)),
    ("(-(1 + 1), exp(0)]", ir.ValueRange(-2.0, 1.0, False, True)),
    ("[0.5, 0.5]", ir.ValueRange(0.5, 0.5, True, True)),
], ids=["closed", "open", "to-zero", "from-zero", "expressions", "functions", "one-value"])
def test_a_range_is_parsed_onto_its_declaration(text, want):
    m = mixc.parse(spec(f"  input  q[K], k[K], v[V], beta[] in {text}\n"))
    assert m.input("beta").range == want
    assert m.input("q").range is None


def test_params_take_ranges_and_inputs_keep_theirs_beside_them():
    m = mixc.parse(spec("  input  q[K], k[K] in [-1, 1], v[V]\n", "  param  lb[V] in [0, 1], u[K]\n"))
    assert m.input("k").range == ir.ValueRange(-1.0, 1.0)
    assert m.param("lb").range == ir.ValueRange(0.0, 1.0) and m.param("u").range is None


def test_spec_text_round_trips_the_ranges():
    text = spec("  input  q[K], k[K], v[V], beta[] in (0, 2), g[K] in (-inf, 0]\n",
                "  param  lb[V] in [0.25, 1]\n")
    m = mixc.parse(text)
    printed = spec_text(m)
    assert "beta[] in (0, 2), g[K] in (-inf, 0]" in printed and "lb[V] in [0.25, 1]" in printed
    again = mixc.parse(printed)
    assert again == m and [d.range for d in again.inputs + again.params] == [d.range for d in m.inputs + m.params]


def test_library_gates_carry_their_ranges():
    from mixc.dsl import load_ir
    assert load_ir("gla").input("g").range == ir.ValueRange(-math.inf, 0.0, True, True)   # -inf included: a reset
    assert load_ir("mamba2").param("A").range == ir.ValueRange(-math.inf, 0.0, True, True)   # -inf included: a reset


E = pytest.param


@pytest.mark.parametrize("text,line,column,words", [
    E(spec(extra="  state  Z[K] in [0, 1]\n"), 4, 15, "a state takes no range (a state's values follow from its update)",
      id="on-a-state"),
    E(spec(extra="  let    a = q in [0, 1]\n"), 4, 16, "a let takes no range", id="on-a-let"),
    E(spec(extra="  option eps = 1e-6 in [0, 1]\n"), 4, 21, "an option takes no range", id="on-an-option"),
    E(spec(extra="  param  lb[V] in [1, 0]\n"), 4, 16,
      "the range [1, 0] of param 'lb' is empty: its lower end 1 is above its upper end 0", id="lower-above-upper"),
    E(spec(extra="  param  lb[V] in [1, 1)\n"), 4, 16,
      "the range [1, 1) of param 'lb' is empty: an open end at 1 leaves no value", id="open-at-one-value"),
    E(spec(extra="  param  lb[V] in [0, K]\n"), 4, 23,
      "the ends of a range are numbers (or -inf, inf), but 'K' is not a number", id="a-dim-end"),
    E(spec(extra="  param  lb[V] in [q, 1]\n"), 4, 20,
      "the ends of a range are numbers (or -inf, inf), but 'q' is not a number", id="an-input-end"),
    E(spec(extra="  option e = 1\n  param  lb[V] in [0, e]\n"), 5, 23,
      "the ends of a range are numbers (or -inf, inf), but 'e' is not a number", id="an-option-end"),
    E(spec(extra="  param  lb[V] in [0, 1 / 0]\n"), 4, 23, "'1 / 0' divides by zero", id="no-value"),
    E(spec(extra="  param  lb[V] in [0 1]\n"), 4, 22, "unexpected '1'; expected ','", id="missing-comma"),
    E(spec(extra="  param  lb[V] in 0, 1\n"), 4, 19, "unexpected '0'; expected '(' or '['", id="no-bracket"),
    E(spec(extra="  param  in[V]\n"), 4, 10, "'in' is a keyword", id="in-as-a-name"),
])
def test_misused_ranges_are_refused_at_their_place(text, line, column, words):
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(text, "bad.mix")
    err = info.value
    assert words in err.message, err.message
    assert (err.filename, err.line, err.column) == ("bad.mix", line, column), str(err)
    assert f"bad.mix:{line}:{column}: error: " in str(err) and "^" in str(err)


def test_an_error_after_a_let_does_not_offer_a_range():
    """Only inputs and params take a range: after a let's expression the parser's list of what
    may follow leaves `in` out (a let's range is refused by the checker where it is written)."""
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(spec(extra="  let    a = q q\n"))
    assert "'in'" not in info.value.message

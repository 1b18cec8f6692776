"""Constant tensors (`const W[E] = [0.5, 1.0]`): values the spec fixes over fixed-size dims.
Parsed into the IR as params with values (MixerIR.consts), printed back, and refused at their
place: a dim a call sizes, a list of the wrong length, a number where a list belongs (and the
reverse), a name or a value without a number among the elements, a name clash, an update."""
import pytest

import mixc
from mixc.dsl import ir
from mixc.dsl.unparse import spec_text

HEAD = "mixer m\n  dims   K, V, E = 2, F = 3\n  input  q[K], k[K], v[V]\n"
TAIL = "  state  S[E, K, V]\n  update S = S + k * v\n  output o = q @ (W @ S)\n"


def spec(consts: str = "  const  W[E] = [0.5, 1]\n", extra: str = "") -> str:
    return HEAD + consts + extra + TAIL


@pytest.mark.parametrize("decl,shape,values", [
    ("P[E] = [0.5, 1.0]", ("E",), (0.5, 1.0)),
    ("P[E] = [1 / 16, 2 ** -5]", ("E",), (0.0625, 0.03125)),
    ("P[E] = [-(1 + 1), exp(0)]", ("E",), (-2.0, 1.0)),
    ("P[E, F] = [[1, 0, 2], [0, 1, 3]]", ("E", "F"), (1.0, 0.0, 2.0, 0.0, 1.0, 3.0)),
    ("P[F, E] = [[1, 2], [3, 4], [5, 6]]", ("F", "E"), (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)),
    ("P[] = 3", (), (3.0,)),
], ids=["E2-numbers", "E2-expressions", "E2-functions", "E2-F3-rows", "F3-E2-rows", "scalar"])
def test_a_const_is_a_param_with_its_values(decl, shape, values):
    m = mixc.parse(spec(extra=f"  const  {decl}\n"))
    assert m.const("P") == ir.Const("P", shape, values, None)
    assert m.param("P").shape == shape and m.param("P").range == ir.ValueRange(min(values), max(values))
    assert [p.name for p in m.params] == ["W", "P"] and m.given_params == ()


def test_consts_follow_the_params_a_caller_passes():
    m = mixc.parse(spec(extra="  param  u[K]\n  const  c[] = 2, D[E] = [1, 2]\n"))
    assert [p.name for p in m.params] == ["u", "W", "c", "D"]
    assert [p.name for p in m.given_params] == ["u"] and m.const("u") is None


def test_spec_text_round_trips_the_consts():
    m = mixc.parse(spec(extra="  const  P[E, F] = [[1, 0, 0.1], [0, 1, 2 ** -5]], c[] = -1 / 4\n"))
    printed = spec_text(m)
    assert "const  P[E, F] = [[1, 0, 0.1], [0, 1, 0.03125]]" in printed and "const  c[] = -0.25" in printed
    assert mixc.parse(printed) == m


def test_an_alias_of_a_fixed_dim_is_fixed():
    m = mixc.parse(spec(extra="  const  P[G] = [1, 2]\n").replace("F = 3", "F = 3, G = E"))
    assert m.const("P").values == (1.0, 2.0)


E = pytest.param


@pytest.mark.parametrize("text,line,column,words", [
    E(spec("  const  W[K] = [1, 2]\n"), 4, 12,
      "dim 'K' of const 'W' has no fixed size: a call's tensors bind it", id="call-sized-dim"),
    E(spec("  const  W[T] = [1, 2]\n"), 4, 12, "const 'W' cannot have dim T", id="positions-dim"),
    E(spec("  const  W[G] = [1, 2]\n"), 4, 12, "unknown dim 'G'", id="unknown-dim"),
    E(spec("  const  W[E] = [1, 2, 3]\n"), 4, 17,
      "const 'W' is [E]: dim E has size 2, but this list has 3 values", id="E2-list-of-3"),
    E(spec("  const  W[E] = []\n"), 4, 17, "dim E has size 2, but this list has 0 values", id="E2-empty-list"),
    E(spec("  const  W[E] = [1, 2]\n  const  P[E, F] = [[1, 2, 3], [4, 5]]\n"), 5, 32,
      "const 'P' is [E, F]: dim F has size 3, but this list has 2 values", id="E2-F3-short-row"),
    E(spec("  const  W[E] = 1\n"), 4, 17,
      "const 'W' is [E]: expected a list of 2 values along dim E here, got a number", id="E2-number-for-list"),
    E(spec("  const  W[E] = [[1], 2]\n"), 4, 18, "expected a number here, got a list", id="E2-list-for-number"),
    E(spec("  const  W[E] = [1, 2]\n  const  c[] = [1]\n"), 5, 16,
      "const 'c' is a scalar: expected a number here, got a list", id="scalar-list"),
    E(spec("  const  W[E] = [1, q]\n"), 4, 21,
      "the values of const 'W' are numbers fixed by the spec (e.g. 0.5, 1 / 16, 2 ** -5), but 'q' is an input",
      id="an-input-element"),
    E(spec("  const  W[E] = [K, 1]\n"), 4, 18, "but 'K' is a dim", id="a-dim-element"),
    E(spec("  option e = 1\n  const  W[E] = [e, 1]\n"), 5, 18, "but 'e' is an option", id="an-option-element"),
    E(spec("  const  W[E] = [1, inf]\n"), 4, 21, "but 'inf' is not a number", id="inf-element"),
    E(spec("  const  W[E] = [1, 1 / 0]\n"), 4, 21, "'1 / 0' divides by zero", id="no-value"),
    E(spec("  const  W[E] = [1, true]\n"), 4, 21, "true and false may only be the default of an option", id="bool"),
    E(spec("  const  q[E] = [1, 2]\n"), 4, 10, "'q' is already declared (as an input on line 3)", id="clash-input"),
    E(spec(extra="  let    W = q\n"), 5, 10, "'W' is already declared (as a const on line 4)", id="assigned-by-let"),
    E(spec(extra="  param  dp_W[K]\n"), 5, 10,
      "param 'dp_W' and the gradient of param 'W' would have the same name in generated code (p_dp_W)",
      id="kernel-argument-clash"),
    E(spec("  const  W[E] = [1, 2]\n  const  tl[] = 1\n"), 5, 10, "'tl' is a reserved name", id="reserved"),
    E(spec() + "  update W = 1\n", 8, 10, "'W' is a const (line 4): its values are fixed by the spec and cannot be "
      "updated", id="updated"),
    E(spec(extra="  let    a = prev(W)\n"), 5, 19, "prev() of const 'W': a const has the same value at every token",
      id="prev-of-a-const"),
    E(spec("  const  W[E] = [1, 2\n"), 5, 3, "unexpected 'state'", id="unclosed-list"),
    E(spec("  const  W[E]\n"), 5, 3, "unexpected 'state'; expected '='", id="no-value-given"),
])
def test_misused_consts_are_refused_at_their_place(text, line, column, words):
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(text, "bad.mix")
    err = info.value
    assert words in err.message, err.message
    assert (err.filename, err.line, err.column) == ("bad.mix", line, column), str(err)
    assert f"bad.mix:{line}:{column}: error: " in str(err) and "^" in str(err)


def test_too_many_values_are_refused():
    with pytest.raises(mixc.SpecError, match="const .P. has 4352 values; the limit is 4096"):
        mixc.parse(spec(extra="  const  P[A, A2, A3] = 0\n").replace("F = 3", "F = 3, A = 16, A2 = 16, A3 = 17"))


def test_lists_nested_past_the_rank_are_refused_where_they_start():
    """20,000 nested lists: refused at the first one too deep, no recursion through them."""
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(spec("  const  W[E] = " + "[" * 20000 + "1" + "]" * 20000 + "\n"), "deep.mix")
    assert info.value.message == "const 'W' is [E]: dim E has size 2, but this list has 1 value"
    assert (info.value.line, info.value.column) == (4, 17)

"""Literal-size dims (`dims E = 2`): the spec fixes the size; checked, printed back, refused
at their place where the size is not a whole number in range."""
import pytest

import mixc
from mixc.dsl import ir
from mixc.dsl.unparse import spec_text
from range_specs import STACK


def test_a_fixed_dim_needs_no_tensor_to_size_it():
    m = mixc.parse(STACK)
    assert m.dim("E") == ir.Dim("E", None, None, 3) and m.fixed_size("E") == 3 and m.fixed_size("K") is None
    assert m.state("Z").shape == ("E", "K", "V")


def test_an_alias_of_a_fixed_dim_has_its_size():
    m = mixc.parse(STACK.replace("dims   E = 3, K, V", "dims   E = 3, F = E, K, V"))
    assert m.fixed_size("F") == 3 and m.dim("F").size is None


def test_spec_text_round_trips_a_fixed_dim():
    m = mixc.parse(STACK)
    assert "dims   E = 3, K, V" in spec_text(m)
    assert mixc.parse(spec_text(m)) == m


@pytest.mark.parametrize("size,column,words", [
    ("0", 14, "the size of dim 'E' must be a whole number from 1 to 1024, not 0"),
    ("2.5", 14, "the size of dim 'E' must be a whole number from 1 to 1024, not 2.5"),
    ("5000", 14, "not 5000"),
])
def test_a_bad_size_is_refused_at_the_number(size, column, words):
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(STACK.replace("E = 3", f"E = {size}"), "bad.mix")
    assert words in info.value.message and (info.value.line, info.value.column) == (3, column)


def test_an_unsized_dim_suggests_fixing_it():
    with pytest.raises(mixc.SpecError, match="use it in an input or param shape, or fix it: dims E = 2"):
        mixc.parse(STACK.replace("E = 3", "E").replace("param  w[E]\n", "").replace("(w @ Z)", "sum(Z, E)"))

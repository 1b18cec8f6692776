"""The derivation's cost is bounded: chains of lets are linear (a let past a size is kept as a
symbol, not written out), and a spec past the time or size budget gets a SpecError at the line
it was deriving (derive/budget.py), never a hang."""
import time

import pytest

import mixc
from mixc.derive import budget
from mixc.derive.plan import derive


def chain(n: int) -> str:
    lets = "".join(f"  let a{i} = sigmoid(a{i - 1}) + a{i - 1}\n" for i in range(1, n))
    return ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[K]\n  let a0 = g\n" + lets
            + f"  state S[K, V]\n  update S = sigmoid(a{n - 1}) * S + k * v\n  output o = q @ S\n")


def test_a_chain_of_lets_derives_in_linear_time():
    """Each line doubles the let written out: 14 lines took 21-26 s, 18 lines over 90 s."""
    t0 = time.perf_counter()
    plan = derive(mixc.parse(chain(18)))
    assert time.perf_counter() - t0 < 20
    assert plan.states[0].transition == "key-diagonal decay"
    assert plan.table.lets                         # the long ones are symbols of their own
    assert not plan.states[0].time_invariant       # and their inputs are still seen through them


def test_a_spec_past_the_time_budget_is_refused_at_its_line(monkeypatch):
    monkeypatch.setenv("MIXC_DERIVE_SECONDS", "0")
    with pytest.raises(mixc.SpecError) as err:
        derive(mixc.parse(chain(3), "chain.mix"))
    assert err.value.line == 4 and "deriving the spec took more than its budget of 0 s (it was at let 'a0'" \
        in err.value.message
    assert str(err.value).startswith("chain.mix:4:")


def test_an_expression_past_the_size_budget_is_refused_at_its_line(monkeypatch):
    monkeypatch.setattr(budget, "MAX_EXPR_NODES", 20)
    with pytest.raises(mixc.SpecError) as err:
        derive(mixc.parse(chain(4)))
    assert err.value.line == 6 and "the derivation grew too large at the derivatives of let 'a2'" in err.value.message


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", ""])
def test_a_bad_budget_variable_is_named(monkeypatch, value):
    """MIXC_DERIVE_SECONDS=abc was float()'s bare ValueError (issue 30)."""
    monkeypatch.setenv("MIXC_DERIVE_SECONDS", value)
    with pytest.raises(ValueError, match="^MIXC_DERIVE_SECONDS: expected a number of seconds >= 0"):
        derive(mixc.parse(chain(2)))

"""Coupled states (issue 32 item 2): updates run in the order written, and states that read
one another are one block-affine system (derive/coupled.py), which the plan classifies, and
`mixc explain` and the round trip through spec text describe truthfully."""
from __future__ import annotations

import pytest

import mixc
from mixc import classes
from mixc.derive.explain import explain
from mixc.derive.plan import derive
from mixc.dsl import ir
from mixc.dsl.unparse import spec_text

SYSTEM = classes.SYSTEM_CLASS

TITANS = """mixer titans
  dims   K, V
  input  q[K], k[K], v[V], eta[], theta[], alpha[]
  state  mom[K, V], mem[K, V]
  update mom = eta * mom - theta * k * (k @ mem - v)
  update mem = (1 - alpha) * mem + {mom}
  output o = q @ mem
"""


def _plan(text: str):
    return derive(mixc.parse(text, "m.mix"))


def test_a_later_update_reads_the_new_value_written_out():
    """mem reads mom's new value: the IR writes it out, so every update reads previous values."""
    m = mixc.parse(TITANS.format(mom="mom"), "m.mix")
    mem = m.update("mem").expr
    # mem's only prev() is mom's own read of the previous memory (mom's update comes first)
    assert {n.state for n in ir.walk(mem) if isinstance(n, ir.Prev)} == {"mem"}
    assert ir.refs(mem, "state") == {"mom", "mem"}
    # the written-out value is mom's update itself (the same nodes: the kernels compute it once)
    assert any(n == m.update("mom").expr for n in ir.walk(mem))


def test_prev_and_an_earlier_update_read_the_previous_value():
    new = mixc.parse(TITANS.format(mom="mom"), "m.mix").update("mem").expr
    old = mixc.parse(TITANS.format(mom="prev(mom)"), "m.mix").update("mem").expr
    assert not any(n == mixc.parse(TITANS.format(mom="mom"), "m.mix").update("mom").expr for n in ir.walk(old))
    assert new != old
    # the update of mom, written first, reads mem's previous value
    mom = mixc.parse(TITANS.format(mom="mom"), "m.mix").update("mom").expr
    assert ir.refs(mom, "state") == {"mom", "mem"}


@pytest.mark.parametrize("read", ["mom", "prev(mom)"])
def test_spec_text_round_trips(read):
    """The checked spec printed back (another state's previous value as prev(X)) parses to
    the same updates: the dump never turns a previous value into a new one."""
    m = mixc.parse(TITANS.format(mom=read), "m.mix")
    again = mixc.parse(spec_text(m), "again.mix")
    assert "prev(mom)" in spec_text(m) and "prev(mem)" in spec_text(m)
    for u in m.updates:       # the states each update reads (every read is X_{t-1} in the IR)
        assert again.update(u.state).expr.shape == u.expr.shape
        assert ir.refs(again.update(u.state).expr, "state") == ir.refs(u.expr, "state")
    assert derive(again).systems[0].describe() == derive(m).systems[0].describe()


def test_titans_blocks_and_forms():
    plan = _plan(TITANS.format(mom="mom"))
    assert plan.transition == SYSTEM and plan.forms == ("recurrent", "step")
    assert [s.transition for s in plan.states] == [SYSTEM, SYSTEM]
    (sy,) = plan.systems
    assert sy.states == ("mom", "mem")
    kinds = {(b.of, b.wrt): b.kind() for b in sy.blocks}
    assert kinds == {("mom", "mom"): "scalar", ("mom", "mem"): "rank-1 over K", ("mem", "mom"): "scalar",
                     ("mem", "mem"): "scalar + rank-1 over K"}
    # with prev(mom) the memory does not take this token's momentum: no rank-1 term in mem <- mem
    old = _plan(TITANS.format(mom="prev(mom)")).systems[0]
    assert old.block("mem", "mem").kind() == "scalar" and old.block("mem", "mom").kind() == "scalar"
    assert not any("never read" in n for n in plan.notes)       # mom is read through mem


def test_explain_names_the_system_and_its_blocks():
    text = explain(_plan(TITANS.format(mom="mom")))
    assert "class: block-affine system (mom, mem: a 2x2 block-affine system, scalar per head, with rank-1 " \
           "projections over K)" in text
    assert "forms: recurrent, step\n" in text
    assert "mom <- mem: rank-1 over K" in text and "mem <- mom: scalar" in text
    assert "dmom_{t-1} = (eta) * dmom_t + (eta) * dmem_t" in text      # the transposed blocks
    assert "chunk" not in text.split("forms:")[1].split("\n")[0]


def test_a_diagonal_system_in_one_direction():
    """n[K] feeds S[K, V] (S reads n's new value; n reads nothing): a 2x2 block-triangular
    system, its blocks diagonal over K; a time-invariant one has no convolution form (its
    pieces leave out the other states)."""
    text = ("mixer m\n dims K, V\n input q[K], k[K], v[V], g[K]\n param a[K]\n state n[K], S[K, V]\n"
            " update n = a * n + k\n update S = exp(g) * S + n * v\n output o = q @ S\n")
    plan = _plan(text)
    (sy,) = plan.systems
    assert sy.describe() == "n, S: a 2x2 block-affine system, diagonal per head over K, V"
    assert {(b.of, b.wrt): b.kind() for b in sy.blocks} == {     # S <- n: a * n (the new n) times v
        ("n", "n"): "diagonal over K", ("S", "S"): "diagonal over K", ("S", "n"): "diagonal over K, V"}
    invariant = text.replace("exp(g) * S", "0.5 * S")
    assert "conv" not in _plan(invariant).forms


def test_independent_states_are_no_system():
    plan = mixc.load("mlstm").plan()
    assert plan.systems == () and SYSTEM not in [s.transition for s in plan.states]


@pytest.mark.parametrize("update_z,words", [
    ("z + sum(prev(S) * z, V)", "found prev(S) * z"),
    ("z + exp(S @ v)", "applies exp() to a state of the system"),
    ("z * (1 + 0 * sum(S, V))", "found z * (1 + 0 * sum(S, V))"),
])
def test_a_system_not_linear_in_all_its_states_is_refused_at_its_place(update_z, words):
    text = ("mixer m\n dims K, V\n input q[K], k[K], v[V]\n state S[K, V], z[K]\n update S = S + k * v\n"
            f" update z = {update_z}\n output o = q @ S\n")
    with pytest.raises(mixc.SpecError) as info:
        _plan(text)
    err = info.value
    assert "the update of z is not linear in the states S, z" in err.message and words in err.message
    assert err.line == 6
    assert "block-affine system" in str(err)

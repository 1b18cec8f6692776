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


RANGED = TITANS.replace("eta[], theta[], alpha[]", "eta[] in (0, 1), theta[] in (0, 1), alpha[] in (0, 1)")


def test_titans_with_ranged_gates_has_the_torch_chunked_form():
    """Gates in (0, 1): the 2x2 system's chunked form (derive/system_chunk.py) with its pieces;
    the generated chunked kernels stay refused (layout), the system's own (runtime/system_kernels.py)
    serve it: forms list chunk, and explain names both modes."""
    plan = _plan(RANGED.format(mom="mom"))
    (sy,) = plan.systems
    f = sy.chunk
    assert sy.chunk_unsupported is None and plan.layout.torch_chunk_unsupported is None
    assert plan.layout.chunk_unsupported is not None and plan.forms == ("chunk", "recurrent", "step")
    assert f.states == ("mom", "mem") and f.read == "mem" and f.key_dims == ("K",) and f.value_dims == ("V",)
    assert all(len(pairs) == 1 for pairs in f.inputs) and all(u is not None for u in f.lefts)
    text = explain(plan)
    assert "chunked form (mode='chunk': the system's Triton kernels over the per-token pieces, and mode='torch')" in text
    assert "D_t = [[a, 0], [c, d]] with a = eta, c = eta, d = 1 - alpha;  r_t = mem_{t-1}^T w_t, w = k" in text
    assert "mode='torch' runs its chunked form" in text          # the note


@pytest.mark.parametrize("text,why", [
    (TITANS.format(mom="mom"), "the scale of mom in its own update is not provably >= 0"),
    (RANGED.format(mom="mom").replace("output o = q @ mem", "output o = q @ mem + sum(mom @ v, K)"),
     "the output reads mom contracting other dims than its projection (K)"),
    (RANGED.format(mom="mom").replace("- theta * k * (k @ mem - v)", "- theta * k * (k @ mem - v) + k * (k @ mom)"),
     "its projections read both states"),
    (RANGED.format(mom="mom").replace("(1 - alpha) * mem", "(1 - alpha) * mem + eta * (q @ mem) * q"),
     "more than one projection term"),
    (RANGED.format(mom="mom").replace("eta * mom", "eta * mom + 0.5 * mem"),
     "each state's update scales the other state"),
    (RANGED.format(mom="mom").replace("input  q[K]", "input  g[K], q[K]").replace("eta * mom", "eta * g * mom"),
     "a block's diagonal part varies over a dim"),
], ids=["unranged", "value-read", "both-read", "rank2", "full-gates", "key-gate"])
def test_systems_outside_the_chunked_form_say_why(text, why):
    """Systems the chunked form does not take keep the token loop; the layout's reason (and the
    note and explain) names what differs, in the spec's names."""
    plan = _plan(text)
    reason = plan.layout.torch_chunk_unsupported
    assert reason is not None and why in reason, reason
    assert plan.systems[0].chunk is None
    assert any(why in n for n in plan.notes)
    assert why in explain(plan)

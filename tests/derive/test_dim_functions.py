"""Functions over a dim in the derivation: the sign prover knows softmax's and logsumexp's shift
(x - max(x, K) <= 0, so exp of it is <= 1; sum(exp(x - max(x, K)), K) >= 1), so the lint
warns of neither an overflowing exponential nor a normalizer that can reach 0 where a spec
uses them, and still warns where the shift is not the max over the summed dims; the norms'
roots are provably positive (eps > 0). The library spec gsa checks without a warning."""
from __future__ import annotations

import pytest

import mixc
from mixc.derive.lint import lint
from mixc.dsl.unparse import expr_text
from mixc.pipeline import from_text


def _spec(update: str, output: str) -> str:
    return f"""
mixer m
  dims   N, P
  input  x[P], B[N], C[N], dt[]
  state  S[N, P]
  update S = {update}
  output y = {output}
"""


DECAY = "exp(-softplus(dt)) * S"


@pytest.mark.parametrize("update,output", [
    (f"{DECAY} + B * x", "softmax(C @ S, P)"),
    (f"{DECAY} + B * x", "C @ S / sum(exp(C @ S - max(C @ S, P)), P)"),
    (f"{DECAY} + B * x", "layer_norm(C @ S, P) + rms_norm(C @ S, P) + l2norm(C @ S, P)"),
    (f"{DECAY} + B * x", "logsumexp(C @ S, P) * x"),
    (f"{DECAY} + softmax(B, N) * x", "C @ S"),
    (f"{DECAY} + exp(B - max(B, N)) * x", "C @ S"),
    (f"{DECAY} + exp(B - logsumexp(B, N)) * x", "C @ S"),
], ids=["softmax-readout", "softmax-by-hand", "norms", "logsumexp", "softmax-key", "shifted-exp", "exp-minus-lse"])
def test_no_warning(update, output):
    assert lint(from_text(_spec(update, output), "m.mix").plan()) == []


@pytest.mark.parametrize("update,output,words", [
    (f"{DECAY} + B * x", "C @ S / sum(exp(C @ S - max(C @ S, N * 1)), P)", "the output divides by"),
    (f"{DECAY} + exp(B) * x", "C @ S", "an exponential that the max-stabilizer does not cover"),
    (f"{DECAY} + exp(B - max(C, N)) * x", "C @ S", "an exponential that the max-stabilizer does not cover"),
], ids=["elementwise-max", "plain-exp", "another-max"])
def test_a_shift_that_is_not_the_max_is_still_warned(update, output, words):
    warnings = lint(from_text(_spec(update, output), "m.mix").plan())
    assert len(warnings) == 1 and words in warnings[0].message


def test_gsa_checks_without_a_warning():
    op = mixc.load("gsa")
    assert lint(op.plan()) == []
    assert op.plan().forms == ("chunk", "recurrent", "step")


def test_a_sum_over_a_readout_stays_in_the_combine():
    """layer_norm(C @ S, P) reads S as C @ S (over N) and, in its mean, as sum(C @ S, P) (over N
    and P): the sum stays in the combine over the one readout C @ S, so every read of S
    contracts N alone and the chunked form exists (was: none, "readout _r0 contracts ('N',)")."""
    plan = from_text(_spec(f"{DECAY} + B * x", "layer_norm(C @ S, P)"), "m.mix").plan()
    assert plan.forms == ("chunk", "recurrent", "step")
    assert [(r.state, [t.over for t in r.terms_ir]) for r in plan.output.readouts] == [("S", [("N",)])]
    assert "sum(_r0, P)" in expr_text(plan.output.combine_ir)


def test_a_read_the_chunked_kernels_cannot_take_is_said_in_the_users_words():
    """S read whole (inside a max) and as C @ S: no set of key dims serves both, so no chunked
    form, and check's note says why, naming the state and the dims (not the derivation's
    readout names)."""
    plan = from_text(_spec(f"{DECAY} + B * x", "(C @ S) / max(max(abs(S), N), P * 1)"), "m.mix").plan()
    assert plan.forms == ("recurrent", "step")
    note = next(n for n in plan.notes if n.startswith("no chunked form"))
    assert "reads state S whole in one place and contracting N in another" in note
    assert "_r" not in note and "(" not in note

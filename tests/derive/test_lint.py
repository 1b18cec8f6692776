"""The stability lint (derive/lint.py): warnings at the spec's line for a decay that can
exceed 1, an exponential the stabilizer does not cover, and a normalizer that can reach 0."""
import pytest

import mixc
from mixc.derive.lint import lint
from mixc.pipeline import from_text

BASE = """mixer m
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  state  S[K, V]
  update S = {decay} * S + k * v
  output o = q @ S
"""


@pytest.mark.parametrize("decay", ["exp(logsigmoid(g))", "exp(-softplus(g))", "sigmoid(g)", "exp(-exp(g))"])
def test_a_decay_kept_below_one_gives_no_warning(decay):
    assert lint(from_text(BASE.format(decay=decay)).plan()) == []


@pytest.mark.parametrize("decay", ["exp(g)", "exp(2 * g)", "(1 + sigmoid(g))"])
def test_a_decay_that_can_exceed_one_is_warned_at_its_update(decay):
    op = from_text(BASE.format(decay=decay), "m.mix")
    (w,) = lint(op.plan())
    assert "the decay of S can exceed 1" in w.message
    text = w.render(op.ir.source)
    assert text.startswith("m.mix:5:10: warning: ") and "update S =" in text


def test_per_head_constant_decays_are_checked_numerically():
    assert lint(mixc.load("retention").plan()) == []        # log(1 - 2^(-5 - head)) < 0 at every head


def test_an_unstabilized_exponential_input_is_warned_once_for_the_states_sharing_it():
    # the library's aft_simple declares k in (-inf, 80]; without the range it is warned
    text = mixc.dsl.read_spec("aft_simple").text.replace("k[D] in (-inf, 80]", "k[D]")
    ws = lint(from_text(text).plan())
    (w,) = [w for w in ws if "max-stabilizer does not cover" in w.message]
    assert w.message.startswith("the input terms of num, den take an exponential")
    assert "if callers keep k below ~88, declare it: `input k[D] in (-inf, 80]`" in w.message
    assert lint(mixc.load("mlstm").plan()) == []              # its scalar gate is stabilized
    assert lint(mixc.load("aft_simple").plan()) == []         # its declared range bounds exp(k)


def test_no_library_spec_warns():
    """Not even based: its normalizer sum_j (1 + s_j + s_j^2 / 2) + 1e-6 is > 0 (a quadratic
    without real roots in s = scale q . k_j), which bounding each readout on its own (q @ z1 of
    either sign) cannot show; the prover over tokens (derive/token_sums.py) does (issue 32)."""
    warned = {n for n in mixc.dsl.library_names() if lint(mixc.load(n).plan())}
    assert warned == set()


def test_a_normalizer_that_can_reach_zero_is_warned_in_the_spec_s_words():
    """The denominator as the spec writes it, at its place (it was the derivation's readout
    symbols with their expressions inlined: `_r1 + 1.0e-10 (where _r1 = q*scale @ z)`)."""
    op = mixc.load("linear_attn")
    (w,) = lint(op.plan(normalize=True))
    assert "the output divides by" in w.message and "_r" not in w.message
    assert w.span is not None and w.span.line == op.ir.output.span.line
    assert lint(op.plan()) == []


def test_check_prints_the_warnings(capsys, tmp_path):
    from mixc.cli import main
    path = tmp_path / "m.mix"
    path.write_text(BASE.format(decay="exp(g)"))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: m") and "m.mix:5:10: warning: the decay of S can exceed 1" in out
    assert out.count("warning:") == 1
    # what the user can do, in the user's names: the range that makes it provable
    assert "declare it: `input g[K] in [-inf, 0]`" in out


@pytest.mark.parametrize("decay", ["exp(g)", "exp(2 * g)", "sigmoid(g) ** 0.5 * exp(g)"])
def test_a_declared_range_proves_the_decay(decay):
    ranged = BASE.format(decay=decay).replace("g[K]", "g[K] in (-inf, 0]")
    assert lint(from_text(ranged).plan()) == []


def test_the_hint_names_the_one_factor_that_decides_the_sign():
    """mamba's log decay A * softplus(dt): softplus >= 0, so A <= 0 decides it."""
    spec = BASE.replace("g[K]", "g[K]\n  param  A[K]").format(decay="exp(A * softplus(g))")
    (w,) = lint(from_text(spec).plan())
    assert "declare it: `param A[K] in [-inf, 0]`" in w.message


@pytest.mark.parametrize("name", ["gla", "gated_delta_rule", "simple_gla", "kda", "comba", "hgrn", "hgrn2",
                                  "rwkv6", "rwkv7", "mamba", "mamba2", "s4d", "gated_delta_product"])
def test_library_gates_give_no_warning(name, capsys):
    """Their log-space gates are <= 0 by declared range (`input g[K] in [-inf, 0]`, `param A in
    (-inf, 0]`): `mixc check` warned "the decay of S can exceed 1" for each (issue 32)."""
    from mixc.cli import main
    assert main(["check", name]) == 0
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("decay,warned", [("max(0.5, 0.9)", False), ("relu(0.9)", False), ("min(2, 3)", True),
                                          ("(0 - 1)", True), ("1.0000001 ** 10000000", True)],
                         ids=["max-of-constants", "relu-of-a-constant", "constant-above-one", "minus-one",
                              "power-of-constants"])
def test_constant_decays_are_decided_numerically(decay, warned, tmp_path, capsys):
    """`mixc check` printed "ok" and then a TypeError from the lint for these (sympy cannot
    order log(max(1/2, 9/10)) against 0, nor compare I*pi at all): 13% of the fuzz's specs."""
    from mixc.cli import main
    path = tmp_path / "m.mix"
    path.write_text(BASE.format(decay=decay))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    # (0 - 1): "the decay of S, -1, can be negative" (tests/ops/test_numerics.py has those)
    assert out.startswith("ok: m") and ("the decay of S can exceed 1" in out or "can be negative" in out) == warned


def test_a_per_head_decay_past_float_range_is_linted_quickly():
    """`1 - 1e308 ** (-5 - head)` hung `mixc check` in the lint (sympy built 1e308 ** 4101 as
    an exact integer); in floats it is 1 - 0 at the far heads: no warning, at once."""
    import time
    t0 = time.perf_counter()
    assert lint(from_text(BASE.format(decay="(1 - 1e308 ** (-5 - head))")).plan()) == []
    assert time.perf_counter() - t0 < 10


def test_an_exponential_of_the_output_beside_stabilized_states_is_warned_unless_covered():
    """RWKV-4 as a spec gave inf / inf = NaN for u + k > 88 in every fp32 mode with no warning.
    The output's scale max(m, u + k) now covers exp(u + k) added to the readouts (no warning;
    tests/ops/test_stabilizer.py::test_rwkv4_exponential_in_the_output_is_stabilized); an
    exponential that multiplies a readout is evaluated as written and still warned."""
    from stabilizer_specs import RWKV4
    op = from_text(RWKV4, "rwkv4.mix")
    assert op.plan().stabilizer.states == ("a", "b")
    assert [w for w in lint(op.plan()) if "stabilized states" in w.message] == []
    times = RWKV4.replace("(prev(a) + exp(u + k) * v) / (prev(b) + exp(u + k))",
                          "(prev(a) * exp(u + k) + v) / (prev(b) * exp(u + k) + 1)")
    op = from_text(times, "times.mix")
    (w,) = [w for w in lint(op.plan()) if "beside the stabilized states (a, b)" in w.message]
    assert w.render(op.ir.source).startswith("times.mix:9:25: warning: the output takes an exponential")
    assert lint(mixc.load("mlstm").plan()) == []


def test_a_decay_that_states_share_is_warned_once():
    """S and z decayed by the same exp(g): one warning naming both (was one per state)."""
    text = """mixer two
  dims   K, V
  input  q[K], k[K], v[V], g[]
  state  S[K, V], z[K]
  update S = exp(g) * S + k * v
  update z = exp(g) * z + k
  output o = q @ S + q @ z
"""
    (w,) = lint(from_text(text).plan())
    assert w.message.startswith("the decay of S and z can exceed 1: its log, g, is not provably <= 0")
    assert "declare it: `input g[] in [-inf, 0]`" in w.message and w.span.line == 5


NORMALIZED = """mixer n
  dims   K, V
  input  q[K], k[K], v[V]
  option eps = {eps}
  let    phi_q = {phi_q}, phi_k = {phi_k}
  state  S[K, V], z[K]
  update S = S + phi_k * v
  update z = z + phi_k
  output o = (phi_q @ S) / (phi_q @ {z} + eps)
"""


@pytest.mark.parametrize("phi,eps,z,warned", [("elu", "1e-6", "z", False), ("sigmoid", "0", "z", False),
                                              ("exp", "0", "prev(z)", True), ("tanh", "1e-6", "z", True)],
                         ids=["positive-features", "no-eps-after-a-token", "no-eps-before-it", "signed-features"])
def test_a_normalizer_of_positive_features_is_proven_nonzero(phi, eps, z, warned):
    """z = z + phi(k) stays >= 0 from a zero initial state when phi >= 0 (> 0 once a token with
    phi > 0 is in), so phi(q) @ z + eps >= eps > 0 at eps's default (as `mixc check` takes the
    flags' defaults); prev(z) without eps is 0 at the first token, a signed feature map anything:
    warned. linear_transformer and performer gave this warning."""
    feature = "elu({x}) + 1" if phi == "elu" else phi + "({x})"
    text = NORMALIZED.format(phi_q=feature.format(x="q"), phi_k=feature.format(x="k"), eps=eps, z=z)
    ws = lint(from_text(text).plan())
    assert bool([w for w in ws if "divides by" in w.message]) == warned
    for name in ("linear_transformer", "performer"):
        assert lint(mixc.load(name).plan()) == []


@pytest.mark.parametrize("name", ["rwkv4", "aft_simple"])
def test_a_denominator_of_exponentials_is_proven_nonzero(name):
    """rwkv4's prev(b) + exp(u + k) (b >= 0: it adds exp(k)) and aft_simple's den (> 0 after
    its first token: it adds exp(k)) are > 0, not only >= 0."""
    assert not [w for w in lint(mixc.load(name).plan()) if "divides by" in w.message]


@pytest.mark.parametrize("default,warned", [("0", False), ("2", True)], ids=["inside", "past-the-layers"])
def test_a_per_head_decay_of_options_is_linted_at_their_defaults(default, warned, tmp_path):
    """lightning_attn's log decay -(8 / num_heads) (1 - layer_idx / num_layers) head is <= 0 for
    layer_idx <= num_layers: at the options' defaults (as the flags are taken at theirs)."""
    spec = mixc.dsl.read_spec("lightning_attn").text.replace("layer_idx = 0", f"layer_idx = {default}")
    ws = lint(from_text(spec).plan())
    assert bool([w for w in ws if "can exceed 1" in w.message]) == warned

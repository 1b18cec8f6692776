"""Classification of the state transition, from the algebra of the update (never the name)."""
import pytest
import sympy as sp

import mixc
from mixc.derive import plan as P
from mixc.derive.functions import log_of, logsigmoid, sigmoid
from mixc.derive.plan import derive
from mixc import classes
from mixc.classes import outer_sum, rank_r

RANK_R = rank_r.UNIT.name
OUTER_SUM = outer_sum.UNIT.name
SYSTEM = classes.SYSTEM_CLASS

EXPECTED = {
    # spec: (class of the spec, forms, time-invariant, log decay of the first state)
    "linear_attn": (P.PREFIX_SUM, ("chunk", "recurrent", "step", "conv"), True, "0"),
    "linear_transformer": (P.PREFIX_SUM, ("chunk", "recurrent", "step", "conv"), True, "0"),
    "performer": (P.PREFIX_SUM, ("chunk", "recurrent", "step", "conv"), True, "0"),
    "based": (P.PREFIX_SUM, ("chunk", "recurrent", "step", "conv"), True, "0"),
    "aft_simple": (P.PREFIX_SUM, ("chunk", "recurrent", "step", "conv"), True, "0"),
    "retention": (P.SCALAR, ("chunk", "recurrent", "step", "conv"), True, "log(1 - 1/(32*2**head))"),
    "simple_gla": (P.SCALAR, ("chunk", "recurrent", "step"), False, "g"),
    "mamba2": (P.SCALAR, ("chunk", "recurrent", "step"), False, "A*softplus(dt + dt_bias)"),
    "mamba3": ("sum of outer products", ("chunk", "recurrent", "step"), False, "A*softplus(dt + dt_bias)"),
    "mlstm": (P.SCALAR, ("chunk", "recurrent", "step"), False, "logsigmoid(f)"),
    "gla": (P.KEY_DIAG, ("chunk", "recurrent", "step"), False, "g"),
    "rwkv6": (P.KEY_DIAG, ("chunk", "recurrent", "step"), False, "w"),
    "rwkv5": (P.KEY_DIAG, ("chunk", "recurrent", "step", "conv"), True, "w"),            # w a param
    "hgrn1": (P.VALUE_DIAG, ("chunk", "recurrent", "step"), False, "log(lb + (1 - lb)*sigmoid(f))"),
    "rwkv4": (P.SCALAR, ("chunk", "recurrent", "step", "conv"), True, "-exp(w)"),      # stabilized exp(k)
    "hgrn": (P.VALUE_DIAG, ("chunk", "recurrent", "step"), False, "g"),
    "mamba": (P.ELEMENTWISE, ("scan", "recurrent", "step"), False, "A*softplus(dt + dt_bias)"),
    "s4d": (P.KEY_DIAG, ("chunk", "recurrent", "step", "conv"), True, "A*exp(log_dt)"),
    "delta_rule": (P.RANK1, ("chunk", "recurrent", "step"), False, "0"),
    "gated_delta_rule": (P.RANK1, ("chunk", "recurrent", "step"), False, "g"),
    "rwkv7": (P.RANK1, ("chunk", "recurrent", "step"), False, "w"),
    "hgrn2": (P.KEY_DIAG, ("chunk", "recurrent", "step"), False, "g"),
    "gsa": (P.VALUE_DIAG, ("chunk", "recurrent", "step"), False, "g"),
    "lightning_attn": (P.SCALAR, ("chunk", "recurrent", "step", "conv"), True,
                       "-8*head*(1 - layer_idx/num_layers)/num_heads"),
    "kda": (P.RANK1, ("chunk", "recurrent", "step"), False, "g"),
    "comba": (P.RANK1, ("chunk", "recurrent", "step"), False, "g"),
    "gated_delta_product": (RANK_R, ("chunk", "recurrent", "step"), False, "g"),   # rank 2: rank_r.py
    "titans": (SYSTEM, ("chunk", "recurrent", "step"), False, "log(eta)"),     # mom, mem: derive/coupled.py
}


def test_every_library_spec_is_classified():
    from mixc.dsl import library_names
    assert sorted(EXPECTED) == library_names("recurrent")      # sequence mixers: tests/dsl/test_sequence_syntax.py


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_library_class(name):
    cls, forms, ti, log_decay = EXPECTED[name]
    plan = mixc.load(name).plan()
    assert plan.transition == cls
    assert plan.forms == forms
    first = plan.states[0]
    assert first.time_invariant == ti
    assert sp.simplify(first.log_decay - sp.sympify(log_decay, locals={
        "logsigmoid": logsigmoid, "softplus": __import__("mixc.derive.functions", fromlist=["softplus"]).softplus,
        "sigmoid": __import__("mixc.derive.functions", fromlist=["sigmoid"]).sigmoid,
        **{s.name: s for s in first.log_decay.free_symbols}})) == 0


def test_gated_and_diagonal_plus_rank1():
    assert mixc.load("gated_delta_rule").plan().states[0].gated
    assert not mixc.load("delta_rule").plan().states[0].gated
    rw7 = mixc.load("rwkv7").plan().states[0]
    assert rw7.gated and rw7.decay_dims == ("K",)
    (r1,) = rw7.rank1
    assert str(r1.left) == "b" and str(r1.right) == "a" and r1.over == ("K",)


def test_key_and_value_dims_come_from_the_readout():
    gla = mixc.load("gla").plan().states[0]
    assert gla.key_dims == ("K",) and gla.value_dims == ("V",)
    m1 = mixc.load("mamba").plan().states[0]
    assert m1.key_dims == ("N",) and m1.decay_dims == ("N", "P")
    assert str(m1.key) == "B" and str(m1.value) == "x*softplus(dt + dt_bias)"


def test_readouts_and_combine():
    rwkv6 = mixc.load("rwkv6").plan()
    (r,) = rwkv6.output.readouts
    assert r.prev and r.state == "S"
    assert rwkv6.output.kind == "linear"
    assert "u" in str(rwkv6.output.combine)                 # the bonus is a current-token term
    assert mixc.load("mlstm").plan().output.kind == "normalized"
    assert mixc.load("linear_transformer").plan().output.kind == "normalized"
    assert mixc.load("linear_attn").plan(normalize=True).output.kind == "normalized"
    assert mixc.load("linear_attn").plan().output.kind == "linear"


# ---- classes from the algebra: the same update written differently --------------------

def _plan(body: str, dims="K, V", inputs="q[K], k[K], v[V]"):
    text = f"mixer m\n dims {dims}\n input {inputs}\n{body}"
    return derive(mixc.parse(text, "m.mix"))


@pytest.mark.parametrize("update,cls", [
    ("S + k * v", P.PREFIX_SUM),
    ("k * v + S", P.PREFIX_SUM),
    ("(S * 2 + 2 * k * v) / 2", P.PREFIX_SUM),             # 2/2 folds to 1
    ("0.5 * S + k * v", P.SCALAR),
    ("S * sigmoid(a) + k * v", P.SCALAR),
    ("exp(g) * S + k * v", P.KEY_DIAG),
    ("exp(h) * S + k * v", P.VALUE_DIAG),
    ("exp(g) * exp(h) * S + k * v", P.ELEMENTWISE),
    ("S - k * (k @ S) + k * v", P.RANK1),
    ("S + a * k * (v - k @ S)", P.RANK1),
    ("S - k * (k @ S) - q * (q @ S) + k * v", RANK_R),       # two projections over the key dims
    ("S - k * (k @ S) - v * sum(S, V) + k * v", P.GENERAL),  # two, one of them over the value dim
    ("S - v * sum(S, V) + k * v", P.GENERAL),                # a projection over the value dim
    ("0.5 * S + k * v + q * h", OUTER_SUM),                 # B_t a sum of two outer products
    ("exp(g) * S + k * v - a * q * (h + v)", OUTER_SUM),     # a per-key decay, a difference
    ("S + k * v + q * h", OUTER_SUM),                        # no decay
    ("S + k * v + q * h + g * v", OUTER_SUM),                # three
    ("exp(h) * S + k * v + q * h", P.VALUE_DIAG),            # a decay over the value dim: not taken
    ("0.5 * S + k * v + q * h + exp(k * v)", P.SCALAR),      # a summand that does not factor
], ids=lambda x: x if isinstance(x, str) and "*" not in x and "+" not in x else None)
def test_class_from_algebra(update, cls):
    plan = _plan(f" state S[K, V]\n update S = {update}\n output o = q @ S",
                 inputs="q[K], k[K], v[V], g[K], h[V], a[]")
    assert plan.states[0].transition == cls
    if cls == P.GENERAL:
        assert plan.forms == ("recurrent", "step")
        assert any("no parallel form" in n for n in plan.notes)


def test_log_space_decay_rewrites():
    g, delta, A = sp.symbols("g delta A", real=True)
    assert sp.simplify(log_of(sigmoid(g) ** sp.Rational(1, 16)) - logsigmoid(g) / 16) == 0
    assert log_of(sp.exp(delta * A)) == delta * A
    assert log_of(sp.exp(g) * sigmoid(g)) == g + logsigmoid(g)
    # through a spec: GLA's original gate
    plan = _plan(" let a = sigmoid(g) ** (1/16)\n state S[K, V]\n update S = a * S + k * v\n output o = q @ S",
                 inputs="q[K], k[K], v[V], g[K]")
    st = plan.states[0]
    assert st.transition == P.KEY_DIAG
    assert sp.simplify(st.log_decay - logsigmoid(sp.Symbol("g", real=True)) / 16) == 0


def test_time_invariance():
    plan = _plan(" param lam[]\n state S[K, V]\n update S = sigmoid(lam) * S + k * v\n output o = q @ S",
                 inputs="q[K], k[K], v[V]")
    assert plan.states[0].time_invariant and "conv" in plan.forms
    plan = _plan(" state S[K, V]\n update S = sigmoid(a) * S + k * v\n output o = q @ S",
                 inputs="q[K], k[K], v[V], a[]")
    assert not plan.states[0].time_invariant and "conv" not in plan.forms


def test_flags_specialize_the_plan():
    op = mixc.load("delta_rule")
    plain, normed = op.plan(), op.plan(use_qk_l2norm_in_kernel=True)
    assert plain.lets[1].name == "kn" and str(plain.lets[1].expr) == "k"
    assert "sqrt" in str(normed.lets[1].expr)
    with pytest.raises(mixc.SpecError, match="not a flag"):
        op.plan(normalize=True)


def test_unread_state_is_noted():
    plan = mixc.load("linear_attn").plan()
    assert any("z is never read" in n for n in plan.notes)

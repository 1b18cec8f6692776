"""The sequence ops of the language (conv, mix, attend), the positions dim T in param shapes,
and name= arguments: what parses, the IR it gives, the Plan of a sequence mixer, and every
error at its line and column in the user's words."""
from __future__ import annotations

import json

import pytest

import mixc
from mixc.derive.plan import derive
from mixc.derive.sequence import explain_sequence
from mixc.dsl import ir, library_names
from mixc.dsl.unparse import spec_text

from .spec_checks import assert_located, assert_user_words

SEQ = """mixer m
  dims   D, L, K, V
  input  x[D], q[K], k[K], v[V]
  param  h[L, D], W[T, T], b[T]
  option window = 8, causal = true
"""


def spec(*lines: str) -> str:
    """SEQ (lines 1-5) and the given lines from line 6."""
    return SEQ + "".join(f"  {x}\n" for x in lines)


def parse(text: str) -> ir.MixerIR:
    return mixc.parse(text, "s.mix")


# ---- what parses -------------------------------------------------------------------------

def test_each_op_and_its_shape():
    m = parse(spec("let a = conv(h, x), c = mix(W, x, causal=false), s = attend(q, k, v, window=window)",
                   "output y = a + c + sum(s, V) * x"))
    conv, mix, att = m.sequence_ops
    assert m.is_sequence and not m.states
    assert (conv.kind, conv.tap, conv.causal, conv.shape) == ("conv", "L", True, ("D",))
    assert (mix.kind, mix.causal, mix.shape, mix.args[0].shape) == ("mix", False, ("D",), ("T",))
    assert (att.kind, att.shape, att.window) == ("attend", ("V",), ir.Ref((), None, "window", "option"))
    assert [op.index for op in m.sequence_ops] == [0, 1, 2]
    assert m.param("W").shape == ("T", "T") and m.positional("b") and not m.positional("h")


def test_tap_dims_named_inferred_or_none():
    m = parse(spec("let f = h * rename(x, D -> D)", "output y = conv(h, x, L) + conv(1, x) + conv(x, x) + conv(b, x)"))
    taps = [op.tap for op in m.sequence_ops]
    assert taps == ["L", None, None, None]           # no tap dim: the taps run along time


def test_causal_takes_a_flag_and_nesting_numbers_inner_ops_first():
    m = parse(spec("output y = conv(h, x * conv(h, x), causal=causal)"))
    inner, outer = m.sequence_ops
    assert inner.index == 0 and outer.index == 1 and outer.causal == "causal"


def test_unparse_round_trips():
    m = parse(spec("let u = x * conv(h, x, causal=false)",
                   "output y = mix(W, u) + sum(attend(q, k, v, window=2 * window), V) * x"))
    assert parse(spec_text(m)).sequence_ops == m.sequence_ops


@pytest.mark.parametrize("name", library_names("sequence"))
def test_library_sequence_mixers_derive_and_explain(name):
    plan = mixc.load(name).plan()
    assert plan.transition.startswith("sequence mixer: ") and plan.states == ()
    text = explain_sequence(plan)
    assert "algorithm: " in text and "no Triton kernel: computed by torch" in text
    from mixc.derive.explain import plan_json
    data = json.loads(plan_json(plan))
    assert data["class"] == plan.transition and data["sequence_ops"]


def test_classes_forms_and_caches_of_the_library():
    want = {
        "hyena": ("sequence mixer: long convolution", ("sequence", "step"), ("pos", "conv0_h", "conv0_x", "conv1_h", "conv1_x")),
        "aft_full": ("sequence mixer: token mixing", ("sequence", "step"), ("pos", "mix0_x", "mix1_x")),
        "aft_conv": ("sequence mixer: long convolution", ("sequence", "step"),
                     ("pos", "conv0_x", "conv1_sum", "conv2_x", "conv3_sum")),
        "mlp_mixer": ("sequence mixer: token mixing", ("sequence",), None),
        "gmlp": ("sequence mixer: token mixing", ("sequence",), None),
        "swa": ("sequence mixer: sliding-window softmax attention", ("sequence", "step"), ("pos", "attend0_k", "attend0_v")),
        "attention": ("sequence mixer: softmax attention", ("sequence", "step"), ("pos", "attend0_k", "attend0_v")),
    }
    assert sorted(want) == library_names("sequence")
    for name, (cls, forms, cache) in want.items():
        plan = mixc.load(name).plan()
        assert (plan.transition, plan.forms) == (cls, forms), name
        assert (plan.sequence.cache_keys if plan.sequence.no_step is None else None) == cache, name
    assert mixc.load("mlp_mixer").plan(causal=True).forms == ("sequence", "step")


def test_explain_names_the_algorithms():
    hy = explain_sequence(mixc.load("hyena").plan())
    assert "FFT: n = the next power of two >= T + L - 1 (2T for a filter as long as the sequence)" in hy
    assert "filter h1 has no tap dim: its taps run along time" in hy
    swa = explain_sequence(mixc.load("swa").plan())
    assert "over s <= t and t - s < window" in swa and "flex_attention (compiled) with a block mask" in swa
    assert "algorithm: on the CPU, scaled_dot_product_attention with the mask as a boolean tensor" in swa
    aft = explain_sequence(mixc.load("aft_conv").plan())
    assert "torch.cumsum" in aft and "exponentials: exp(x) of per-token values is carried as exp(x - c)" in aft
    mm = explain_sequence(mixc.load("mlp_mixer").plan())
    assert "step: none: mix() in let h is not causal; mix() in output y is not causal" in mm


# ---- errors, each at its place ----------------------------------------------------------

CASES = [
    # (id, text, line, column, words)
    ("conv-arity", spec("output y = conv(h)"), 6, 14, "conv() takes 2 or 3 arguments, got 1"),
    ("mix-arity", spec("output y = mix(W, x, x)"), 6, 14, "mix() takes 2 arguments, got 3"),
    ("attend-arity", spec("output y = attend(q, k)"), 6, 14, "attend() takes 3 arguments, got 2"),
    ("unknown-kwarg", spec("output y = conv(h, x, causl=false)"), 6, 25, "conv() takes no 'causl=' argument (it takes causal=)"),
    ("window-on-conv", spec("output y = conv(h, x, window=3)"), 6, 25, "conv() takes no 'window=' argument"),
    ("kwarg-twice", spec("output y = conv(h, x, causal=true, causal=false)"), 6, 38, "conv() is given causal= twice"),
    ("positional-after-kwarg", spec("output y = conv(h, causal=true, x)"), 6, 35,
     "an argument without a name cannot follow a named one"),
    ("causal-number", spec("output y = conv(h, x, causal=1)"), 6, 32, "causal= takes true, false or a flag"),
    ("causal-number-option", spec("output y = conv(h, x, causal=window)"), 6, 32, "causal= takes true, false or a flag"),
    ("kwarg-in-exp", spec("output y = exp(x, causal=true) + conv(h, x)"), 6, 21, "exp() takes no 'causal=' argument"),
    ("kwarg-outside-a-call", spec("let z = (a=1)", "output y = conv(h, x)"), 6, 13, "unexpected '='"),
    ("two-extra-filter-dims", spec("output y = conv(h, sum(x, D))"), 6, 14,
     "conv(h, x): the filter has dims [L, D] that x lacks; name its tap dim, e.g. conv(h, x, L)"),
    ("tap-not-a-dim", spec("output y = conv(h, x, h)"), 6, 25, "the third argument names the filter's tap dim"),
    ("tap-not-in-filter", spec("output y = conv(h, x, K)"), 6, 25, "conv(h, x, K): the filter has shape [L, D], without K"),
    ("tap-in-input", spec("output y = conv(h, x * h, L)"), 6, 29, "the input has the tap dim L too"),
    ("tap-filter-per-token", spec("output y = conv(h * x, x, L)"), 6, 19,
     "the filter of conv() has the tap dim L, so it must be the same at every token, but it depends on input 'x'"),
    ("tap-filter-per-token-through-let", spec("let g = h * sum(q, K)", "output y = conv(g, x, L)"), 7, 19,
     "but it depends on let 'g'"),
    ("mix-without-T", spec("output y = mix(h, x)"), 6, 18,
     "mix(W, x): W must be a token-mixing matrix, an expression of a param declared [T, T, ...], but it has shape [L, D]"),
    ("mix-input-with-T", spec("output y = mix(W, W)"), 6, 21, "mix(): the input has the dim T of source positions"),
    ("conv-filter-with-T", spec("output y = conv(W, x)"), 6, 19, "conv(): the filter has the dim T of source positions"),
    ("attend-qk-dims", spec("output y = attend(q, x, v)"), 6, 14,
     "attend(q, k, v): q and k must have the same dims (q . k contracts them), but q is [K] and k is [D]"),
    ("attend-v-shares", spec("output y = attend(q, k, k)"), 6, 27, "attend(q, k, v): v shares dim K with q and k"),
    ("window-input", spec("output y = attend(q, k, v, window=x)"), 6, 37,
     "window= takes a number of tokens: numbers, dims and number options, not input 'x'"),
    ("window-head", spec("output y = attend(q, k, v, window=head + 1)"), 6, 37, "not the head index"),
    ("window-shape", spec("output y = attend(q, k, v, window=D * q)"), 6, 41, "not input 'q'"),
    ("output-with-T", spec("output y = W * conv(h, x)"), 6, 14, "output 'y' has the dim T of source positions"),
    ("output-without-op", spec("let a = conv(h, x)", "output y = x"), 7, 14,
     "output 'y' uses no sequence op (conv, mix, attend) and reads no state"),
    ("op-in-option", spec("option o = conv(h, x)", "output y = conv(h, x)"), 6, 14, "conv() cannot appear in an option's default"),
    ("T-in-input", "mixer m\n  dims D\n  input x[T, D]\n  output y = conv(1, x)\n", 3, 11,
     "T is the time axis of every input ([B, T, H, ...]); it is not written in the shape of input 'x'"),
    ("T-in-middle", "mixer m\n  dims D\n  input x[D]\n  param w[D, T]\n  output y = conv(w, x)\n", 4, 14,
     "T may only lead a param's shape: [T, ...] (one value per position) or [T, T, ...]"),
    ("T-thrice", "mixer m\n  dims D\n  input x[D]\n  param w[T, T, T]\n  output y = mix(w, x)\n", 4, 17,
     "T may only lead a param's shape"),
    ("T-in-state", "mixer m\n  dims D\n  input x[D]\n  state S[T]\n  update S = S + x\n  output y = S\n", 4, 11,
     "a state has no time axis: T cannot be in the shape of state 'S'"),
    ("state-and-op", "mixer m\n  dims D\n  input x[D]\n  param h[T, D]\n  state S[D]\n  update S = S + x\n"
     "  output y = S + conv(h, x)\n", 7, 18,
     "conv() makes 'm' a sequence mixer, which has no state, but state 'S' is declared on line 5"),
    ("op-in-update", "mixer m\n  dims D\n  input x[D]\n  param h[T, D]\n  state S[D]\n  update S = S + conv(h, x)\n"
     "  output y = S\n", 6, 18, "conv() cannot appear in an update: a sequence op reads other tokens"),
    ("positional-param-in-recurrence", "mixer m\n  dims D\n  input x[D]\n  param b[T]\n  state S[D]\n"
     "  update S = S + x\n  output y = S + b\n", 4, 9,
     "param 'b' is declared per position ([T, ...]), which only a sequence mixer (conv, mix, attend) reads"),
]


@pytest.mark.parametrize("name,text,line,column,words", CASES, ids=[c[0] for c in CASES])
def test_error(name, text, line, column, words):
    with pytest.raises(mixc.SpecError) as info:
        derive(mixc.parse(text, "bad.mix"))
    err = info.value
    assert words in err.message, str(err)
    assert (err.line, err.column) == (line, column), str(err)
    assert_located(err, text)
    assert_user_words(err)


def test_sequence_op_names_are_reserved():
    with pytest.raises(mixc.SpecError, match="'conv' is a built-in of the spec language"):
        parse("mixer m\n  dims D\n  input conv[D]\n  param h[T, D]\n  output y = mix(h, conv)\n")


def test_a_conv_inside_a_recurrence_says_where_the_short_conv_belongs():
    """Issue 32: a conv() in a recurrence is refused; the note points at the layer's short conv."""
    text = ("mixer m\n  dims K, V, L\n  input q[K], k[K], v[V]\n  param h[L, K]\n  let kc = conv(h, k, L)\n"
            "  state S[K, V]\n  update S = S + kc * v\n  output o = q @ S\n")
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(text, "m.mix")
    assert (info.value.line, info.value.column) == (5, 12)
    assert any("belongs in the layer" in n and "MixerLayer" in n for n in info.value.notes)

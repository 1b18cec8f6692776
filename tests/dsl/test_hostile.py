"""Hostile specs (issue 6): names that shadow Python, Triton or the generated code's own
variables, text that tries to break out of generated code, and specs beyond the limits.

Each is either refused with a SpecError at its place in the text, or accepted; then the
generated module compiles, uses every spec name only behind a prefix (v_NAME, p_NAME,
s_NAME, ...), never gives two things one name, and runs nothing from the spec when imported.

"Only behind a prefix" is checked against a twin of the spec in which the hostile name is
replaced by a neutral one: generated code uses `T`, `i_n` or `tl` bare as its own variables,
so a hostile name may be bare exactly as often as in the twin's code, and no more.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import keyword
import re
import sys
import time
import tokenize
import unicodedata
from collections import Counter
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixc
from mixc.codegen.module import generate
from mixc.derive import stabilize
from mixc.derive.plan import derive
from mixc.dsl import library_names, read_spec
from mixc.dsl import parser as dsl_parser
from mixc.runtime import reference as runtime_reference
from mixc.runtime.op import MixerOp

from .spec_checks import assert_located, assert_user_words, parse_and_derive

# mixc.dsl exports a function named check, which hides the module of that name.
dsl_check = importlib.import_module("mixc.dsl.check")

# The names of issue 6, Python's keywords and some of its builtins.
NAMED_IN_ISSUE = ["__import__", "exec", "eval", "tl", "triton", "torch", "F", "os", "sys", "open", "print",
                  "i_n", "i_h", "bos", "eos", "T", "H", "B", "DOT", "CK", "None", "True", "lambda", "def",
                  "import"]
PYTHON_NAMES = ["__builtins__", "__name__", "_", "globals", "getattr", "setattr", "compile", "breakpoint", "exit",
                "range", "len", "float", "int", "isinstance", "math", "np", "self", "cls", "super", "object",
                "METADATA", "SPEC_TEXT", "SPEC_FILE", "FLAGS", "op", "step", "from_text", "mixc", "chunk",
                "dtype", "E", "I", "pi", "oo", "nan"]          # E, I, pi, oo, nan: sympy's constants
HOSTILE_NAMES = list(dict.fromkeys(NAMED_IN_ISSUE + keyword.kwlist + keyword.softkwlist + PYTHON_NAMES))


# ---- generated code ---------------------------------------------------------------------

def code_names(src: str) -> Counter:
    """Bare identifiers of generated code and how often each occurs: NAME tokens that are not
    an attribute (after '.'); strings and comments are not code."""
    names, prev = Counter(), None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME and not (prev is not None and prev.string == "."):
            names[tok.string] += 1
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            prev = tok
    return names


def plan_of(text: str, filename: str = "hostile.mix", flags: dict | None = None):
    # derive() itself, not MixerOp.plan(): that cache is keyed by the IR, which ignores the
    # text, and would return the plan (and so the SPEC_TEXT) of an earlier spec that differs
    # only in comments or file name.
    return derive(mixc.parse(text, filename), flags)


@lru_cache(maxsize=None)
def sources(text: str, flips: bool = True) -> tuple[str, ...]:
    """The generated module for the default flags and (flips) with each flag flipped."""
    ir = mixc.parse(text, "hostile.mix")
    plans = [derive(ir)] + ([derive(ir, {f.name: not f.default}) for f in ir.flags] if flips else [])
    return tuple(generate(p) for p in plans)


def assert_behind_prefixes(text: str, twin: str, renamed: dict[str, str], flips: bool = True) -> None:
    """`text` calls things by the names of `renamed` where its twin calls them by the values:
    the generated code of both compiles and differs only behind prefixes."""
    for src, twin_src in zip(sources(text, flips), sources(twin, flips), strict=True):
        compile(src, "generated.py", "exec")
        got, want = code_names(src), code_names(twin_src)
        for name, neutral in renamed.items():
            assert want[neutral] == 0, f"spec name {neutral!r} is bare in generated code"
            assert got[name] == want[name], f"spec name {name!r} is bare in generated code"
        # Renaming must not merge two identifiers into one (input dq next to input q would make
        # both p_dq): as many identifiers, each used as often.
        assert sorted(got.values()) == sorted(want.values()), f"{sorted(renamed)} merged names in generated code"


def refused(text: str, filename: str = "hostile.mix") -> mixc.SpecError:
    err = parse_and_derive(text, filename)
    assert err is not None, "accepted"
    return err


# ---- 1. hostile names in every place a spec declares a name ----------------------------------

SLOTS_SPEC = """\
mixer {mixer}
  dims   {dim}, V
  input  q[{dim}], k[{dim}], v[V], {input}[]
  param  {param}[{dim}]
  option {option} = 0.5, {flag} = true
  let    {let} = exp({input}) * {param}
  state  {state}[{dim}, V]
  update {state} = {let} * {state} + k * v
  output {output} = if {flag} then (q * {option}) @ {state} else q @ {state}
"""
NEUTRAL = {"mixer": "zm", "dim": "zd", "input": "zi", "param": "zp", "option": "zo", "flag": "zf", "let": "zl",
           "state": "zs", "output": "zy"}
SLOTS = tuple(NEUTRAL)


def with_name(slot: str, name: str) -> str:
    return SLOTS_SPEC.format(**(NEUTRAL | {slot: name}))


def declared_at(slot: str) -> tuple[int, int]:
    """Line and column of the slot's declaration (its first occurrence)."""
    before = SLOTS_SPEC[:SLOTS_SPEC.index("{" + slot + "}")].format(**NEUTRAL)
    return before.count("\n") + 1, len(before) - (before.rfind("\n") + 1) + 1


def refused_in_slot(slot: str, name: str) -> bool:
    """True when `name` in `slot` is refused by a clear SpecError at its declaration."""
    text = with_name(slot, name)
    try:
        mixc.parse(text, "hostile.mix")
    except mixc.SpecError as err:
        assert_located(err, text)
        assert_user_words(err)
        assert f"'{name}'" in err.message, str(err)
        assert (err.line, err.column) == declared_at(slot), str(err)
        return True
    return False


def test_the_neutral_spec_is_accepted():
    # Every comparison is against this spec; it must itself be fine.
    assert parse_and_derive(SLOTS_SPEC.format(**NEUTRAL)) is None


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_name_in_every_slot(name):
    refused_slots = {slot for slot in SLOTS if refused_in_slot(slot, name)}
    # Refused must be: Python keywords and names starting with '_' everywhere; reserved names
    # everywhere but as the mixer's name (which only starts kernel names: gla_chunk_fwd) unless
    # it names a Python module (the compiled module would hide it); B, T and H as dims (they
    # are the call's axes). The accepted ones are generated below.
    module = name in dsl_check.python_modules()
    if keyword.iskeyword(name) or name.startswith("_"):
        assert refused_slots == set(SLOTS)
    elif name in dsl_check.RESERVED:
        assert refused_slots == set(SLOTS) - ({"mixer"} if not module else set())
    if module:
        assert "mixer" in refused_slots
    if name in ("B", "T", "H"):
        assert "dim" in refused_slots


def _template_names() -> list[str]:
    """Every identifier generated code itself uses bare (its variables, the names of Triton and
    Python it calls, and its prefixed spec names: v_q, p_dq, s_S), from specs that together use
    every template: recurrent, chunked, with a rank-1 correction, with a stabilizer, torch."""
    names: set[str] = set()
    for spec in ("gla", "delta_rule", "mamba2", "hgrn", "based", "mlstm"):
        names |= set(code_names(generate(mixc.load(spec).plan())))
    return sorted(names - set(HOSTILE_NAMES))


TEMPLATE_NAMES = _template_names()
# One slot each, in turn (all nine for each would be 6,000 specs). The names that start with
# '_' (most of them) are refused by one rule and are checked together.
TEMPLATE_CASES = [(name, SLOTS[i % len(SLOTS)]) for i, name in enumerate(TEMPLATE_NAMES) if not name.startswith("_")]
PRIVATE_TEMPLATE_NAMES = [name for name in TEMPLATE_NAMES if name.startswith("_")]


def test_generated_code_has_its_own_names():
    # The cases below are only as good as this list: it must hold the templates' variables.
    assert {"i_n", "i_h", "bos", "eos", "T", "H", "CK", "DOT", "IS_VARLEN"} <= set(TEMPLATE_NAMES) | set(HOSTILE_NAMES)
    assert len(TEMPLATE_NAMES) > 100


@pytest.mark.parametrize("name,slot", TEMPLATE_CASES, ids=[f"{slot}-{name}" for name, slot in TEMPLATE_CASES])
def test_generated_code_names_as_spec_names(name, slot):
    refused_in_slot(slot, name)          # refused clearly, or accepted and generated below


def test_private_names_of_generated_code_are_refused():
    # _row, _offs_K, _BLOCK__T, _mixc_dot, ...: generated code's own, never a spec's.
    assert len(PRIVATE_TEMPLATE_NAMES) > 100
    for i, name in enumerate(PRIVATE_TEMPLATE_NAMES):
        assert refused_in_slot(SLOTS[i % len(SLOTS)], name), name


def _packed() -> list[dict[str, str]]:
    """Every accepted (name, slot) of the two tests above, nine to a spec: each spec takes for
    each slot the next name accepted there that it does not have yet (or keeps the neutral one)."""
    def accepted(slot, name):
        try:
            mixc.parse(with_name(slot, name))
        except mixc.SpecError:
            return False
        return True
    pairs = [(name, slot) for name in HOSTILE_NAMES for slot in SLOTS] + TEMPLATE_CASES
    queues = {slot: [n for n, s in pairs if s == slot and accepted(slot, n)] for slot in SLOTS}
    specs = []
    while any(queues.values()):
        fill: dict[str, str] = {}
        for slot in SLOTS:
            i = next((i for i, n in enumerate(queues[slot]) if n not in fill.values()), None)
            if i is not None:
                fill[slot] = queues[slot].pop(i)
        specs.append(fill)
    return specs


PACKED = _packed()


@pytest.mark.parametrize("fill", PACKED, ids=["-".join(f.values()) for f in PACKED])
def test_accepted_names_stay_behind_prefixes(fill):
    text = SLOTS_SPEC.format(**(NEUTRAL | fill))
    assert parse_and_derive(text) is None
    # The default flag reads every slot's name; flipped, the output only drops the option.
    assert_behind_prefixes(text, SLOTS_SPEC.format(**NEUTRAL), {name: NEUTRAL[slot] for slot, name in fill.items()},
                           flips=False)


# ---- 2. the spec text in generated code is data -----------------------------------------------

MARKER = "PWNED_6f1c"


def _payload_spec(target: str) -> str:
    """gla with comments that would run code (write `target`) if generated code pasted them."""
    lines = [
        f"# __import__('os').system('echo {MARKER} > {target}')",
        f'# """; __import__("pathlib").Path(r"{target}").write_text("{MARKER}"); """',
        f"# '''; open(r'{target}', 'w').write('{MARKER}'); '''",
        f"# \\\"; \\'; \\\\ \\N{{BULLET}} \\x41 {{{{ 7 * 7 }}}} {{% raw %}} {{# {MARKER} #}} %s ${{x}}",
        f"# a line that ends in a backslash, a carriage return, a form feed {MARKER} \\\r\x0c",
        f"# non-ASCII and invisible: é 中 \u2028 \u2029 \x00 \u200d \U0001f600 {MARKER}",
        "mixer gla   # " + MARKER + " \\",
        "  dims   K, V",
        "  input  q[K], k[K], v[V], g[K]",
        "  option scale = K ** -0.5",
        "  state  S[K, V]",
        "  update S = exp(g) * S + k * v   # \"\"\")); import os; os.remove('x')  #",
        "  output o = (q * scale) @ S",
    ]
    return "\n".join(lines) + "\n"


def test_spec_text_is_only_the_spec_text_literal(tmp_path):
    text = _payload_spec(str(tmp_path / "pwned"))
    src = generate(plan_of(text, "payload.mix"))
    toks = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    hits = [i for i, t in enumerate(toks) if MARKER in t.string or "pwned" in t.string]
    assert len(hits) == 1, [toks[i].string[:80] for i in hits]
    (i,) = hits
    assert toks[i].type == tokenize.STRING
    assert [toks[i - 2].string, toks[i - 1].string] == ["SPEC_TEXT", "="]
    assert ast.literal_eval(toks[i].string) == text       # the text, exactly, and nothing else


def test_importing_generated_code_runs_nothing_from_the_spec(tmp_path):
    target = tmp_path / "pwned"
    text = _payload_spec(str(target))
    path = tmp_path / "payload_module.py"
    path.write_text(generate(plan_of(text, "payload.mix")), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("payload_module", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("payload_module", None)
    assert not target.exists()
    assert not any(p.name != path.name and p.name != "__pycache__" for p in tmp_path.iterdir())
    assert module.SPEC_TEXT == text and module.METADATA["mixer"] == "gla"


@pytest.mark.parametrize("text,line,column,words", [
    ("mixer __import__('os').system('echo pwned')\n", 1, 17, "unexpected '('"),
    ("mixer m; import os\n", 1, 8, "unexpected character ';'"),
    ("mixer m\n  dims K\n  input q[K], __import__[K]\n", 3, 15, "names may not start with '_'"),
    ("mixer m\n  dims K\n  input q[K]\n  let x = __import__('os')\n", 4, 22, "unexpected character \"'\""),
    ("mixer m\n  dims K\n  input q[K]\n  let x = eval(q)\n", 4, 11, "unknown function 'eval'"),
    ("mixer m\n  dims K\n  input q[K]\n  let x = q.__class__\n", 4, 12, "unexpected character '.'"),
], ids=["mixer-call", "mixer-semicolon", "input-dunder", "let-dunder-call", "let-eval-call", "let-attribute"])
def test_code_in_a_name_is_refused(text, line, column, words):
    # Names are [A-Za-z_][A-Za-z0-9_]*: code cannot hide in one, and a call is of the
    # language's functions only.
    err = refused(text)
    assert (err.line, err.column) == (line, column) and words in err.message, str(err)


# ---- 3. text that tries to break out, inside a name -----------------------------------------

BREAKOUT = [
    ("single-quote", "q'x"), ("double-quote", 'q"x'), ("triple-double-quote", 'q"""x'),
    ("triple-single-quote", "q'''x"), ("backslash", "q\\x"), ("backslash-n", "q\\nx"),
    ("backslash-quote", "q\\'x"), ("newline", "q\nx"), ("carriage-return", "q\rx"), ("tab", "q\tx"),
    ("form-feed", "q\x0cx"), ("nul", "q\x00x"), ("semicolon", "q;x"), ("dot", "q.x"), ("braces", "q{x}"),
    ("jinja", "q{{x}}"), ("dollar", "q$x"), ("percent", "q%x"), ("backtick", "q`x"),
]
BREAKOUT_PLACES = {
    "mixer": "mixer {}\n  dims K\n",
    "input": "mixer m\n  dims K\n  input {}[K]\n",
    "let": "mixer m\n  dims K\n  input q[K]\n  let {} = q\n",
}


@pytest.mark.parametrize("place", BREAKOUT_PLACES)
@pytest.mark.parametrize("case", BREAKOUT, ids=[c[0] for c in BREAKOUT])
def test_breakout_characters_in_a_name(case, place):
    _, name = case
    text = BREAKOUT_PLACES[place].format(name)
    err = refused(text)
    # The name is cut where the grammar stops it: after `q`, at the first character that is not
    # whitespace.
    start = text.index(name) + 1
    pos = next(i for i in range(start, len(text)) if text[i] not in " \t\r\n\x0c")
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    assert (err.line, err.column) == (line, column), str(err)


UNICODE = [
    ("greek-alpha", "\u03b1"), ("greek-omicron-homoglyph", "\u03bf"), ("cyrillic-a-homoglyph", "\u0430"),
    ("cyrillic-e-homoglyph", "\u0435"), ("kelvin-sign", "\u212a"), ("fullwidth-q", "\uff51"),
    ("math-bold-a", "\U0001d41a"), ("dotless-i", "\u0131"), ("combining-acute", "\u0301"),
    ("zero-width-joiner", "\u200d"), ("zero-width-non-joiner", "\u200c"), ("right-to-left-mark", "\u200f"),
    ("left-to-right-mark", "\u200e"), ("no-break-space", "\u00a0"), ("line-separator", "\u2028"),
    ("byte-order-mark", "\ufeff"), ("minus-sign", "\u2212"), ("emoji", "\U0001f600"),
    ("rtl-override", "\u202e"), ("rtl-isolate", "\u2067"), ("pop-directional", "\u202c"),
]


@pytest.mark.parametrize("char", [c for _, c in UNICODE], ids=[i for i, _ in UNICODE])
def test_non_ascii_in_a_name(char):
    # NAME is /[A-Za-z_][A-Za-z0-9_]*/: any other character ends it and is refused where it is,
    # by its code point (a homoglyph looks like the ASCII letter; an invisible one shows nothing).
    text = f"mixer m\n  dims K\n  input q{char}x[K]\n"
    err = refused(text)
    assert (err.line, err.column) == (3, 10), str(err)
    assert f"U+{ord(char):04X}" in str(err)
    if unicodedata.category(char)[0] in "LM":
        assert "names are ASCII letters, digits and _" in err.message
    if unicodedata.category(char) in ("Ll", "Lu", "So", "Sm"):       # printable: shown, then named
        assert err.notes and f"'{char}' is U+{ord(char):04X}" in err.notes[0]


def test_homoglyph_reference_is_not_the_declared_name():
    # `а` (Cyrillic) where `a` was declared: refused where it is used, not read as `a`.
    text = ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], a[]\n  state S[K, V]\n"
            "  update S = \u0430 * S + k * v\n  output o = q @ S\n")
    err = refused(text)
    assert (err.line, err.column) == (5, 14)
    assert "(cyrillic small letter a)" in err.notes[0]


def test_non_ascii_in_comments_is_accepted():
    # Comments are free text: what they hold goes nowhere but SPEC_TEXT, through repr().
    text = read_spec("gla").text.replace("mixer gla", "mixer gla  # é 中 \u200d \u200f \u2028 \U0001f600 \x00")
    assert parse_and_derive(text) is None
    compile(generate(plan_of(text)), "generated.py", "exec")


@pytest.mark.parametrize("char", ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068",
                                  "\u2069"])
def test_bidi_controls_in_comments_are_refused(char):
    # "Trojan Source": in a comment they reorder how the line is displayed, so that what a
    # reviewer reads is not what mixc reads.
    text = ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[]\n  state S[K, V]\n"
            f"  update S = S + k * v  # {char} * g {char}\n  output o = q @ S\n")
    err = refused(text)
    assert (err.line, err.column) == (5, 27), str(err)
    assert f"bidirectional control character U+{ord(char):04X}" in err.message
    assert "?" in str(err).split("\n")[2] and char not in str(err)      # not echoed raw to the terminal


# ---- 4. generated names that would clash ----------------------------------------------------

def _clash(inputs: str = "q[K], k[K], v[V]", params: str = "A[K]", output: str = "o") -> str:
    return (f"mixer m\n  dims K, V\n  input {inputs}\n  param {params}\n  state S[K, V]\n"
            f"  update S = S + k * v\n  output {output} = q @ S\n")


CLASHES = [
    # id, spec, line, column, the name of both in generated code
    ("input-o-beside-output-y", _clash("q[K], k[K], v[V], o[K]", output="y"), 3, 27, "p_do"),
    ("input-out", _clash("q[K], k[K], v[V], out[K]"), 3, 27, "p_out"),
    ("input-do", _clash("q[K], k[K], v[V], do[K]"), 3, 27, "p_do"),
    ("param-do", _clash(params="A[K], do[V]"), 4, 15, "p_do"),
    ("input-dq-after-q", _clash("q[K], k[K], v[V], dq[K]"), 3, 27, "p_dq"),
    ("input-q-after-dq", _clash("dq[K], q[K], k[K], v[V]"), 3, 16, "p_dq"),
    ("param-dk-after-input-k", _clash(params="A[K], dk[K]"), 4, 15, "p_dk"),
    ("input-dp_A-then-param-A", _clash("q[K], k[K], v[V], dp_A[K]"), 4, 9, "p_dp_A"),
    ("input-p_A-then-param-A", _clash("q[K], k[K], v[V], p_A[K]"), 4, 9, "p_dp_A"),
    ("input-init_S", _clash("q[K], k[K], v[V], init_S[K]"), 5, 9, "p_init_S"),
    ("input-final_S", _clash("q[K], k[K], v[V], final_S[K]"), 5, 9, "p_final_S"),
    ("input-ckpt_S", _clash("q[K], k[K], v[V], ckpt_S[K]"), 5, 9, "p_ckpt_S"),
    ("input-scratch_S", _clash("q[K], k[K], v[V], scratch_S[K]"), 5, 9, "p_scratch_S"),
    ("input-dinit_S", _clash("q[K], k[K], v[V], dinit_S[K]"), 5, 9, "p_dinit_S"),
    ("param-dfinal_S", _clash(params="A[K], dfinal_S[K]"), 5, 9, "p_dfinal_S"),
    ("input-dh_S", _clash("q[K], k[K], v[V], dh_S[K]"), 5, 9, "p_dh_S"),          # the two-launch backward's
    ("input-chunk_seq", _clash("q[K], k[K], v[V], chunk_seq[K]"), 3, 27, "p_chunk_seq"),
    ("input-intra", _clash("q[K], k[K], v[V], intra[K]"), 3, 27, "p_intra"),       # the forward's intra kernel
    ("input-dense_S", _clash("q[K], k[K], v[V], dense_S[K]"), 5, 9, "p_dense_S"),  # the forward's refill kernel
    ("input-ckpt__m", _clash("q[K], k[K], v[V], ckpt__m[K]"), 3, 27, "p_ckpt__m"),     # the stabilizer's state
]


@pytest.mark.parametrize("case", CLASHES, ids=[c[0] for c in CLASHES])
def test_names_whose_kernel_arguments_clash_are_refused(case):
    # Before the check, these specs generated kernels with a duplicate argument: a SyntaxError
    # when the module was imported.
    _, text, line, column, arg = case
    err = refused(text, "bad.mix")
    assert (err.line, err.column) == (line, column), str(err)
    assert f"would have the same name in generated code ({arg})" in err.message, str(err)


@pytest.mark.parametrize("inputs,params", [("q[K], k[K], v[V], dt[K], do_[K], outs[K], ckpt[K]", "A[K], dA[K]"),
                                           ("q[K], k[K], v[V], d[K], p[K]", "A[K], pA[K], init[K]")],
                         ids=["near-misses", "short-names"])
def test_names_next_to_clashes_are_accepted(inputs, params):
    # The rule is exactly about equal generated names: dt without an input t is fine.
    text = _clash(inputs, params)
    assert parse_and_derive(text) is None
    compile(sources(text)[0], "generated.py", "exec")


def test_state_and_dim_names_that_join_alike_run_correctly():
    # State S with value dim K_V and state S_K with value dim V: local names built as
    # <state>_<dim> met in the chunked kernel (`_iv_S_K_V` twice); they are built from the
    # dim's position now. The kernels must agree with the float64 reference.
    import torch
    text = ("mixer m\n  dims K, V, K_V\n  input q[K], k[K], v[V], w[K_V]\n  state S[K, K_V], S_K[K, V]\n"
            "  update S = S + k * w\n  update S_K = S_K + k * v\n  output o = (q @ S_K) * (q @ S @ w)\n")
    from mixc.pipeline import from_text
    op = from_text(text, "joined.mix")
    gen = torch.Generator().manual_seed(7)
    x = {n: torch.randn(1, 20, 2, d, generator=gen) for n, d in (("q", 4), ("k", 4), ("v", 3), ("w", 5))}
    ref, _ = op.reference(**x)
    for mode in ("chunk", "recurrent"):
        o, _ = op(**x, mode=mode)
        assert torch.allclose(o.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), mode


@pytest.mark.parametrize("name", library_names("recurrent"))     # sequence mixers have no kernels
def test_every_kernel_argument_from_a_spec_name_is_known_to_the_checker(name):
    """The checker's KERNEL_ARGUMENTS must list every p_ argument generated kernels derive from
    a spec name; if code generation adds one, this fails until the table has it."""
    op = mixc.load(name)
    m = op.ir
    known = set(dsl_check.FIXED_KERNEL_ARGUMENTS)
    for kind, decls in (("input", m.inputs), ("param", m.params), ("state", m.states)):
        known |= {prefix + d.name for d in decls for prefix, _ in dsl_check.KERNEL_ARGUMENTS[kind]}
    for src in sources(op.ir.source.text):
        kernels = [f for f in ast.parse(src).body if isinstance(f, ast.FunctionDef) and f.name.startswith(m.name + "_")]
        assert kernels
        args = {a.arg for f in kernels for a in f.args.args if a.arg.startswith("p_")}
        assert args <= known, f"kernel arguments the checker does not know: {sorted(args - known)}"


def test_the_stabilizer_state_is_the_one_of_derive():
    assert dsl_check.STABILIZER_STATE == stabilize.M


def test_call_keywords_are_reserved():
    """A spec name that is also a keyword of the call would be taken by it: an input named CK
    reached the op's CK (tokens per checkpoint) and never the kernels."""
    words = set()
    for fn in (MixerOp.__call__, MixerOp.step, runtime_reference.reference, runtime_reference.reference_step):
        words |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"}
    assert {"CK", "chunk", "dtype", "mode", "initial_state"} <= words
    assert words <= dsl_check.RESERVED, sorted(words - dsl_check.RESERVED)
    for word in ("CK", "chunk", "dtype"):
        err = refused(with_name("input", word))
        assert err.message == f"'{word}' is a reserved name and cannot be the name of an input", str(err)


# ---- 5. limits --------------------------------------------------------------------------------

BASE = ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[]\n  state S[K, V]\n  update S = S + k * v\n"
        "  output o = q @ S\n")


def position(text: str, needle: str) -> tuple[int, int]:
    i = text.index(needle)
    return text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1) + 1


@pytest.mark.parametrize("slot", SLOTS)
def test_a_name_of_10000_characters(slot):
    err = refused(with_name(slot, "x" * 10_000))
    assert err.message == "name is too long (10000 characters; the limit is 64)"
    assert (err.line, err.column) == declared_at(slot)


@pytest.mark.parametrize("kind", ["comments", "lets"])
def test_a_spec_of_a_megabyte(kind):
    pad = ("# " + "x" * 98 + "\n") * 10_000 if kind == "comments" else \
        "".join(f"  let a{i} = {i}\n" for i in range(60_000))
    text = BASE + pad
    start = time.perf_counter()
    err = refused(text)
    # Refused before parsing: lark would take half a minute over a megabyte.
    assert time.perf_counter() - start < 2
    assert err.message == f"spec is too long ({len(text)} characters; the limit is 100000)"
    assert err.span is None and str(err) == f"error: {err.message}\n  --> hostile.mix"


def test_spec_size_limit_is_exact():
    pad = 100_000 - len(BASE) - 1
    assert parse_and_derive(BASE + "#" + "x" * pad) is None         # 100,000 characters
    assert "spec is too long (100001 characters" in refused(BASE + "#" + "x" * (pad + 1)).message


@pytest.mark.parametrize("kind,count", [("let", 10_000), ("input", 10_000), ("param", 1_000), ("option", 1_000),
                                        ("dims", 10_000)])
def test_thousands_of_declarations(kind, count):
    # Written compactly, to stay under the size limit: the declarations limit (64) or, for
    # dims, their own (8) refuses them at the first one too many.
    if kind == "dims":
        text = "mixer m\n  dims " + ",".join(f"D{i}" for i in range(count)) + "\n"
        err = refused(text)
        assert err.message == "too many dims (the limit is 8)"
        line, column = position(text, ",D8,")
        assert (err.line, err.column) == (line, column + 1)
        return
    decl = {"let": "a{}=1", "option": "a{}=1", "input": "a{}[]", "param": "a{}[]"}[kind]
    text = BASE + f"  {kind} " + ",".join(decl.format(i) for i in range(count)) + "\n"
    err = refused(text)
    assert err.message == "too many declarations (the limit is 64)"
    # BASE declares 8 names (K, V, q, k, v, g, S, o): a56 is the 65th.
    line, column = position(text, "," + decl.format(56))
    assert (err.line, err.column) == (line, column + 1)


def test_a_shape_of_10000_dims():
    text = "mixer m\n  dims K\n  input x[" + ", ".join(["K"] * 10_000) + "]\n"
    err = refused(text)
    assert err.message == "dim 'K' appears twice in the shape of 'x'" and (err.line, err.column) == (3, 14)


def test_a_shape_of_every_dim():
    dims = [f"D{i}" for i in range(8)]
    err = refused(f"mixer m\n  dims {', '.join(dims)}\n  input x[{', '.join(dims)}]\n")
    assert err.message == "'x' has 8 dims; the limit is 4" and (err.line, err.column) == (3, 9)


def test_a_number_of_50000_digits():
    text = BASE.replace("q @ S\n", "q @ S + " + "9" * 50_000 + "\n")
    err = refused(text)
    # The message quotes the start of the number; the caret spans all of it.
    assert err.message == "number '99999999999999999999...' is out of range"
    assert (err.line, err.column) == (6, 22)


# Each after `q @ S + ` (the + is level 1, the expression starts at column 22): refused at the
# 64th of its own levels, the 65th in all.
@pytest.mark.parametrize("expr,column", [
    ("2 ** " * 65 + "1", 22 + 5 * 63),                          # right-associative: nests to the right
    ("(" * 20 + "if f then " * 65 + "1" + " else 1" * 65 + ")" * 20, 22 + 20 + 10 * 63),
    ("-(" * 65 + "1" + ")" * 65, 22 + 2 * 63),                  # parentheses are no level
    ("max(" * 65 + "1, 1" + ")" * 65, 22 + 4 * 63),
], ids=["power-chain", "if-chain-in-parentheses", "negated-parentheses", "max-calls"])
def test_nesting_beyond_the_parser_limit(expr, column):
    text = BASE.replace("  output o = q @ S\n", "  option f = true\n  output o = q @ S + " + expr + "\n")
    err = refused(text)
    assert "expression is nested too deeply (more than 64 levels" in err.message, str(err)
    assert (err.line, err.column) == (7, column)


def test_nesting_of_tens_of_thousands_of_levels_is_refused_without_recursing():
    text = BASE.replace("q @ S\n", "q @ S + " + "-" * 20_000 + "1\n")
    assert "nested too deeply" in refused(text).message


def _let_chain(first: int, second: int) -> str:
    """Two lets of negations (first, then second more), read in an update three levels deep."""
    return BASE.replace("  update S = S + k * v\n",
                        f"  let a1 = {'-' * first}g\n  let a2 = {'-' * second}a1\n"
                        "  update S = exp(a2) * S + k * v\n")


def _deep_stack(frames: int, fn):
    return fn() if frames == 0 else _deep_stack(frames - 1, fn)


def test_nesting_through_lets_at_the_limit_generates():
    # 62 + 63 levels of lets under exp, * and +: 128, the limit. Generated code substitutes lets
    # and recurses through them; with 200 frames of stack already used it still has room.
    text = _let_chain(62, 63)
    assert parse_and_derive(text) is None
    src = _deep_stack(200, lambda: generate(plan_of(text)))
    compile(src, "generated.py", "exec")


def test_nesting_through_lets_beyond_the_limit():
    text = _let_chain(62, 64)
    err = refused(text)
    assert err.message == ("expression is nested too deeply with the lets it reads written out (129 levels of "
                           "operators and calls through let 'a2'; the limit is 128); shorten the chain of lets")
    assert (err.line, err.column) == position(text, "a2) * S")


def test_a_long_chain_of_deep_lets():
    # Each let within the parser's limit, together 55 * 63 levels: this exhausted Python's
    # stack (RecursionError) in code generation before the limit through lets. Refused at the
    # first let beyond it: a3, 3 * 63 levels.
    lets = "".join(f"  let a{i} = {'-' * 63}a{i - 1}\n" for i in range(1, 56))
    text = BASE.replace("  update S", "  let a0 = g\n" + lets + "  update S")
    err = refused(text)
    assert "nested too deeply with the lets it reads written out (189 levels" in err.message
    assert (err.line, err.column) == position(text, "a2\n")


def _nested(fn: str, depth: int, x: str) -> str:
    return f"{fn}(" * depth + x + ")" * depth


SLOW_ALGEBRA = {
    # sympy's simplify took 50 s on the first and ran out of memory on the third: the
    # derivation keeps such a decay as written (symbolic.bounded_simplify).
    "exp-20-deep": f"update S = {_nested('exp', 20, 'g')} * S + k * v",
    "max-16-deep": "update S = " + "max(g, " * 16 + "g" + ")" * 16 + " * S + k * v",
    "power-1e6": "update S = (g + 1) ** 1000000 * S + k * v",
    "sigmoid-20-deep-readout": "update S = S + k * v\n  output o = " + _nested("sigmoid", 20, "q") + " @ S",
}


@pytest.mark.parametrize("update", SLOW_ALGEBRA.values(), ids=SLOW_ALGEBRA.keys())
def test_algebra_that_defeats_sympy_derives_quickly(update):
    text = BASE.replace("  update S = S + k * v\n", f"  {update}\n")
    if "output o =" in update:
        text = text.replace("  output o = q @ S\n", "\n")
    text = text.replace("g[]", "g[K]")
    start = time.perf_counter()
    plan = derive(mixc.parse(text, "slow.mix"))
    source = generate(plan)
    assert time.perf_counter() - start < 10
    assert "def " in source and plan.states[0].name == "S"


# ---- 6. hostile names at random places of the library specs ------------------------------------

LIBRARY = {name: read_spec(name).text for name in library_names()}
_LEX = re.compile(r"#[^\n]*|\s+|[A-Za-z_]\w*|\d+\.?\d*(?:[eE][+-]?\d+)?|\*\*|->|.", re.S)
_WORD = re.compile(r"[A-Za-z_]\w*\Z")
# Words of the language itself (if, exp, head, ...) change what a spec means, not what it is
# called: the mutation fuzz of test_fuzz.py covers them.
LANGUAGE_WORDS = set(dsl_parser.KEYWORDS) | set(dsl_check.BUILTIN_FNS) | set(dsl_check.BUILTIN_NAMES)
INSERTED = [n for n in HOSTILE_NAMES + ["IS_VARLEN", "USE_INITIAL_STATE", "p_out", "p_do", "s_S", "v_q", "mask"]
            if n not in LANGUAGE_WORDS]


def _declared(text: str) -> list[str]:
    m = mixc.parse(text)
    return [m.name, *m.dim_names, *(x.name for x in (*m.inputs, *m.params, *m.options, *m.lets, *m.states)),
            m.output.name]


DECLARED = {name: _declared(text) for name, text in LIBRARY.items()}


@st.composite
def hostile_library_spec(draw):
    """A library spec with a hostile name in place of a declared name everywhere it occurs (a
    consistent rename: the spec is often still valid), or at any one identifier."""
    name = draw(st.sampled_from(sorted(LIBRARY)))
    toks = _LEX.findall(LIBRARY[name])
    spots = [i for i, t in enumerate(toks) if _WORD.match(t)]
    if draw(st.integers(0, 2)):
        old = draw(st.sampled_from(DECLARED[name]))
        where = [j for j in spots if toks[j] == old]
    else:
        where = [draw(st.sampled_from(spots))]
    return name, tuple(toks), tuple(where), draw(st.sampled_from(INSERTED))


def _put(toks, where, word) -> str:
    where = set(where)
    return "".join(word if j in where else t for j, t in enumerate(toks))


def _hostile_library(case) -> None:
    name, toks, where, hostile = case
    text = _put(toks, where, hostile)
    if parse_and_derive(text, f"<library>/{name}.mix") is not None:    # nothing but a SpecError comes out
        return
    # Accepted: the hostile name names something (it is no word of the language). Its twin
    # calls that something `<hostile>zq` (which sorts like it) wherever it put it. A word the
    # spec had already keeps its meaning there (aft_full's `w[T, T]`: the call's time axis,
    # beside an input the draw named T), so the twin renames those only where the spec lacked it.
    neutral = hostile + "zq"
    ours = [] if hostile in toks else [j for j, t in enumerate(toks) if t == hostile]
    twin = _put(toks, ours + list(where), neutral)
    assert_behind_prefixes(text, twin, {hostile: neutral})


FAST = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FAST
@given(hostile_library_spec())
def test_hostile_names_in_library_specs(case):
    _hostile_library(case)


@pytest.mark.slow
@SLOW
@given(hostile_library_spec())
def test_hostile_names_in_library_specs_slow(case):
    _hostile_library(case)


def test_hostile_name_beside_the_same_word_of_the_spec():
    """The slow fuzz's find: aft_full with its input k named T beside `param w[T, T]` (T the
    call's time axis there) is accepted, and its T stays apart from the axis in generated code."""
    toks = tuple(_LEX.findall(LIBRARY["aft_full"]))
    where = tuple(j for j, t in enumerate(toks) if t == "k")         # the input k, renamed T everywhere
    assert parse_and_derive(_put(toks, where, "T"), "aft_full.mix") is None       # accepted: the check runs
    _hostile_library(("aft_full", toks, where, "T"))

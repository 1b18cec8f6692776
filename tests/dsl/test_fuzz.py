"""Fuzzing the spec language: whatever the text, parse + derive raise nothing but a
SpecError that points inside the text and speaks the user's words.

Three sources of text: (a) random strings of spec tokens and junk, (b) mutations of the
library specs, (c) well-typed random specs from a small generator (these must parse; the
derivation may still refuse them, with a SpecError). The default run is bounded; the
`slow` variants (pytest -m slow) draw thousands of examples.
"""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import torch

import mixc
from mixc.codegen.module import generate
from mixc.derive.lint import lint
from mixc.derive.plan import derive
from mixc.dsl import library_names, read_spec
from mixc.dsl.functions import FUNCTIONS
from mixc.runtime.inputs import random_args
from mixc.pipeline import from_text

from .spec_checks import parse_and_derive

FAST = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=3000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

LIBRARY = {name: read_spec(name).text for name in library_names()}


# ---- (a) random text from spec tokens and junk -----------------------------------------

TOKENS = [
    "mixer", "dims", "input", "param", "option", "let", "state", "update", "output",
    "if", "then", "else", "true", "false", "head", "prev", "rename", "sum", "norm", "max", "min",
    "softmax", "logsumexp", "mean", "layer_norm", "rms_norm", "l2norm", "eps", "eps=1e-3",
    "exp", "log", "sigmoid", "softplus", "sqrt", "abs", "m", "K", "V", "J", "S", "z", "q", "k",
    "v", "g", "a", "x", "B", "T", "tl", "_x", "0", "1", "2.5", "1e-6", ".5", "1e999",
    "+", "-", "*", "/", "**", "@", "->", "=", ",", "(", ")", "[", "]", "[]", "()",
    " ", " ", " ", "\n", "\n  ", "\t", "# note\n",
    "$", "'", '"', ";", ":", "!", "{", "}", "é", "中", "\u200b", "\x00", "\r\n", "\x0c", "\u2028",
    "in", "inf", "-inf", " in [0, 1]", " in (-inf, 0]",
    "const", "const c[] = 2\n", "[1, 2]", "[[1, 0], [0, 1]]", "= [", "E = 2",
]
PREFIX = "mixer m\n  dims K, V\n  input q[K], k[K], v[V]\n"

token_text = st.lists(st.sampled_from(TOKENS), max_size=60).map("".join)
spec_like_text = st.one_of(token_text, token_text.map(lambda s: PREFIX + s),
                           token_text.map(lambda s: "mixer m\n" + s))


def _random_text(text):
    parse_and_derive(text)


@FAST
@given(spec_like_text)
def test_random_token_text(text):
    _random_text(text)


@pytest.mark.slow
@SLOW
@given(spec_like_text)
def test_random_token_text_slow(text):
    _random_text(text)


@FAST
@given(st.text(max_size=200))
def test_random_unicode_text(text):
    parse_and_derive(text)
    parse_and_derive(PREFIX + text)


# ---- (b) mutations of the library specs --------------------------------------------------

_LEX = re.compile(r"#[^\n]*|\s+|[A-Za-z_]\w*|\d+\.?\d*(?:[eE][+-]?\d+)?|\*\*|->|.", re.S)
_WORD = re.compile(r"[A-Za-z_]\w*\Z")
JUNK = ["$", "é", "中", "\x00", "'", "(", ")", "[", "]", ",", "=", "*", "@", "-", ">", "\n", "\t",
        "#", "1", "_"]


def _tokens(text: str) -> list[str]:
    return _LEX.findall(text)


@st.composite
def mutated_spec(draw):
    name = draw(st.sampled_from(sorted(LIBRARY)))
    toks = _tokens(LIBRARY[name])
    for _ in range(draw(st.integers(1, 3))):
        if not toks:
            break
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "rename", "insert", "truncate"]))
        i = draw(st.integers(0, len(toks) - 1))
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(toks) - 1))
            toks[i], toks[j] = toks[j], toks[i]
        elif kind == "rename":
            words = sorted({t for t in toks if _WORD.match(t)})
            spots = [j for j, t in enumerate(toks) if _WORD.match(t)] or [i]
            j = spots[i % len(spots)]
            toks[j] = draw(st.sampled_from(words + ["head", "prev", "tl", "if", "B", "_y", "sum"]))
        elif kind == "insert":
            toks.insert(i, draw(st.sampled_from(JUNK)))
        else:
            toks = toks[:i]
    return name, "".join(toks)


def _mutation(case):
    name, text = case
    parse_and_derive(text, f"<library>/{name}.mix")


@FAST
@given(mutated_spec())
def test_library_mutations(case):
    _mutation(case)


@pytest.mark.slow
@SLOW
@given(mutated_spec())
def test_library_mutations_slow(case):
    _mutation(case)


# ---- (c) well-typed random specs -----------------------------------------------------------

HEADER = """mixer fuzz
  dims   K, V{vsize}, J = K
  input  q[K], k[K], v[V], g[]{g}, w[K]{w}, u[V]
  param  A[]{A}, P[K, V]
  const  c[] = {c}{C}
  option scale = K ** -0.5, f = {flag}
  state  S[K, V], z[K]
"""
# Declared ranges the generator puts on g, w and A (the prover reads them; calls draw inside them
# and the torch modes check them).
RANGES = ["", "", " in (-inf, 0]", " in [0, 1]", " in (0, 2)", " in [-1, 1]", " in [0.5, inf)"]
DIMS = ("K", "V", "J")
# Values of each shape, by context: lets read inputs, params and options; updates and the
# output also read lets and states (an update its own state, and with `coupled` the other one:
# S, updated first, reads z's previous value; z reads S's new value, as a program would).
LEAVES = {
    frozenset(): ["g", "A", "scale", "head", "1", "0.5", "2", "1e-3", "K ** -0.5", "prev(g)"],
    frozenset("K"): ["q", "k", "w", "prev(k)", "prev(w)"],      # prev(x): the previous token's input
    frozenset("V"): ["v", "u", "prev(v)"],
    frozenset("KV"): ["P"],
}
DIM_LEAVES = {"K": ["q", "k", "w"], "V": ["v", "u"], "J": ["rename(q, K -> J)", "rename(w, K -> J)"]}
FNS = list(FUNCTIONS)           # every function of the registry (mixc/dsl/functions.py)
# functions over a dim (mixc/dsl/dim_functions.py): same shape, or the dim reduced away
SHAPED_DIM_FNS = ["softmax", "layer_norm", "rms_norm", "l2norm"]
REDUCING_DIM_FNS = ["logsumexp", "mean"]


@st.composite
def expr(draw, shape: frozenset, depth: int, leaves: dict):
    """Text of an expression whose shape is exactly `shape` (dims as a set)."""
    options = ["leaf"] if leaves.get(shape) else []
    if depth > 0:
        options += ["binop", "fn", "neg", "pow", "reduce", "contract", "max2", "cond", "paren"]
        if shape:
            options.append("dimfn")
        if "J" in shape and "K" not in shape:
            options.append("rename")
    if not options:                      # no value of this shape: broadcast one of each dim
        return "(" + " * ".join(draw(st.sampled_from(DIM_LEAVES[d])) for d in sorted(shape)) + ")"
    kind = draw(st.sampled_from(options))
    sub = depth - 1
    if kind == "leaf":
        return draw(st.sampled_from(leaves[shape]))
    if kind == "binop":
        dims = sorted(shape)
        left = frozenset(d for d in dims if draw(st.booleans()))
        right = frozenset(shape - left) | frozenset(d for d in left if draw(st.booleans()))
        op = draw(st.sampled_from(["+", "-", "*", "/"]))
        return f"({draw(expr(left, sub, leaves))} {op} {draw(expr(right, sub, leaves))})"
    if kind == "fn":
        return f"{draw(st.sampled_from(FNS))}({draw(expr(shape, sub, leaves))})"
    if kind == "neg":
        return f"-{draw(expr(shape, sub, leaves))}"
    if kind == "pow":
        e = draw(st.sampled_from(["2", "-1", "0.5", "-0.5", "(1/16)"]))
        return f"({draw(expr(shape, sub, leaves))}) ** {e}"
    if kind == "reduce":
        free = [d for d in DIMS if d not in shape]
        if not free:
            return draw(expr(shape, sub, leaves))
        d = draw(st.sampled_from(free))
        fn = draw(st.sampled_from(["sum", "norm", "max", "min"] + REDUCING_DIM_FNS))
        return f"{fn}({draw(expr(shape | {d}, sub, leaves))}, {d})"
    if kind == "dimfn":
        over = [d for d in sorted(shape) if draw(st.booleans())] or [sorted(shape)[0]]
        fn = draw(st.sampled_from(SHAPED_DIM_FNS))
        eps = draw(st.sampled_from(["", ", eps=1e-3", ", eps=scale"])) if fn != "softmax" else ""
        return f"{fn}({draw(expr(shape, sub, leaves))}, {', '.join(over)}{eps})"
    if kind == "contract":
        free = [d for d in DIMS if d not in shape]
        if not free:
            return draw(expr(shape, sub, leaves))
        d = draw(st.sampled_from(free))
        left = frozenset(x for x in sorted(shape) if draw(st.booleans()))
        right = shape - left
        return f"({draw(expr(left | {d}, sub, leaves))} @ {draw(expr(right | {d}, sub, leaves))})"
    if kind == "max2":
        fn = draw(st.sampled_from(["max", "min"]))
        # The second argument is never a bare dim name: max(x, K) is a reduction.
        return f"{fn}({draw(expr(shape, sub, leaves))}, ({draw(expr(shape, sub, leaves))}) * 1)"
    if kind == "cond":
        return f"(if f then {draw(expr(shape, sub, leaves))} else {draw(expr(shape, sub, leaves))})"
    if kind == "paren":
        return f"({draw(expr(shape, sub, leaves))})"
    # rename: a value over K becomes one over J
    return f"rename({draw(expr((shape - {'J'}) | {'K'}, sub, leaves))}, K -> J)"


def _with(leaves: dict, **extra) -> dict:
    out = {k: list(v) for k, v in leaves.items()}
    for shape, names in extra.items():
        out.setdefault(frozenset(shape if shape != "scalar" else ""), []).extend(names)
    return out


# the values a const's elements take: number expressions, as ranges and options allow
CONST_VALUES = ["0.5", "-1 / 16", "2 ** -5", "3", "exp(-1)", "-(2)", "1e-3"]


@st.composite
def const_values(draw, size: int | None) -> str:
    """A const's value: a number (size None) or a list of `size` numbers."""
    if size is None:
        return draw(st.sampled_from(CONST_VALUES))
    return "[" + ", ".join(draw(st.sampled_from(CONST_VALUES)) for _ in range(size)) + "]"


@st.composite
def typed_spec(draw):
    depth = draw(st.integers(0, 3))
    lets = []
    vsize = draw(st.sampled_from(["", "", " = 2", " = 5"]))     # V fixed by the spec: a const C[V] too
    fixed_v = int(vsize[3:]) if vsize else None
    const_v = f", C[V] = {draw(const_values(fixed_v))}" if fixed_v else ""
    # the consts (const c[] = 0.5, C[V] = [...]) read as any value of their shape
    let_leaves = _with(LEAVES, scalar=["c"], **({"V": ["C"]} if fixed_v else {}))
    for i in range(draw(st.integers(0, 2))):
        shape = draw(st.sampled_from([frozenset(), frozenset("K"), frozenset("V"), frozenset("KV")]))
        lets.append((f"a{i}", draw(expr(shape, depth, let_leaves))))
        let_leaves = _with(let_leaves, **{"".join(sorted(shape)) or "scalar": [f"a{i}"]})
    coupled = draw(st.booleans())
    s_leaves = _with(let_leaves, KV=["S", "prev(S)"], **({"K": ["z", "prev(z)"]} if coupled else {}))
    z_leaves = _with(let_leaves, K=["z", "prev(z)"] + (["(S @ u)", "(prev(S) @ v)"] if coupled else []))
    form = draw(st.sampled_from(["affine", "plus", "any"]))
    if form == "affine":                  # the shape every mixer has: A * S + B
        upd_s = f"{draw(expr(frozenset('K'), depth, let_leaves))} * S + {draw(expr(frozenset('KV'), depth, let_leaves))}"
        if coupled:                       # a block-affine system: S reads z
            upd_s += f" + {draw(expr(frozenset('V'), depth, let_leaves))} * z"
    elif form == "plus":                  # S plus anything of S: often linear, sometimes not
        upd_s = f"S + {draw(expr(frozenset('KV'), depth, s_leaves))}"
    else:
        upd_s = draw(expr(frozenset("KV"), depth, s_leaves))
    upd_z = f"z * {draw(expr(frozenset(), depth, let_leaves))} + {draw(expr(frozenset('K'), depth, z_leaves))}"
    out_leaves = _with(let_leaves, KV=["S", "prev(S)"], K=["z", "prev(z)"])
    output = f"q @ S + {draw(expr(frozenset('V'), depth, out_leaves))}"
    text = HEADER.format(flag=draw(st.sampled_from(["true", "false"])), g=draw(st.sampled_from(RANGES)),
                         w=draw(st.sampled_from(RANGES)), A=draw(st.sampled_from(RANGES)),
                         vsize=vsize, c=draw(const_values(None)), C=const_v)
    text += "".join(f"  let    {n} = {e}\n" for n, e in lets)
    text += f"  update S = {upd_s}\n  update z = {upd_z}\n  output o = {output}\n"
    return text


# the checker's refusals of a constant part without a finite value (log(1 + -1), 0 ** -1): the
# generator can draw one (hypothesis 6.0 did), and refusing it is the documented behaviour
_NO_VALUE = re.compile(r"is (minus )?infinity|is not a number|no finite real value|divides by zero|"
                       r"too large for a float|is not a real number")


def _typed(text):
    try:
        mixc.parse(text, "typed.mix")      # well-typed by construction: the checker must accept it
    except mixc.SpecError as err:
        if not _NO_VALUE.search(str(err)):
            raise
        assume(False)
    parse_and_derive(text, "typed.mix")


def _pipeline(text, seed):
    """The whole pipeline, as `mixc check` and a first call take it: parse, derive, lint,
    generate the module source, and a small call in torch mode (float64) against the float64
    reference. Refusals are SpecErrors (checked by parse_and_derive); anything else is a bug."""
    if parse_and_derive(text, "typed.mix") is not None:
        return
    op = from_text(text, "typed.mix")
    plan = op.plan()
    for w in lint(plan):
        assert w.render(op.ir.source).startswith("typed.mix:")
    assert "def " in generate(plan)
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes={"K": 3, "V": 2}, dtype=torch.float64, seed=seed)
    ref, ref_state = op(**args, mode="reference", output_final_state=True)
    if not (torch.isfinite(ref).all() and all(torch.isfinite(x).all() for x in ref_state.values())):
        return                             # a random spec may overflow or divide by 0 in float64 too
    got, _ = op(**args, mode="torch", output_final_state=True)
    scale = ref.abs().max().item() + 1.0
    assert (got - ref).abs().max().item() <= 1e-6 * scale, text


# Fewer examples than the other fuzz tests: each one compiles and runs a module (~0.1 s).
PIPELINE = settings(FAST, max_examples=40)


@PIPELINE
@given(typed_spec(), st.integers(0, 2**16))
def test_typed_random_specs(text, seed):
    _typed(text)
    _pipeline(text, seed)


@pytest.mark.slow
@SLOW
@given(typed_spec(), st.integers(0, 2**16))
def test_typed_random_specs_slow(text, seed):
    _typed(text)
    _pipeline(text, seed)


@FAST
@given(typed_spec())
def test_typed_random_specs_derive(text):
    _typed(text)


# ---- 2x2 block-affine systems of the chunked form's shape (derive/system_chunk.py) ----------

SYSTEM_HEADER = """mixer coupled_pair
  dims   K, V
  input  q[K], k[K], u[K], v[V], ga[] in (0, 1), gd[] in (0, 1), gc[], beta[] in (0, 1)
  state  {states}
"""


@st.composite
def system_spec(draw):
    """Two states X, Y [K, V] with scalar gates >= 0 on their own value, Y reading X (its new
    or previous value, with a scalar factor), an optional rank-1 projection k @ (one state) in
    either update, input terms key (x) value, in either order of declaration and outputs
    reading either state (prev() too): the shapes the torch chunked form takes."""
    gate = st.sampled_from(["ga", "gd", "ga * gd", "1 - ga", "sigmoid(gc)", "0.5 * ga + 0.25"])
    read = draw(st.sampled_from(["X", "Y", None]))
    def update(own, extra):
        text = f"({draw(gate)}) * {own}"
        if read is not None and draw(st.booleans()):
            text += f" - {draw(st.sampled_from(['beta * k', 'beta * u', 'u']))} * (k @ {read})"
        if draw(st.booleans()):
            text += f" + {draw(st.sampled_from(['beta * k * v', 'u * v', 'k * (beta * v)']))}"
        return text + extra
    link = draw(st.sampled_from(["X", "prev(X)", "gc * X", "ga * prev(X)"]))
    upd_x = update("X", "")
    upd_y = update("Y", f" + {link}")
    states = draw(st.sampled_from(["X[K, V], Y[K, V]", "Y[K, V], X[K, V]"]))
    output = draw(st.sampled_from(["q @ Y", "q @ X + q @ Y", "q @ prev(Y) + sum(X, K)", "(q @ X) * beta"]))
    return (SYSTEM_HEADER.format(states=states) + f"  update X = {upd_x}\n  update Y = {upd_y}\n"
            f"  output o = {output}\n")


@settings(FAST, max_examples=30)
@given(system_spec(), st.integers(0, 2**16))
def test_random_systems_chunked_in_torch_mode(text, seed):
    """Every such system has mode "torch"'s chunked form and equals the float64 reference
    (chunks of 4 over T = 9: output and both final states)."""
    op = from_text(text, "sys.mix")
    assert op.plan().layout.torch_chunk_unsupported is None, (text, op.plan().layout.torch_chunk_unsupported)
    args, _ = random_args(op.ir, B=2, T=9, H=2, sizes={"K": 3, "V": 2}, dtype=torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for n in ("ga", "gd", "beta"):
        args[n] = 0.05 + 0.9 * torch.rand(args[n].shape, generator=gen, dtype=torch.float64)
    ref, ref_state = op(**args, mode="reference", output_final_state=True)
    got, got_state = op(**args, mode="torch", output_final_state=True, chunk=4)
    scale = ref.abs().max().item() + 1.0
    assert (got - ref).abs().max().item() <= 1e-9 * scale, text
    for n in ref_state:
        assert (got_state[n].double() - ref_state[n]).abs().max().item() <= 1e-6 * (ref_state[n].abs().max().item() + 1), text


@pytest.mark.slow
@settings(FAST, max_examples=8)
@given(system_spec(), st.integers(0, 2**16))
def test_random_systems_chunk_kernels(text, seed):
    """Those whose forms list chunk (derive/system_chunk.py kernel_unsupported: one rank-1 read,
    one outer product per state, one readout term) run mode "chunk", the system's Triton kernels
    (interpreted, float32), and equal the float64 reference: output and both final states over
    T = 21 in chunks of 16, gradients of the output into every input."""
    op = from_text(text, "sys.mix")
    assume("chunk" in op.plan().forms)
    args, _ = random_args(op.ir, B=1, T=21, H=2, sizes={"K": 3, "V": 2}, dtype=torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for n in ("ga", "gd", "beta"):
        args[n] = 0.05 + 0.9 * torch.rand(args[n].shape, generator=gen, dtype=torch.float64)
    args = {n: x.requires_grad_(True) for n, x in args.items()}
    ref, ref_state = op(**args, mode="reference", output_final_state=True)
    a32 = {n: x.detach().float().requires_grad_(True) for n, x in args.items()}
    got, got_state = op(**a32, mode="chunk", output_final_state=True, chunk=16)
    scale = ref.abs().max().item() + 1.0
    assert (got.double() - ref).abs().max().item() <= 1e-4 * scale, text
    for n in ref_state:
        assert (got_state[n].double() - ref_state[n]).abs().max().item() <= 1e-4 * (ref_state[n].abs().max().item() + 1), text
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((ref * w).sum(), list(args.values()), allow_unused=True)
    have = torch.autograd.grad((got.double() * w).sum(), list(a32.values()), allow_unused=True)
    for n, a, b in zip(args, have, want):
        if b is None:
            continue
        assert a is not None, (n, text)
        assert (a.double() - b).abs().max().item() <= 1e-3 * (b.abs().max().item() + 1), (n, text)


# ---- crashes found by fuzzing -------------------------------------------------------------

@pytest.mark.parametrize("const", ["softplus(0)", "relu(1)", "sqrt(2)", "elu(2)", "silu(0.5)"])
def test_max_of_a_constant_sympy_cannot_order(const):
    """Found by fuzzing: sympy's Max compared its arguments and raised on these."""
    text = ("mixer m\n  dims K, V\n  input q[K], k[K], v[V], g[]\n  state S[K, V]\n"
            f"  update S = max(g, {const}) * S + min(k * v, {const})\n  output o = q @ S\n")
    plan = derive(mixc.parse(text))
    assert plan.states[0].transition == "scalar decay"

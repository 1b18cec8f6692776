"""Every error path of the spec language, table-driven (in the style of Triton's
compile-error tests): each bad spec must raise a SpecError at the exact line and column,
with a message in the user's words, rendered with the source line and a caret under the
column, and never a lark terminal name, a traceback or one of our file names."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

import mixc
from mixc.derive.plan import derive
from mixc.dsl import errors, parser as dsl_parser

from .spec_checks import internal_words

# Line 1-4 of most cases; line 5 is the update and line 6 the output unless said otherwise.
HEAD = """mixer m
  dims   K, V
  input  q[K], k[K], v[V]
  state  S[K, V]
"""
GOOD_UPDATE = "  update S = S + k * v\n"
GOOD_OUTPUT = "  output o = q @ S\n"


def upd(expr: str) -> str:
    """The base spec with `update S = <expr>` on line 5."""
    return HEAD + f"  update S = {expr}\n" + GOOD_OUTPUT


def out(expr: str) -> str:
    """The base spec with `output o = <expr>` on line 6."""
    return HEAD + GOOD_UPDATE + f"  output o = {expr}\n"


def after(*lines: str) -> str:
    """The base spec (lines 1-6) followed by more lines from line 7."""
    return HEAD + GOOD_UPDATE + GOOD_OUTPUT + "".join(f"  {x}\n" for x in lines)


def spec(*lines: str) -> str:
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    line: int | None         # None: a whole-file error with no place in the text
    column: int | None
    words: str               # the message contains these words


C = Case
CASES = [
    # ---- syntax ---------------------------------------------------------------------
    C("missing-rsqb", spec("mixer m", "  dims K", "  input q[K, k[K]"), 3, 15,
      "unexpected '['; expected ',' or ']'"),
    C("missing-rsqb-before-statement", spec("mixer m", "  dims K", "  input q[K", "  state S[K]"), 4, 3,
      "unexpected 'state'; expected ',' or ']'"),
    C("missing-comma", spec("mixer m", "  dims K", "  input q[K] k[K]"), 3, 14,
      "unexpected 'k'; expected ',', 'in' or a new statement (dims, input, param, const, option, let, state, "
      "update, output)"),
    C("unexpected-rpar", upd("S + )"), 5, 18, "unexpected ')'; expected an expression"),
    C("double-equals", upd("= S"), 5, 14, "unexpected '='; expected an expression"),
    C("double-comma", spec("mixer m", "  dims K,, V"), 2, 10, "unexpected ','; expected a name"),
    C("junk-after-output", after("bad"), 7, 3, "unexpected 'bad'; expected '(', an operator"),
    C("statement-without-keyword", spec("mixer m m"), 1, 9, "unexpected 'm'; expected a new statement"),
    C("no-mixer-line", spec("dims K"), 1, 1, "unexpected 'dims'; expected 'mixer'"),
    C("dollar", spec("mixer m", "  dims K, V $"), 2, 13, "unexpected character '$'"),
    C("quote", out("q @ S + 'x'"), 6, 22, "unexpected character \"'\""),
    C("accented-letter", spec("mixer m", "  dims K", "  input qé[K]"), 3, 10,
      "unexpected character 'é' (names are ASCII letters, digits and _)"),
    C("cjk-letter", out("q @ S + 中"), 6, 22, "unexpected character '中' (names are ASCII letters"),
    # only ASCII 0-9 are digits: 1\u06605 was read as 105, fullwidth and mathematical digits alike
    C("arabic-indic-digit", upd("1\u06605 * S + k * v"), 5, 15,
      "unexpected character '\u0660' (numbers are written with the ASCII digits 0-9)"),
    C("fullwidth-digits", upd("\uff11\uff12 * S + k * v"), 5, 14, "unexpected character '\uff11' (numbers are"),
    C("mathematical-digit", upd("2 * \U0001d7cf * S + k * v"), 5, 18, "unexpected character '\U0001d7cf' (numbers"),
    C("non-ascii-exponent-digit", upd("1e\u0663 * S + k * v"), 5, 16, "unexpected character '\u0663' (numbers"),
    C("zero-width-space", out("q @ S +\u200b k"), 6, 21, "unexpected character U+200B"),
    C("nul", out("q @ S + \x00"), 6, 22, "unexpected character U+0000"),
    C("arrow-outside-rename", out("q @ S + k->v"), 6, 23, "'->' may only appear in rename(x, A -> B)"),
    C("empty-file", "", 1, 1, "unexpected end of file; expected 'mixer'"),
    C("only-comment", "# nothing here\n", 1, 15, "unexpected end of file; expected 'mixer'"),
    C("eof-after-mixer", "mixer", 1, 6, "unexpected end of file; expected a name"),
    C("eof-in-expression", HEAD + "  update S = S + k *\n", 5, 21,
      "unexpected end of file; expected an expression"),
    C("eof-in-parens", HEAD + "  update S = (S + k\n", 5, 20, "unexpected end of file; expected ')'"),
    C("keyword-as-input-name", spec("mixer m", "  dims K", "  input q[K], state[K]"), 3, 15,
      "'state' is a keyword of the spec language and cannot be used as a name"),
    C("keyword-as-let-name", after("let if = 1"), 7, 7, "'if' is a keyword of the spec language"),
    C("keyword-as-mixer-name", spec("mixer dims"), 1, 7, "'dims' is a keyword of the spec language"),
    *[C(f"mixer-named-{mod}", spec(f"mixer  {mod}", "  dims K"), 1, 8,
        f"mixer name '{mod}' is the name of a Python module: the module that `mixc compile -o DIR` writes")
      for mod in ("torch", "os", "triton", "numpy", "mixc", "json")],
    C("keyword-as-dim-name", spec("mixer m", "  dims then"), 2, 8, "'then' is a keyword"),
    C("keyword-in-expression", out("q @ S + input"), 6, 22,
      "'input' is a keyword of the spec language and cannot be used as a name"),
    C("dangling-operator", HEAD + "  update S = S + k * v +\n" + GOOD_OUTPUT, 6, 3,
      "'output' is a keyword of the spec language"),
    C("if-without-parens", out("q @ S + if f then 1 else 2"), 6, 22,
      "an if-expression inside another expression needs parentheses: (if FLAG then a else b)"),
    C("if-without-then", out("if f q @ S else q @ S"), 6, 19, "unexpected 'q'; expected 'then'"),

    # ---- names ----------------------------------------------------------------------
    C("unknown-name", upd("S + kk * v"), 5, 18, "unknown name 'kk' (did you mean 'k'?)"),
    C("unknown-name-case", upd("S + K * v + Q"), 5, 26, "unknown name 'Q' (did you mean 'q'?)"),
    C("unknown-name-no-hint", upd("S + zzz"), 5, 18, "unknown name 'zzz'"),
    C("unknown-dim", spec("mixer m", "  dims K, V", "  input q[K], v[VV]"), 3, 17,
      "unknown dim 'VV' (did you mean 'V'?)"),
    C("unknown-function", out("q @ exq(S)"), 6, 18, "unknown function 'exq' (did you mean 'exp'?)"),
    C("unknown-function-sigmoid", out("q @ sigmod(S)"), 6, 18, "(did you mean 'sigmoid'?)"),
    C("unknown-dim-in-sum", out("sum(q, KK) * (q @ S)"), 6, 21,
      "sum() reduces over dims: expected a dim name here (did you mean 'K'?)"),
    C("unknown-dim-in-rename", out("q @ S + sum(rename(k, K -> X), K)"), 6, 41, "unknown dim 'X'"),
    C("unknown-alias-target", spec("mixer m", "  dims K, J = X"), 2, 15,
      "unknown dim 'X' (an alias must name a dim declared before it)"),
    C("unknown-flag", out("if g then q @ S else q @ S"), 6, 17,
      "'g' after 'if' must be a flag declared as `option g = false`, but it is not an option"),
    C("used-before-declared", HEAD + "  update S = S + k * a\n  let a = v\n" + GOOD_OUTPUT, 5, 22,
      "'a' is used before it is declared (on line 6)"),
    C("let-reads-itself", after("let a = a + 1"), 7, 11, "let 'a' refers to itself"),
    C("output-reads-itself", out("o + q @ S"), 6, 14, "output 'o' refers to itself"),
    C("read-the-output", after("let a = o"), 7, 11, "'o' is the output of the mixer; nothing in the spec "
                                                   "can read it"),
    C("update-reads-later-output", upd("S + o") , 5, 18, "'o' is the output of the mixer"),
    C("function-as-value", out("q @ S + exp"), 6, 22, "'exp' is a function; call it as exp(...)"),

    # ---- declarations ---------------------------------------------------------------
    C("duplicate-dim", spec("mixer m", "  dims K, K"), 2, 11, "'K' is already declared (as a dim on line 2)"),
    C("duplicate-input", spec("mixer m", "  dims K", "  input q[K], q[K]"), 3, 15,
      "'q' is already declared (as an input on line 3)"),
    C("let-shadows-input", after("let q = 1"), 7, 7, "'q' is already declared (as an input on line 3)"),
    C("state-shadows-input", HEAD + "  state q[K]\n", 5, 9, "'q' is already declared (as an input"),
    C("output-named-as-state", HEAD + GOOD_UPDATE + "  output S = q @ S\n", 6, 10,
      "'S' is already declared (as a state on line 4)"),
    C("let-named-as-dim", after("let K = 1"), 7, 7, "'K' is already declared (as a dim on line 2)"),
    C("updated-twice", after("update S = S"), 7, 10, "state 'S' is updated twice (first on line 5)"),
    C("reserved-tl", spec("mixer m", "  dims K", "  input tl[K]"), 3, 9,
      "'tl' is a reserved name and cannot be the name of an input"),
    C("reserved-torch", after("let torch = 1"), 7, 7, "'torch' is a reserved name and cannot be the name of a let"),
    C("reserved-exec", spec("mixer m", "  dims K", "  param exec[K]"), 3, 9,
      "'exec' is a reserved name and cannot be the name of a param"),
    C("reserved-dunder-import", spec("mixer m", "  dims K", "  input __import__[K]"), 3, 9,
      "names may not start with '_' (reserved for generated code): '__import__'"),
    C("reserved-underscore", after("let _x = 1"), 7, 7, "names may not start with '_'"),
    C("reserved-python-keyword", after("let lambda = 1"), 7, 7, "'lambda' is a reserved name"),
    C("reserved-builtin-function", spec("mixer m", "  dims K", "  input exp[K]"), 3, 9,
      "'exp' is a built-in of the spec language and cannot be the name of an input"),
    C("reserved-head", after("option head = 1"), 7, 10, "'head' is a built-in of the spec language and cannot "
                                                        "be the name of an option"),
    C("reserved-mixer-name", spec("mixer _m"), 1, 7, "'_m' cannot be a mixer name"),
    C("python-keyword-mixer-name", spec("mixer class"), 1, 7, "'class' cannot be a mixer name"),
    C("dim-B", spec("mixer m", "  dims K, B"), 2, 11,
      "'B' names an axis of every call (B batch, T time, H heads) and cannot be a dim name"),
    C("dim-T", spec("mixer m", "  dims T"), 2, 8, "'T' names an axis of every call"),
    C("dim-H", spec("mixer m", "  dims K, V, H"), 2, 14, "'H' names an axis of every call"),
    C("dim-twice-in-shape", spec("mixer m", "  dims K", "  input x[K, K]"), 3, 14,
      "dim 'K' appears twice in the shape of 'x'"),
    C("dim-without-size", spec("mixer m", "  dims K, V, N", "  input q[K], k[K], v[V]", "  state S[K, V]",
                               "  update S = S + k * v", "  output o = q @ S"), 2, 14,
      "the size of dim 'N' is not given by any input or param; use it in an input or param shape"),
    C("alias-without-size", spec("mixer m", "  dims K, V, J = N, N", "  input q[K], k[K], v[V]"), 2, 18,
      "unknown dim 'N' (an alias must name a dim declared before it)"),

    # ---- missing or extra statements ------------------------------------------------
    C("no-state", spec("mixer m", "  dims K", "  input q[K]"), 1, 7,
      "mixer 'm' declares no state; add e.g. `state S[K, V]` and its `update`"),
    C("no-update", HEAD + GOOD_OUTPUT, 4, 10, "state 'S' has no update; add `update S = ...`"),
    C("no-output", HEAD + GOOD_UPDATE, 1, 7, "mixer 'm' has no output; add `output o = ...`"),
    C("two-outputs", after("output p = q @ S"), 7, 10, "a mixer has one output; 'o' was declared on line 6"),
    C("output-reads-no-state", out("q @ k"), 6, 14, "output 'o' does not read any state"),
    C("update-of-non-state", HEAD + "  update q = S + k * v\n", 5, 10,
      "'q' is not a state; declare it with `state q[...]` before its update"),
    C("update-of-unknown", HEAD + "  update SS = S + k * v\n", 5, 10, "'SS' is not a state (did you mean 'S'?)"),

    # ---- shapes ---------------------------------------------------------------------
    C("update-shape", upd("S @ v + k"), 5, 14, "update of S has shape [K] but S is [K, V]"),
    C("update-shape-too-big", HEAD + "  state  z[K]\n  update S = S + k * v\n  update z = z + k * v\n"
      + GOOD_OUTPUT, 7, 14, "update of z has shape [K, V] but z is [K]"),
    C("matmul-no-shared-dim", out("q @ v + q @ S"), 6, 14,
      "'@' contracts shared dims, but the left side has shape [K] and the right side [V]; "
      "use '*' for an outer product"),
    C("matmul-with-scalar", out("2 @ S"), 6, 14, "the left side has shape [] and the right side [K, V]"),
    C("power-vector-exponent", upd("S + k * v ** k"), 5, 27,
      "the exponent of '**' must be a scalar, but it has shape [K]"),
    C("power-matrix-exponent", out("2 ** (q @ S)"), 6, 20, "the exponent of '**' must be a scalar"),
    C("sum-over-missing-dim", out("sum(q @ S, K)"), 6, 25, "sum() over K, but its argument has shape [V]"),
    C("norm-over-missing-dim", out("q @ S / norm(v, K)"), 6, 30, "norm() over K, but its argument has shape [V]"),
    C("max-over-missing-dim", out("q @ S + max(v, V, K)"), 6, 32, "max() over K, but its argument has shape [V]"),
    C("sum-dim-twice", out("q @ S + sum(k * v, V, V)"), 6, 36, "sum() names dim V twice"),
    C("if-branch-shapes", HEAD + "  option f = true\n" + GOOD_UPDATE + "  output o = if f then q @ S else q\n",
      7, 14, "the branches of this if have shapes [V] and [K]; they must be equal"),
    C("too-many-dims", spec("mixer m", "  dims A, C, D, E, F, G, I, L, M"), 2, 32, "too many dims (the limit is 8)"),
    C("rank-too-high", spec("mixer m", "  dims A, C, D, E, F", "  input x[A, C, D, E, F]"), 3, 9,
      "'x' has 5 dims; the limit is 4"),

    # ---- calls ----------------------------------------------------------------------
    C("exp-two-args", upd("S + exp(k, v)"), 5, 18, "exp() takes 1 argument, got 2"),
    C("exp-no-args", upd("S + exp()"), 5, 18, "exp() takes 1 argument, got 0"),
    C("sum-without-dim", out("q @ S + sum(v)"), 6, 22,
      "sum() takes a value and the dims to reduce over, e.g. sum(x, K)"),
    C("sum-over-a-number", out("q @ S + sum(v, 1)"), 6, 29, "sum() reduces over dims: expected a dim name here"),
    C("max-one-arg", out("q @ S + max(v)"), 6, 22, "or two values: max(a, b)"),
    C("max-three-values", out("q @ S + max(v, k, q)"), 6, 22,
      "max() takes two values, max(a, b), or a value and dims, max(x, K)"),
    C("norm-over-a-tensor", out("q @ S + norm(v, q)"), 6, 30, "norm() reduces over dims: expected a dim name here"),

    # ---- prev() ---------------------------------------------------------------------
    C("prev-of-unknown", out("q @ prev(SS)"), 6, 23,
      "prev() takes a state or an input, but 'SS' is not one (did you mean 'S'?)"),
    C("prev-two-args", out("q @ S + prev(S, S)"), 6, 22,
      "prev() takes the name of a state or an input, e.g. prev(S) or prev(x)"),
    C("prev-of-expression", out("q @ prev(S + 1)"), 6, 18,
      "prev() takes the name of a state or an input, e.g. prev(S) or prev(x)"),
    # prev() of an input: the previous token's value
    C("prev-of-prev", upd("S + prev(prev(k)) * v"), 5, 18, "prev(prev(...)): only the previous token is kept"),
    C("prev-of-param", HEAD + "  param  w[K]\n" + "  update S = S + prev(w) * v\n" + GOOD_OUTPUT, 6, 23,
      "prev() of param 'w': a param has the same value at every token (prev(w) would be w); prev() takes a state "
      "or an input"),
    C("prev-of-let", HEAD + "  let    u = 2 * k\n" + "  update S = S + prev(u) * v\n" + GOOD_OUTPUT, 6, 23,
      "prev() of let 'u': write the let's previous value with prev() of the inputs it reads"),
    C("prev-of-input-in-option", HEAD + "  option a = sum(prev(q), K)\n", 5, 18,
      "an option's default may use only numbers, dims and earlier options, not prev(q)"),
    C("prev-of-input-name-taken", HEAD.replace("v[V]", "v[V], prev_k[K]") + "  update S = S + prev(k) * v\n"
      + GOOD_OUTPUT, 5, 18, "prev(k) is carried as 'prev_k' (an input of the kernels, an entry of the state), but "
      "'prev_k' is declared as an input on line 3; rename that"),
    C("prev-of-input-kernel-argument", HEAD.replace("v[V]", "v[V], dprev_k[K]") + "  update S = S + prev(k) * v\n"
      + GOOD_OUTPUT, 5, 18, "the gradient of input 'prev_k' and input 'dprev_k' would have the same name in "
      "generated code (p_dprev_k)"),
    C("prev-of-input-in-a-sequence-mixer", spec("mixer m", "  dims K", "  input x[K]", "  param h[T]",
                                                "  output y = conv(h, x) + prev(x)"), 5, 27,
      "prev(x) needs a state: a sequence mixer (conv, mix, attend) reads other tokens with conv()"),
    C("prev-in-let", HEAD + "  let a = prev(S)\n" + GOOD_UPDATE + GOOD_OUTPUT, 5, 11,
      "prev(S) may only appear in an update or the output"),
    C("prev-in-option", HEAD + "  option a = prev(S)\n", 5, 14, "prev(S) may only appear in an update or the output"),
    # ---- coupled states: updates that read one another must be linear in all of them ----
    C("coupled-product-of-states", HEAD + "  state  z[K]\n" + GOOD_UPDATE + "  update z = z + sum(prev(S) * z, V)\n"
      + GOOD_OUTPUT, 7, 22, "the update of z is not linear in the states S, z: found prev(S) * z"),
    C("coupled-function-of-a-state", HEAD + "  state  z[K]\n" + GOOD_UPDATE + "  update z = z + exp(S @ v)\n"
      + GOOD_OUTPUT, 7, 18, "the update of z is not linear in the states S, z: applies exp() to a state of the system"),
    C("coupled-reads-new-value-nonlinearly", HEAD + "  state  z[K]\n" + "  update z = z + k\n"
      + "  update S = S * z + k * v\n" + GOOD_OUTPUT, 7, 14,
      "the update of S is not linear in the states S, z: found S * z"),
    C("coupled-reads-a-state-declared-later", "mixer m\n  dims K, V\n  input q[K], k[K], v[V]\n  state S[K, V]\n"
      "  update S = S + z * v\n  state z[K]\n  update z = z + k\n" + GOOD_OUTPUT, 5, 18,
      "'z' is used before it is declared (on line 6)"),

    # ---- what each statement may read ------------------------------------------------
    C("let-reads-state", HEAD + "  let a = S\n", 5, 11,
      "a let cannot read state 'S': lets are computed per token from inputs, params and options"),
    C("option-reads-input", HEAD + "  option scale = q\n", 5, 18,
      "an option's default may use only numbers, dims and earlier options, not 'q'"),
    C("option-reads-head", HEAD + "  option scale = 1 / head\n", 5, 22,
      "an option's default cannot depend on the head index"),
    C("option-reads-later-option", HEAD + "  option a = b, b = 1\n", 5, 14,
      "'b' is used before it is declared (on line 5)"),
    C("option-reads-itself", HEAD + "  option a = a\n", 5, 14, "option 'a' refers to itself"),
    C("option-default-true-plus", HEAD + "  option a = true + 1\n", 5, 14,
      "true and false may only be the default of an option"),
    # options and constants without a finite real value (were accepted; the op then gave NaN)
    C("option-divides-by-zero", HEAD + "  option a = 1 / 0\n", 5, 14, "'1 / 0' divides by zero"),
    C("option-zero-by-zero", HEAD + "  option a = 2, b = 0 / 0\n", 5, 21, "'0 / 0' divides by zero"),
    C("option-through-an-option", HEAD + "  option a = 1000, b = a ** a\n", 5, 24,
      "the default of option 'b' is too large for a float (past 1.8e308) with the defaults of the options it "
      "reads (a = 1000)"),
    C("zero-to-a-negative-power", upd("S + 0 ** (0 - 1) * k * v"), 5, 18,
      "'0 ** (0 - 1)' divides by zero (0 to a negative power)"),
    C("zero-to-a-varying-power", upd("S + 0 ** (q @ k) * k * v"), 5, 18,
      "a power of 0 takes a plain number as its exponent"),
    C("log-of-zero", upd("log(0) * S + k * v"), 5, 14, "'log(0)' is minus infinity (the log of 0)"),
    C("sqrt-of-negative", out("q @ S * sqrt(0 - 1)"), 6, 22,
      "'sqrt(0 - 1)' is not a real number (the square root of a negative number)"),
    C("tower-of-powers", upd("S + 10 ** 10 ** 10 * k * v"), 5, 18,
      "'10 ** 10 ** 10' is too large for a float"),
    C("fractional-power-of-negative", upd("S + (0 - 8) ** (1/3) * k * v"), 5, 18, "is not a real number"),

    # ---- flags ----------------------------------------------------------------------
    C("if-on-number-option", HEAD + "  option scale = 1\n  update S = if scale then S else S + k * v\n"
      + GOOD_OUTPUT, 6, 17, "'scale' after 'if' must be a flag declared as `option scale = false`, but it is "
                            "a number option"),
    C("if-on-input", out("if q then q @ S else q @ S"), 6, 17, "but it is not an option"),
    C("flag-as-number", HEAD + "  option f = true\n  update S = S + f * k * v\n" + GOOD_OUTPUT, 6, 18,
      "'f' is a flag (true/false); use it as `if f then a else b`"),
    C("true-in-expression", upd("S + k * v + true"), 5, 26,
      "true and false may only be the default of an option (`option flag = false`)"),

    # ---- rename ---------------------------------------------------------------------
    C("rename-dim-not-in-value", HEAD.replace("K, V", "K, V, J = K", 1) + GOOD_UPDATE
      + "  output o = q @ S + sum(rename(v, K -> J), J)\n", 6, 36, "rename() of dim K, but the value has shape [V]"),
    C("rename-sizes-differ", out("q @ S + sum(rename(k, K -> V), V)"), 6, 41,
      "rename() from K to V: the dims must have the same size; declare `dims V = K`"),
    C("rename-to-present-dim", HEAD.replace("K, V", "K, V, J = K", 1) + GOOD_UPDATE
      + "  output o = sum(rename(k * rename(k, K -> J), K -> J), J) * (q @ S)\n", 6, 53,
      "rename() to dim J, which the value already has"),
    C("rename-without-map", out("q @ S + sum(rename(k, K), K)"), 6, 26,
      "rename() takes a value and dim maps, e.g. rename(q, K -> J)"),
    C("dim-map-outside-rename", out("q @ S + sum(K -> V, V)"), 6, 26,
      "'A -> B' may only appear as an argument of rename(x, A -> B)"),

    # ---- limits ---------------------------------------------------------------------
    C("too-deep-calls", out("q @ S + " + "exp(" * 65 + "1" + ")" * 65), 6, 274,
      "expression is nested too deeply (more than 64 levels of operators and calls"),
    C("too-deep-negation", out("q @ S + " + "-" * 66 + "1"), 6, 85, "expression is nested too deeply"),
    C("too-long-chain", out(" + ".join(["q @ S"] + ["1"] * 64)), 6, 14, "a chain a + b + c + ... adds a level"),
    C("too-long-spec", after("# " + "x" * 100_000), None, None,
      "spec is too long (100112 characters; the limit is 100000)"),
    C("too-long-name", after("let " + "a" * 65 + " = 1"), 7, 7, "name is too long (65 characters; the limit is 64)"),
    C("too-long-name-in-expression", out("q @ S + " + "b" * 70), 6, 22, "name is too long (70 characters"),
    C("too-many-declarations", after(*[f"let a{i} = {i}" for i in range(60)]), 64, 7,
      "too many declarations (the limit is 64)"),
    C("number-out-of-range", out("q @ S + 1e999"), 6, 22, "number '1e999' is out of range"),

    # ---- the derivation (mixc.derive) -----------------------------------------------
    C("update-quadratic", upd("S * S"), 5, 14, "the update of S is not linear in S: found S * S"),
    C("update-exp-of-state", upd("exp(S) + k * v"), 5, 14,
      "the update of S is not linear in S: applies exp() to the state: exp(S)"),
    C("update-power-of-state", upd("S ** 2 + k * v"), 5, 14, "the update of S is not linear in S: raises to a power"),
    C("update-divides-by-state", upd("k / S"), 5, 14, "the update of S is not linear in S: divides by the state"),
    C("update-max-of-state", upd("max(S, K) + k * v"), 5, 14, "applies max() to the state: max(S, K)"),
    C("update-state-times-projection", upd("S * (k @ S) + k * v"), 5, 14,
      "the update of S is not linear in S: found S * (k @ S)"),
    C("update-projection-times-projection", upd("(k @ S) * (k @ (k * (k @ S))) + k * v"), 5, 14,
      "the update of S is not linear in S: found (k @ S) * (k @ (k * (k @ S)))"),
    # linear (k @ (k * (k @ S)) is distributed: tests/derive/test_compound_updates.py), but the
    # factor (k * v + 1) is over the inner sum's K and the outer sum's V at once
    C("update-projects-twice-inseparable", upd("sum((k * v + 1) * (k @ S), V) * v + k * v"), 5, 14,
      "the update of S is linear in S, but mixc cannot put it in its normal form: projects the state twice over K"),
    C("update-not-reading-state", upd("k * v"), 5, 14,
      "the update of S does not read S: a state carries over from one token to the next"),
    C("update-not-reading-state-under-flag", HEAD + "  option f = false\n  update S = if f then S + k * v else k * v\n"
      + GOOD_OUTPUT, 6, 39, "the update of S does not read S"),
    C("update-times-zero", upd("0 * S + k * v"), 5, 14, "the update of S multiplies the state by 0"),
    C("update-cancels-state", upd("S - S + k * v"), 5, 14, "the update of S multiplies the state by 0"),
]

assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"


def first_error(text: str) -> mixc.SpecError:
    """Parse and derive; the SpecError raised (anything else fails the test)."""
    with pytest.raises(mixc.SpecError) as info:
        derive(mixc.parse(text, "bad.mix"))
    return info.value


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error(case: Case):
    err = first_error(case.text)
    rendered = str(err)
    assert case.words in err.message, rendered
    assert (err.line, err.column) == (case.line, case.column), rendered
    assert err.filename == "bad.mix"
    assert not internal_words(rendered), rendered
    if case.line is None:
        assert rendered.startswith(f"error: {err.message}")
        assert "--> bad.mix" in rendered
        return
    head, bar, shown, caret, *notes = rendered.split("\n")
    assert head == f"bad.mix:{case.line}:{case.column}: error: {err.message}"
    gutter = f"{case.line} | "
    source_line = case.text.split("\n")[case.line - 1]
    if source_line.isascii() and source_line.isprintable() and len(source_line) <= errors.SHOWN_LINE_MAX:
        assert shown == gutter + source_line
        assert caret.index("^") == len(gutter) + case.column - 1, rendered
    assert all(n.startswith("note: ") for n in notes)


# ---- rendering: the caret stays under the right character --------------------------------

def _caret_and_line(err: mixc.SpecError) -> tuple[str, str]:
    _, _, shown, caret, *_ = str(err).split("\n")
    return shown, caret


def test_caret_after_tab():
    err = first_error(HEAD + "\tupdate S = S + kk * v\n" + GOOD_OUTPUT)
    shown, caret = _caret_and_line(err)
    assert (err.line, err.column) == (5, 17)
    assert shown.index("kk") == caret.index("^")      # the tab is shown as one space


def test_caret_after_wide_characters():
    err = first_error(spec("mixer m", "  dims K", "  input 中[K]"))
    shown, caret = _caret_and_line(err)
    assert caret.index("^") == shown.index("中")


def test_caret_under_wide_character_after_another():
    err = first_error(spec("mixer m", "  dims K", "  input a中中[K]"))
    shown, caret = _caret_and_line(err)
    assert err.column == 10
    # '中' takes two terminal cells: the caret is after 'a' and nothing else.
    assert caret.index("^") - shown.index("a") == 1


def test_invisible_characters_are_shown_as_question_marks():
    err = first_error(out("q @ S +\u200b k"))
    shown, caret = _caret_and_line(err)
    assert "\u200b" not in shown and shown[caret.index("^")] == "?"


def test_form_feed_does_not_shift_lines():
    # The parser counts lines by '\n' only; the echoed line must be that same line.
    err = first_error("mixer m\n  dims K \x0c\n  input q[K]\n  let a = qq\n")
    assert err.line == 4
    assert "let a = qq" in str(err)


def test_crlf_line_endings():
    err = first_error(upd("S + kk * v").replace("\n", "\r\n"))
    assert (err.line, err.column) == (5, 18)
    shown, caret = _caret_and_line(err)
    assert "\r" not in shown and shown.endswith("kk * v")


def test_notes_are_rendered():
    err = first_error(spec("mixer m", "  dims K", "  input q[KK]"))
    assert err.notes == ("declare it with: dims K, KK",)
    assert str(err).endswith("note: declare it with: dims K, KK")


def test_error_without_source():
    err = mixc.SpecError("no library spec named 'x'")
    assert str(err) == "error: no library spec named 'x'"
    assert (err.filename, err.line, err.column) == (None, None, None)


def test_filename_is_reported():
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(upd("S + kk"), "specs/my mixer.mix")
    assert str(info.value).startswith("specs/my mixer.mix:5:18: error: unknown name 'kk'")


def test_library_spec_names_in_errors():
    from mixc.dsl import load_ir
    with pytest.raises(mixc.SpecError, match=r"no library spec named 'glaa' \(did you mean 'gla'\?\)"):
        load_ir("glaa")


def test_limits_are_the_documented_ones():
    assert (dsl_parser.MAX_DEPTH, dsl_parser.MAX_NAME, dsl_parser.MAX_SPEC_CHARS) == (64, 64, 100_000)


def test_coupled_update_size_limit_is_exact():
    """Each update reads the one before twice: the written-out updates double in size; the
    first past 1,024 operations is refused at its place (and the one before derives)."""
    import importlib
    assert importlib.import_module("mixc.dsl.check").MAX_UPDATE_SIZE == 1024

    def chain(n):
        lines = ["mixer m", "  dims K, V", "  input q[K], k[K], v[V]",
                 "  state " + ", ".join(f"s{i}[K, V]" for i in range(n)), "  update s0 = s0 + k * v"]
        lines += [f"  update s{i} = s{i} + s{i - 1} + s{i - 1}" for i in range(1, n)]
        return "\n".join(lines + [f"  output o = q @ s{n - 1}"]) + "\n"
    derive(mixc.parse(chain(8)))                        # s7: 1,021 operations
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(chain(9), "bad.mix")
    assert (info.value.line, info.value.column) == (13, 15)
    assert "the update of s8 is 2045 operations with the new values of the states it reads written out" \
        in info.value.message


def test_depth_limit_is_exact():
    ok = out("q @ S + " + "tanh(" * 63 + "1" + ")" * 63)    # 64 levels with the outer + (63 exps overflow)
    derive(mixc.parse(ok))
    err = first_error(out("q @ S + " + "exp(" * 64 + "1" + ")" * 64))
    assert "nested too deeply" in err.message


def test_deep_parentheses_are_not_nesting():
    derive(mixc.parse(out("q @ S + " + "(" * 500 + "1" + ")" * 500)))


def test_name_limit_is_exact():
    derive(mixc.parse(after("let " + "a" * 64 + " = 1")))


# ---- long lines and byte-order marks -----------------------------------------------------

@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_long_line_is_shown_around_the_error(where):
    # A 10,000-character line would make a 10,000-cell report; the report shows the part of
    # the line around the error, with '...' where it is cut, and the caret still under it.
    pad = {"start": (0, 5000), "middle": (2500, 2500), "end": (5000, 0)}[where]
    line = "  input " + " " * pad[0] + "q[KK]" + ("  # " + "x" * pad[1] if pad[1] else "")
    err = first_error(spec("mixer m", "  dims K", line))
    shown, caret = _caret_and_line(err)
    assert err.column == line.index("KK") + 1
    assert len(shown) <= 130 and len(caret) <= 130
    assert shown[caret.index("^"):].startswith("KK]")
    assert shown.startswith("3 | ...") == (where != "start")
    assert shown.endswith("...") == (where != "end")


def test_a_long_underline_is_cut():
    err = first_error(spec("mixer m", "  dims K", "  input " + "x" * 10_000 + "[K]"))
    shown, caret = _caret_and_line(err)
    assert err.message == "name is too long (10000 characters; the limit is 64)"
    assert len(caret) <= 130 and caret.split("| ")[1].strip().startswith("^~~")
    assert shown[caret.index("^")] == "x"


def test_a_byte_order_mark_is_not_part_of_the_spec(tmp_path):
    # Windows editors start a UTF-8 file with U+FEFF; columns count from after it.
    text = spec("mixer m", "  dims K, V", "  input q[K], k[K], v[V]", "  state S[K, V]",
                "  update S = S + k * v", "  output o = q @ S")
    path = tmp_path / "bom.mix"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert mixc.load(path).ir == mixc.parse(text)
    assert mixc.parse("\ufeff" + text).name == "m"
    err = first_error("\ufeff" + text.replace("q @ S", "qq @ S"))
    assert (err.line, err.column) == (6, 14)
    err = first_error("\ufeff" + text.replace("mixer m", "mixer 1m"))
    assert (err.line, err.column) == (1, 7)


def test_a_huge_spec_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """The length limit applies to the file's size first: a 200 MB spec was read whole (470 MB
    RSS) before the 100,000-character limit refused it (issue 30)."""
    from pathlib import Path

    from mixc.dsl import read_spec
    path = tmp_path / "huge.mix"
    with open(path, "wb") as f:
        f.truncate(200 * 2 ** 20)                     # a sparse 200 MB file
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("the file was read"))
    with pytest.raises(mixc.SpecError, match=r"too long \(209715200 bytes; the limit is 100000 characters\)"):
        read_spec(path)


def test_prev_of_an_input_is_a_derived_input_and_round_trips():
    """prev(x) of an input: a derived input prev_x the op computes (MixerIR.shifted), not one a
    caller passes; the checked spec prints it as prev(x) and parses back to the same IR."""
    from mixc.dsl.unparse import spec_text
    m = mixc.parse(HEAD.replace("v[V]", "v[V], lam[] in (0, 1)") + "  let    a = sigmoid(sum(prev(q), K))\n"
                   "  update S = S + a * prev(k) * prev(v) + k * v\n" + "  output o = q @ S + lam * prev(lam) * v\n",
                   "prev.mix")
    assert [(s.name, s.source) for s in m.shifted] == [("prev_q", "q"), ("prev_k", "k"), ("prev_v", "v"),
                                                       ("prev_lam", "lam")]
    assert [d.name for d in m.given_inputs] == ["q", "k", "v", "lam"]
    assert m.input("prev_lam").range.text() == "[0, 1)"          # (0, 1) widened to take the 0 of a start
    text = spec_text(m)
    assert "prev_" not in text and "prev(k) * prev(v)" in text
    assert mixc.parse(text, "again.mix") == m

"""What the spec language accepts, and the IR it builds: shapes inferred by dim name,
precedence, comments, options and flags, several states."""
from __future__ import annotations

import pytest

import mixc
from mixc.derive.plan import derive
from mixc.dsl import ir, library_names, load_ir, read_spec


def sexpr(e: ir.Expr) -> str:
    """A compact structural form of an IR expression: (op args...)."""
    if isinstance(e, ir.Num):
        return f"{e.value:g}"
    if isinstance(e, ir.Ref):
        return e.name
    if isinstance(e, ir.Prev):
        return f"(prev {e.state})"
    if isinstance(e, ir.Neg):
        return f"(neg {sexpr(e.x)})"
    if isinstance(e, ir.BinOp):
        return f"({e.op} {sexpr(e.left)} {sexpr(e.right)})"
    if isinstance(e, ir.Contract):
        return f"(@{''.join(e.over)} {sexpr(e.left)} {sexpr(e.right)})"
    if isinstance(e, ir.Call):
        return f"({e.fn} {' '.join(sexpr(a) for a in e.args)})"
    if isinstance(e, ir.Reduce):
        return f"({e.fn}{''.join(e.over)} {sexpr(e.x)})"
    if isinstance(e, ir.Rename):
        return f"(rename {sexpr(e.x)} {' '.join(a + '->' + b for a, b in e.mapping)})"
    if isinstance(e, ir.Cond):
        return f"(if {e.flag} {sexpr(e.then)} {sexpr(e.otherwise)})"
    raise AssertionError(type(e))


HEAD = """mixer t
  dims   K, V, J = K
  input  q[K], k[K], v[V], g[], x[K], w[K]
  param  A[], P[K, V]
  option f = false, scale = K ** -0.5
  state  S[K, V]
"""


def let(expr: str) -> ir.Expr:
    """The IR of `let a = <expr>` in a spec with dims K, V, J = K (lets cannot read states)."""
    m = mixc.parse(HEAD + f"  let a = {expr}\n  update S = S + k * v\n  output o = q @ S\n")
    return m.let("a").expr


def output(expr: str) -> ir.Expr:
    """The IR of `output o = <expr>` (which may read the state S)."""
    m = mixc.parse(HEAD + f"  update S = S + k * v\n  output o = {expr}\n")
    return m.output.expr


# ---- the library ------------------------------------------------------------------------

@pytest.mark.parametrize("name", library_names())
def test_library_spec_parses_and_derives(name):
    src = read_spec(name)
    m = mixc.parse(src.text, src.filename)
    assert m.name == name
    assert [u.state for u in m.updates] == [s.name for s in m.states]
    for u in m.updates:
        assert set(u.expr.shape) == set(m.state(u.state).shape)
    plan = derive(m)
    assert plan.name == name
    for flag in m.flags:
        derive(m, {flag.name: not flag.default})


def test_library_is_complete():
    assert {"gla", "mamba2", "rwkv6", "delta_rule", "retention", "based"} <= set(library_names())
    assert load_ir("gla") == load_ir("gla")       # equal IRs (spans do not take part)


# ---- shapes by dim name -------------------------------------------------------------------

@pytest.mark.parametrize("expr, shape", [
    ("k * v", ("K", "V")),
    ("v * k", ("K", "V")),                 # the order of `dims`, whatever the order written
    ("g * k", ("K",)),                     # a scalar broadcasts
    ("k + x", ("K",)),
    ("P * g", ("K", "V")),
    ("k @ x", ()),                         # @ sums the shared dims
    ("P @ k", ("V",)),
    ("(k * v) @ P", ()),                   # ... all of them
    ("sum(k * v, K)", ("V",)),
    ("sum(P, K, V)", ()),
    ("norm(k, K)", ()),
    ("max(k, x)", ("K",)),                 # two values: elementwise
    ("min(k, g)", ("K",)),
    ("max(k, K)", ()),                     # a value and a dim: a reduction
    ("min(P, V)", ("K",)),
    ("rename(k, K -> J)", ("J",)),
    ("k * rename(x, K -> J)", ("K", "J")),
    ("exp(k) * sigmoid(v)", ("K", "V")),
    ("K ** -0.5", ()),                     # a dim is its size
    ("head * 2", ()),
    ("scale", ()),
    ("if f then k else x", ("K",)),
])
def test_shape_inference(expr, shape):
    assert let(expr).shape == shape


def test_shape_of_state_reads():
    assert output("q @ S").shape == ("V",)
    assert output("S @ v").shape == ("K",)
    assert output("sum(S, K)").shape == ("V",)
    assert output("q @ prev(S)").shape == ("V",)
    assert output("sum(q * k, K) * v + q @ S").shape == ("V",)


def test_contraction_records_the_summed_dims():
    e = output("(k * v) @ S")
    assert isinstance(e, ir.Contract) and e.over == ("K", "V") and e.shape == ()


def test_max_two_forms():
    assert sexpr(let("max(k, x)")) == "(max k x)"
    assert sexpr(let("max(k, K)")) == "(maxK k)"
    assert sexpr(let("max(P, K, V)")) == "(maxKV P)"
    assert sexpr(let("min(k, 0)")) == "(min k 0)"


def test_rename_and_alias():
    m = mixc.parse(HEAD + "  update S = S + k * v\n  output o = q @ S\n")
    assert m.dim("J").alias_of == "K" and m.root_dim("J") == "K"
    assert sexpr(let("rename(k, K -> J)")) == "(rename k K->J)"


# ---- precedence -------------------------------------------------------------------------

@pytest.mark.parametrize("expr, tree", [
    ("-x ** 2", "(neg (** x 2))"),          # as in Python
    ("x ** -1", "(** x (neg 1))"),
    ("2 ** 3 ** 2", "(** 2 (** 3 2))"),     # right-associative
    ("k - x - w", "(- (- k x) w)"),         # left-associative
    ("k / x / w", "(/ (/ k x) w)"),
    ("k + x * w", "(+ k (* x w))"),
    ("(k + x) * w", "(* (+ k x) w)"),
    ("k * x @ w", "(@K (* k x) w)"),        # * / @ share a level, left to right
    ("k @ x * w", "(* (@K k x) w)"),
    ("-k * x", "(* (neg k) x)"),
    ("--k", "(neg (neg k))"),
    ("exp(-k) ** 2", "(** (exp (neg k)) 2)"),
    ("if f then k else x + w", "(if f k (+ x w))"),   # if-then-else is loosest
    ("1 + (if f then k else x)", "(+ 1 (if f k x))"),
])
def test_precedence(expr, tree):
    assert sexpr(let(expr)) == tree


@pytest.mark.parametrize("text, value", [("1", 1.0), ("2.", 2.0), (".5", 0.5), ("1e-6", 1e-6), ("2.5E+3", 2500.0)])
def test_numbers(text, value):
    e = let(text)
    assert isinstance(e, ir.Num) and e.value == value


# ---- layout: comments, lines, whitespace ---------------------------------------------------

def test_comments_and_multiline_expressions():
    text = """# a comment before the mixer
mixer t   # after the name
  dims K, V
  input q[K],
        k[K],   # a declaration over lines
        v[V]
  # a whole-line comment
  state S[K, V]
  update S = S
             + k * v   # continues the expression
  output o = (q
              @ S)
"""
    m = mixc.parse(text)
    assert [x.name for x in m.inputs] == ["q", "k", "v"]
    assert sexpr(m.update("S").expr) == "(+ S (* k v))"
    assert m.update("S").expr.span.line == 9
    assert sexpr(m.output.expr) == "(@K q S)"


def test_whitespace_tabs_crlf_and_several_statements_on_a_line():
    text = "mixer t\r\n\tdims K, V input q[K], k[K], v[V]\r\n\tstate S[K, V] update S = S + k * v output o = q @ S"
    m = mixc.parse(text)
    assert m.name == "t" and [s.name for s in m.states] == ["S"]


def test_names_may_contain_keywords():
    text = """mixer inputs
  dims K, V
  input iff[K], letter[K], state2[V], output_gate[]
  state S[K, V]
  update S = S + iff * state2 * output_gate
  output o = letter @ S
"""
    m = mixc.parse(text)
    assert [x.name for x in m.inputs] == ["iff", "letter", "state2", "output_gate"]


def test_names_up_to_the_limit():
    name = "a" * 64
    m = mixc.parse(HEAD + f"  let {name} = k\n  update S = S + {name} * v\n  output o = q @ S\n")
    assert m.let(name).expr.shape == ("K",)


# ---- options and flags ---------------------------------------------------------------------

def test_options_numbers_and_flags():
    m = mixc.parse("""mixer t
  dims K, V
  input q[K], k[K], v[V]
  option scale = K ** -0.5, eps = 1e-6, twice = 2 * eps, use_norm = true, gate = false
  state S[K, V]
  update S = S + k * v
  output o = if use_norm then (q * scale) @ S / (twice + 1) else q @ S
""")
    by = {o.name: o for o in m.options}
    assert by["scale"].kind == "float" and sexpr(by["scale"].default) == "(** K (neg 0.5))"
    assert by["twice"].kind == "float" and sexpr(by["twice"].default) == "(* 2 eps)"
    assert (by["use_norm"].kind, by["use_norm"].default) == ("bool", True)
    assert (by["gate"].kind, by["gate"].default) == ("bool", False)
    assert [o.name for o in m.flags] == ["use_norm", "gate"]
    assert isinstance(m.output.expr, ir.Cond)
    # The flags select a branch when the spec is derived.
    assert derive(m).flags == (("gate", False), ("use_norm", True))
    assert derive(m, {"use_norm": False}).flags == (("gate", False), ("use_norm", False))


def test_option_refs_and_head():
    e = let("scale * head")
    assert {(r.name, r.kind) for r in ir.walk(e) if isinstance(r, ir.Ref)} == {("scale", "option"), ("head", "head")}


def test_unknown_flag_at_derive_time():
    m = load_ir("gla")
    with pytest.raises(mixc.SpecError, match=r"'nope' is not a flag of mixer 'gla' \(flags: none\)"):
        derive(m, {"nope": True})


# ---- states ------------------------------------------------------------------------------

def test_several_states_updates_in_state_order():
    m = mixc.parse("""mixer t
  dims K, V
  input q[K], k[K], v[V]
  state S[K, V], z[K]
  state n[]
  update n = n + 1
  update z = z + k
  update S = S + k * v
  output o = (q @ S) / (q @ z + n)
""")
    assert [s.name for s in m.states] == ["S", "z", "n"]
    assert [u.state for u in m.updates] == ["S", "z", "n"]
    assert m.state("n").shape == ()
    assert ir.refs(m.output.expr, "state") == {"S", "z", "n"}
    derive(m)


def test_state_in_update_and_prev():
    m = mixc.parse(HEAD + "  update S = exp(g) * prev(S) + k * v\n  output o = q @ prev(S) + q @ S\n")
    assert sexpr(m.update("S").expr) == "(+ (* (exp g) (prev S)) (* k v))"
    assert sexpr(m.output.expr) == "(+ (@K q (prev S)) (@K q S))"


def test_declarations_in_any_order_before_use():
    m = mixc.parse("""mixer t
  dims K
  dims V
  state S[K, V]
  input k[K], v[V]
  param u[K]
  let a = k * u
  update S = S + a * v
  input q[K]
  output o = q @ S
""")
    assert [x.name for x in m.inputs] == ["k", "v", "q"] and m.param("u").shape == ("K",)


def test_spans_point_at_the_text():
    text = HEAD + "  update S = S + k * v\n  output o = q @ S\n"
    m = mixc.parse(text, "t.mix")
    upd = m.update("S").expr
    line = text.split("\n")[upd.span.line - 1]
    assert line[upd.span.column - 1:upd.span.end_column - 1] == "S + k * v"
    assert m.source.filename == "t.mix"

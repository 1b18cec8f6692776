"""IR -> spec text (for dumps and explanations). Parenthesizes by precedence only."""
from __future__ import annotations

from . import ir

_PREC = {"if": 0, "+": 1, "-": 1, "*": 2, "/": 2, "@": 2, "neg": 3, "**": 4, "atom": 5}


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def expr_text(e: ir.Expr, shifted: dict[str, str] | None = None) -> str:
    """e as spec text; shifted maps a derived input (ir.Shifted: prev_x) to its input, printed as
    prev(x) as the spec wrote it."""
    return _text(e, shifted or {})[0]


def _text(e: ir.Expr, sh: dict[str, str]) -> tuple[str, int]:
    if isinstance(e, ir.Num):
        return (_num(e.value), _PREC["atom"]) if e.value >= 0 else (_num(e.value), _PREC["neg"])
    if isinstance(e, ir.Ref):
        return (f"prev({sh[e.name]})" if e.kind == "input" and e.name in sh else e.name), _PREC["atom"]
    if isinstance(e, ir.Prev):
        return f"prev({e.state})", _PREC["atom"]
    if isinstance(e, ir.Neg):
        s, p = _text(e.x, sh)
        return "-" + (s if p >= _PREC["neg"] else f"({s})"), _PREC["neg"]
    if isinstance(e, (ir.BinOp, ir.Contract)):
        op = "@" if isinstance(e, ir.Contract) else e.op
        prec = _PREC[op]
        ls, lp = _text(e.left, sh)
        rs, rp = _text(e.right, sh)
        if op == "**":      # right-associative
            left = ls if lp > prec else f"({ls})"
            right = rs if rp >= _PREC["neg"] else f"({rs})"
        else:               # left-associative
            left = ls if lp >= prec else f"({ls})"
            right = rs if rp > prec else f"({rs})"
        return f"{left} {op} {right}", prec
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(_text(a, sh)[0] for a in e.args)})", _PREC["atom"]
    if isinstance(e, ir.Reduce):
        return f"{e.fn}({_text(e.x, sh)[0]}, {', '.join(e.over)})", _PREC["atom"]
    if isinstance(e, ir.Rename):
        maps = ", ".join(f"{a} -> {b}" for a, b in e.mapping)
        return f"rename({_text(e.x, sh)[0]}, {maps})", _PREC["atom"]
    if isinstance(e, ir.Cond):
        return f"if {e.flag} then {_text(e.then, sh)[0]} else {_text(e.otherwise, sh)[0]}", _PREC["if"]
    if isinstance(e, ir.SeqOp):
        args = [_text(a, sh)[0] for a in e.args] + ([e.tap] if e.tap is not None else [])
        if e.window is not None:
            args.append(f"window={_text(e.window, sh)[0]}")
        if e.causal is not True:
            args.append(f"causal={str(e.causal).lower() if isinstance(e.causal, bool) else e.causal}")
        return f"{e.kind}({', '.join(args)})", _PREC["atom"]
    raise AssertionError(type(e))


def update_text(u: ir.Update, shifted: dict[str, str] | None = None) -> str:
    """An update as spec text: another state it reads is its previous value in the IR, written
    prev(X) (read again, a bare X would be X's new value where X's update comes first)."""
    def prev_others(e: ir.Expr) -> ir.Expr:
        if isinstance(e, ir.Ref) and e.kind == "state" and e.name != u.state:
            return ir.Prev(e.shape, e.span, e.name)
        kids = ir.children(e)
        return ir.with_children(e, [prev_others(k) for k in kids]) if kids else e
    return expr_text(prev_others(u.expr), shifted)


def _shape(s) -> str:
    return "[" + ", ".join(s) + "]"


def dim_text(d: ir.Dim) -> str:
    """K, J = K, or E = 2."""
    return d.name + (f" = {d.alias_of}" if d.alias_of else f" = {d.size}" if d.size is not None else "")


def decl_text(d: ir.TensorDecl) -> str:
    """x[K], or beta[] in (0, 2) with its declared range."""
    return d.name + _shape(d.shape) + (f" in {d.range.text()}" if d.range is not None else "")


def const_values_text(c: ir.Const, sizes: tuple[int, ...]) -> str:
    """A const's values as nested lists, one per dim (sizes: its dims' sizes): [[1, 0], [0, 1]];
    a scalar const's is its number."""
    groups = [_num(v) for v in c.values]
    for size in reversed(sizes):      # the innermost dim first: its runs of values become lists
        groups = ["[" + ", ".join(groups[i:i + size]) + "]" for i in range(0, len(groups), size)]
    return groups[0]


def spec_text(m: ir.MixerIR) -> str:
    """The checked spec, one declaration per line, with inferred shapes as comments."""
    out = [f"mixer {m.name}"]
    out.append("  dims   " + ", ".join(dim_text(d) for d in m.dims))
    sh = {x.name: x.source for x in m.shifted}
    for kw, decls in (("input", m.given_inputs), ("param", m.given_params)):
        if decls:
            out.append(f"  {kw:6} " + ", ".join(decl_text(d) for d in decls))
    for c in m.consts:
        out.append(f"  const  {c.name}{_shape(c.shape)} = "
                   + const_values_text(c, tuple(m.fixed_size(d) for d in c.shape)))
    for o in m.options:
        default = str(o.default).lower() if o.kind == "bool" else expr_text(o.default)
        out.append(f"  option {o.name} = {default}")
    for let in m.lets:
        out.append(f"  let    {let.name} = {expr_text(let.expr, sh)}    # {_shape(let.expr.shape)}")
    if m.states:
        out.append("  state  " + ", ".join(s.name + _shape(s.shape) for s in m.states))
    for u in m.updates:
        out.append(f"  update {u.state} = {update_text(u, sh)}")
    out.append(f"  output {m.output.name} = {expr_text(m.output.expr, sh)}    # {_shape(m.output.expr.shape)}")
    return "\n".join(out)

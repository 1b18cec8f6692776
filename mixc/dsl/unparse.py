"""IR -> spec text (for dumps and explanations). Parenthesizes by precedence only."""
from __future__ import annotations

from . import ir

_PREC = {"if": 0, "+": 1, "-": 1, "*": 2, "/": 2, "@": 2, "neg": 3, "**": 4, "atom": 5}


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def expr_text(e: ir.Expr) -> str:
    return _text(e)[0]


def _text(e: ir.Expr) -> tuple[str, int]:
    if isinstance(e, ir.Num):
        return (_num(e.value), _PREC["atom"]) if e.value >= 0 else (_num(e.value), _PREC["neg"])
    if isinstance(e, ir.Ref):
        return e.name, _PREC["atom"]
    if isinstance(e, ir.Prev):
        return f"prev({e.state})", _PREC["atom"]
    if isinstance(e, ir.Neg):
        s, p = _text(e.x)
        return "-" + (s if p >= _PREC["neg"] else f"({s})"), _PREC["neg"]
    if isinstance(e, (ir.BinOp, ir.Contract)):
        op = "@" if isinstance(e, ir.Contract) else e.op
        prec = _PREC[op]
        ls, lp = _text(e.left)
        rs, rp = _text(e.right)
        if op == "**":      # right-associative
            left = ls if lp > prec else f"({ls})"
            right = rs if rp >= _PREC["neg"] else f"({rs})"
        else:               # left-associative
            left = ls if lp >= prec else f"({ls})"
            right = rs if rp > prec else f"({rs})"
        return f"{left} {op} {right}", prec
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(expr_text(a) for a in e.args)})", _PREC["atom"]
    if isinstance(e, ir.Reduce):
        return f"{e.fn}({expr_text(e.x)}, {', '.join(e.over)})", _PREC["atom"]
    if isinstance(e, ir.Rename):
        maps = ", ".join(f"{a} -> {b}" for a, b in e.mapping)
        return f"rename({expr_text(e.x)}, {maps})", _PREC["atom"]
    if isinstance(e, ir.Cond):
        return f"if {e.flag} then {expr_text(e.then)} else {expr_text(e.otherwise)}", _PREC["if"]
    if isinstance(e, ir.SeqOp):
        args = [expr_text(a) for a in e.args] + ([e.tap] if e.tap is not None else [])
        if e.window is not None:
            args.append(f"window={expr_text(e.window)}")
        if e.causal is not True:
            args.append(f"causal={str(e.causal).lower() if isinstance(e.causal, bool) else e.causal}")
        return f"{e.kind}({', '.join(args)})", _PREC["atom"]
    raise AssertionError(type(e))


def update_text(u: ir.Update) -> str:
    """An update as spec text: another state it reads is its previous value in the IR, written
    prev(X) (read again, a bare X would be X's new value where X's update comes first)."""
    def prev_others(e: ir.Expr) -> ir.Expr:
        if isinstance(e, ir.Ref) and e.kind == "state" and e.name != u.state:
            return ir.Prev(e.shape, e.span, e.name)
        kids = ir.children(e)
        return ir.with_children(e, [prev_others(k) for k in kids]) if kids else e
    return expr_text(prev_others(u.expr))


def _shape(s) -> str:
    return "[" + ", ".join(s) + "]"


def dim_text(d: ir.Dim) -> str:
    """K, J = K, or E = 2."""
    return d.name + (f" = {d.alias_of}" if d.alias_of else f" = {d.size}" if d.size is not None else "")


def decl_text(d: ir.TensorDecl) -> str:
    """x[K], or beta[] in (0, 2) with its declared range."""
    return d.name + _shape(d.shape) + (f" in {d.range.text()}" if d.range is not None else "")


def spec_text(m: ir.MixerIR) -> str:
    """The checked spec, one declaration per line, with inferred shapes as comments."""
    out = [f"mixer {m.name}"]
    out.append("  dims   " + ", ".join(dim_text(d) for d in m.dims))
    for kw, decls in (("input", m.inputs), ("param", m.params)):
        if decls:
            out.append(f"  {kw:6} " + ", ".join(decl_text(d) for d in decls))
    for o in m.options:
        default = str(o.default).lower() if o.kind == "bool" else expr_text(o.default)
        out.append(f"  option {o.name} = {default}")
    for let in m.lets:
        out.append(f"  let    {let.name} = {expr_text(let.expr)}    # {_shape(let.expr.shape)}")
    if m.states:
        out.append("  state  " + ", ".join(s.name + _shape(s.shape) for s in m.states))
    for u in m.updates:
        out.append(f"  update {u.state} = {update_text(u)}")
    out.append(f"  output {m.output.name} = {expr_text(m.output.expr)}    # {_shape(m.output.expr.shape)}")
    return "\n".join(out)

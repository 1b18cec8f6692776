"""Functions over a dim: softmax, logsumexp, mean, layer_norm, rms_norm, l2norm of a value over
named dims, written out by the checker into the language's own nodes (exp, log, sqrt, sum and
max over dims, +, -, *, /), so that every later stage (the derivation, the float64 reference,
the torch backend, the Triton kernels and their adjoints) computes them, and their gradients,
with the rules it already has.

The forms are the numerically stable ones:

    softmax(x, K)     e / sum(e, K),  e = exp(x - max(x, K))
    logsumexp(x, K)   max(x, K) + log(sum(exp(x - max(x, K)), K))
    mean(x, K)        sum(x, K) / K
    layer_norm(x, K)  (x - mean(x, K)) / sqrt(mean((x - mean(x, K)) ** 2, K) + eps)    eps 1e-5
    rms_norm(x, K)    x / sqrt(mean(x * x, K) + eps)                                   eps 1e-5
    l2norm(x, K)      x / sqrt(sum(x * x, K) + eps)                                    eps 1e-6

The eps defaults are fla's (fla.modules.l2norm: 1e-6; its RMSNorm and LayerNorm: 1e-5, as
torch's layer_norm); `eps=` sets it. The max subtracted by softmax and logsumexp cancels in the
value and in the gradient (softmax is invariant to a shift; the two paths through the max of
logsumexp add to 0), so the backward carries it as any other max and its total is 0.

Every node takes the call's span: an error or warning about a written-out part points at the
call."""
from __future__ import annotations

from . import ir
from .parser import KwargNode

# name -> (default eps or None where the function takes none, what it reduces to)
DIM_FNS: dict[str, float | None] = {
    "softmax": None, "logsumexp": None, "mean": None,
    "layer_norm": 1e-5, "rms_norm": 1e-5, "l2norm": 1e-6,
}

# one line each, for docs/language.md (tests/dsl/test_dim_functions.py checks it names them)
DOCS = {
    "softmax": "exp(x) / sum(exp(x), K), with the max over K subtracted first; same shape as x",
    "logsumexp": "log(sum(exp(x), K)), with the max over K taken out; x's shape without K",
    "mean": "sum(x, K) / K; x's shape without K",
    "layer_norm": "(x - mean) / sqrt(var + eps), mean and (biased) variance over K; eps 1e-5",
    "rms_norm": "x / sqrt(mean(x * x, K) + eps); eps 1e-5",
    "l2norm": "x / sqrt(sum(x * x, K) + eps), as fla's l2norm; eps 1e-6",
}


def takes_eps(fn: str) -> bool:
    return DIM_FNS[fn] is not None


class _Build:
    """Nodes over the spec's dim order, all at one span."""

    def __init__(self, order: tuple[str, ...], span):
        self.order, self.span = order, span

    def shape(self, *shapes) -> ir.Shape:
        names = set().union(*map(set, shapes))
        return tuple(d for d in self.order if d in names)

    def bin(self, op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
        return ir.BinOp(self.shape(a.shape, b.shape), self.span, op, a, b)

    def call(self, fn: str, x: ir.Expr) -> ir.Expr:
        return ir.Call(x.shape, self.span, fn, (x,))

    def reduce(self, fn: str, x: ir.Expr, over: ir.Shape) -> ir.Expr:
        return ir.Reduce(tuple(d for d in x.shape if d not in over), self.span, fn, x, over)

    def size(self, over: ir.Shape) -> ir.Expr:
        """The number of elements over `over`: the product of the dims' sizes."""
        out = ir.Ref((), self.span, over[0], "dim")
        for d in over[1:]:
            out = self.bin("*", out, ir.Ref((), self.span, d, "dim"))
        return out

    def mean(self, x: ir.Expr, over: ir.Shape) -> ir.Expr:
        return self.bin("/", self.reduce("sum", x, over), self.size(over))


def lower(fn: str, x: ir.Expr, over: ir.Shape, eps: ir.Expr | None, order: tuple[str, ...], span) -> ir.Expr:
    """fn(x, *over) written out; `over` in the spec's dim order, each a dim of x; eps a scalar
    (the default where None and fn takes one)."""
    b = _Build(order, span)
    if takes_eps(fn) and eps is None:
        eps = ir.Num((), span, DIM_FNS[fn])
    if fn in ("softmax", "logsumexp"):
        top = b.reduce("max", x, over)
        e = b.call("exp", b.bin("-", x, top))
        total = b.reduce("sum", e, over)
        if fn == "softmax":
            return b.bin("/", e, total)
        return b.bin("+", top, b.call("log", total))
    if fn == "mean":
        return b.mean(x, over)
    if fn == "layer_norm":
        centred = b.bin("-", x, b.mean(x, over))
        var = b.mean(b.bin("*", centred, centred), over)
        return b.bin("/", centred, b.call("sqrt", b.bin("+", var, eps)))
    if fn == "rms_norm":
        return b.bin("/", x, b.call("sqrt", b.bin("+", b.mean(b.bin("*", x, x), over), eps)))
    if fn == "l2norm":
        return b.bin("/", x, b.call("sqrt", b.bin("+", b.reduce("sum", b.bin("*", x, x), over), eps)))
    raise AssertionError(fn)


def check_call(ex, n) -> ir.Expr:
    """The checker's rules for a call fn(x, K, ..., eps=...) (ex: check.py's expression checker,
    n its CallNode), then the call written out. Each misuse is an error at its argument."""
    fn = n.fn
    eps_hint = ", eps=1e-6" if takes_eps(fn) else ""
    positional = [a for a in n.args if not isinstance(a, KwargNode)]
    kwargs = [a for a in n.args if isinstance(a, KwargNode)]
    for a in kwargs:
        if not takes_eps(fn) or a.name != "eps":
            takes = "only 'eps=' by name" if takes_eps(fn) else "no argument by name"
            raise ex.err(f"{fn}() takes {takes}, not '{a.name}='", a.span)
    if len(kwargs) > 1:
        raise ex.err(f"{fn}() takes 'eps=' once", kwargs[1].span)
    if kwargs and n.args[-1] is not kwargs[0]:
        raise ex.err(f"{fn}(): 'eps=' comes after the value and its dims, e.g. {fn}(x, K{eps_hint})", kwargs[0].span)
    if len(positional) < 2:
        raise ex.err(f"{fn}() takes a value and the dims it works over, e.g. {fn}(x, K{eps_hint}); "
                     f"got {len(positional)} argument{'s' if len(positional) != 1 else ''}", n.span)
    x = ex.check(positional[0])
    over = ex.dims_of(fn, x, positional[1:], "works over dims")
    eps = None
    if kwargs:
        eps = ex.check(kwargs[0].value)
        if eps.shape:
            raise ex.err(f"{fn}()'s eps must be a scalar, but it has shape [{', '.join(eps.shape)}]",
                         kwargs[0].value.span)
    return lower(fn, x, over, eps, ex.order, n.span)

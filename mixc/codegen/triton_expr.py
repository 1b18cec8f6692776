"""IR expressions -> kernel IR statements (codegen/kir) over named-dim blocks.

Every value in a kernel is a block whose axes are its dims in the spec's `dims` order (a
scalar is a 0-d value). Broadcasting by name is indexing with None; `@`, sum and norm
multiply and tl.sum over axes. Padded lanes (dim sizes below the block size) are zeroed
before every reduction, so nothing from them reaches a real lane.

Identifiers: generated temporaries start with '_' (a spec name never does) and every spec
name is used only behind a fixed prefix (v_q, p_q ...), so no spec text can shadow or inject
anything; names were validated as plain identifiers by the checker.

The Emitter builds kir Lets (`stmts`); its callers still speak (variable, dims) pairs, and
`lines` is the Lets printed by kir's printer, each with its shape comment (the chunked
kernels' ast passes cut their text by statement lines, so a comment goes with its line). codegen/recurrent_ir.py takes `stmts` themselves.
"""
from __future__ import annotations

import math

import re

from ..dsl import ir, scalar
from ..dsl.functions import FUNCTIONS
from .kir import nodes as K
from .kir import printer
from .kir.dtypes import dtype_of


def canon(order: tuple[str, ...], dims) -> tuple[str, ...]:
    return tuple(d for d in order if d in set(dims))


def expand(var: str, have: tuple[str, ...], want: tuple[str, ...]) -> str:
    """Index var (axes `have`, in canonical order) to broadcast against axes `want`."""
    if have == want or not have:
        return var
    return f"{var}[{', '.join(':' if d in have else 'None' for d in want)}]"


# integer powers beyond this many are taken as exp(p log |a|) with a's sign: by squaring they
# would cost 2 log2(p) multiplications, and their values over- or underflow past it anyway
MAX_MULTIPLIED_POWER = 64


def constant_exponent(e: ir.Expr) -> float | None:
    """The value of an exponent made of numbers only (`-1` is Neg(Num 1), `1/16` a BinOp),
    None when it reads anything known only at run time (a dim, an option, an input)."""
    try:
        return scalar.evaluate(e)
    except (scalar.NotConstant, scalar.ScalarError):
        return None


def number(v: float) -> str:
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"cannot print {v}")
    return repr(float(v))


Var = tuple[str, tuple[str, ...]]
_NUMBER = re.compile(r"-?[0-9][0-9.e+-]*$")
FILLS = {"0.0": 0.0, "float('-inf')": float("-inf"), "float('inf')": float("inf")}


def leaf(var: str, dims) -> K.Expr:
    """The IR of a variable named in text: a number, a name, else text (the adapter's)."""
    if _NUMBER.match(var):
        return K.Num(float(var))
    if var.isidentifier():
        return K.Name(var, tuple(dims))
    return K.Raw(var, tuple(dims))


def mask_expr(dims: tuple[str, ...]) -> K.Expr:
    """The validity mask of a block with these axes: each dim's _mask_<d>, broadcast, and-ed."""
    parts = [K.Broadcast(K.Name(f"_mask_{d}", (d,)), tuple(dims)) for d in dims]
    out = parts[0]
    for p in parts[1:]:
        out = K.BinOp("&", out, p)
    return out


class Emitter:
    """Build the kir statements computing IR expressions. `env` maps a spec name (and
    'prev S' for prev(S)) to (variable, dims) already available in the kernel. `values`:
    the IR of variables handed out that are no Let of their own (a renamed view), shared by
    the emitters of one kernel."""

    def __init__(self, mixer: ir.MixerIR, env: dict[str, Var], indent: str = "    ",
                 prefix: str = "_e", order: tuple[str, ...] | None = None, values: dict | None = None):
        self.m = mixer
        # the axes of blocks, outermost first; chunked kernels put the token axis "_T" first
        self.order = order or mixer.dim_names
        self.env = dict(env)
        self.stmts: list[K.Let] = []
        self.lines: list[str] = []
        self.cache: dict[ir.Expr, Var] = {}
        self.values: dict[Var, K.Expr] = {} if values is None else values
        self.dtypes: dict[str, str] = {}
        self.indent = indent
        self.prefix = prefix
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n}"

    def value(self, var: str, dims) -> K.Expr:
        """The IR of a variable of this kernel."""
        dims = tuple(dims)
        return self.values.get((var, dims)) or leaf(var, dims)

    def bcast(self, var: str, have, want) -> K.Expr:
        """var (axes `have`, canonical order) broadcast by name to the axes `want`."""
        x = self.value(var, have)
        return x if not have or tuple(have) == tuple(want) else K.Broadcast(x, tuple(want))

    def emit(self, code: str | K.Expr, dims) -> Var:
        """A Let of a new temporary: code an IR expression (or, from the adapter's callers, text)."""
        dims = tuple(dims)
        value = code if isinstance(code, K.Expr) else K.Raw(code, dims)
        name = self.fresh()
        # a comparison (the run-time power's `b odd`, the adjoint's max/min pick) is i1; a name
        # from outside, a spec value, float32
        dtype = dtype_of(value, lambda x: self.dtypes.get(x, "f32")) or "f32"
        self.dtypes[name] = dtype
        let = K.Let(name, value, dims, dtype)
        self.stmts.append(let)
        self.lines.extend(printer.stmt(let, self.indent))      # with its shape comment
        return name, dims

    def mask(self, dims: tuple[str, ...]) -> str:
        """The validity mask of a block with these axes (text, for the chunked kernels)."""
        return printer.expr(mask_expr(dims))

    def masked(self, x: K.Expr, dims, over, fill: float = 0.0) -> K.Expr:
        """x with padded lanes set to fill (before a reduction over `over`)."""
        if not over:
            return x
        return K.Call("tl.where", (mask_expr(tuple(dims)), x, K.Num(fill)))

    def reduce_expr(self, x: K.Expr, dims, over, fn: str = "tl.sum", fill: float = 0.0) -> Var:
        code = self.masked(x, dims, over, fill)
        remaining = list(dims)
        for d in sorted(over, key=lambda x: -remaining.index(x)):     # last axis first
            code = K.Reduce(fn, code, d)
            remaining.remove(d)
        return self.emit(code, tuple(remaining))

    def reduce(self, var: str, dims: tuple[str, ...], over: tuple[str, ...], fn: str = "tl.sum",
               fill: str = "0.0") -> Var:
        return self.reduce_expr(self.value(var, dims), dims, over, fn, FILLS[fill])

    def __call__(self, e: ir.Expr) -> Var:
        if e in self.cache:
            return self.cache[e]
        out = getattr(self, "x_" + type(e).__name__)(e)
        self.cache[e] = out
        return out

    def ir(self, e: ir.Expr) -> K.Expr:
        """The IR of an expression's value (emitting what it needs)."""
        return self.value(*self(e))

    # leaves
    def x_Num(self, e: ir.Num):
        return number(e.value), ()

    def x_Ref(self, e: ir.Ref):
        if e.kind == "dim":
            return f"_fsize_{e.name}", ()           # a float kernel argument
        if e.kind == "head":
            return "_fhead", ()
        if e.kind == "let" and e.name not in self.env:
            self.env[e.name] = self(self.m.let(e.name).expr)
        return self.env[e.name]

    def x_Prev(self, e: ir.Prev):
        return self.env["prev " + e.state]

    def x_Neg(self, e: ir.Neg):
        v, d = self(e.x)
        return self.emit(K.Neg(self.value(v, d)), d)

    def x_BinOp(self, e: ir.BinOp):
        if e.op == "**":
            return self.power(e)
        (a, da), (b, db) = self(e.left), self(e.right)
        out = canon(self.order, set(da) | set(db))
        return self.emit(K.BinOp(e.op, self.bcast(a, da, out), self.bcast(b, db, out)), out)

    def power(self, e: ir.BinOp):
        a, da = self(e.left)
        A = self.value(a, da)
        p = constant_exponent(e.right)
        if p is not None:
            if p == int(p):
                return self.int_power(a, da, int(p))
            if p == 0.5:
                return self.emit(K.Call("tl.sqrt", (A,)), da)
            if p == -0.5:
                return self.emit(K.BinOp("/", K.Num(1.0), K.Call("tl.sqrt", (A,))), da)
            # a fractional power of a negative number has no real value: NaN, as in torch
            return self.emit(_exp(K.BinOp("*", K.Num(float(p)), _log(A))), da)
        b, db = self(e.right)
        if isinstance(e.left, ir.Num) and e.left.value > 0:         # a base provably > 0
            return self.emit(_exp(K.BinOp("*", self.value(b, db), K.Num(math.log(e.left.value)))), db)
        # an exponent known only at run time: |a| ** b, negated for a < 0 and an odd integer b,
        # NaN for a < 0 and a fractional b (torch.pow's values; exp(b log a) was NaN for all a < 0)
        out = canon(self.order, set(da) | set(db))
        A, B = self.bcast(a, da, out), self.bcast(b, db, out)
        m = self.value(*self.emit(_exp(K.BinOp("*", B, _log(K.Call("tl.abs", (A,))))), out))
        floor = K.Call("tl.floor", (K.BinOp("*", K.Num(0.5), B),))
        # b odd: a block with b's own dims (b may be a scalar that broadcasts against a)
        odd = self.value(*self.emit(K.BinOp("==", K.BinOp("-", B, K.BinOp("*", K.Num(2.0), floor)), K.Num(1.0)), B.dims))
        neg = self.value(*self.emit(K.Call("tl.where", (
            K.BinOp("==", B, K.Call("tl.floor", (B,))), K.Call("tl.where", (odd, K.Neg(m), m)),
            K.Num(float("nan")))), out))
        return self.emit(K.Call("tl.where", (K.BinOp("<", A, K.Num(0.0)), neg, m)), out)

    def int_power(self, a: str, dims: tuple[str, ...], p: int) -> Var:
        """a ** p for an integer p (power_expr), as a variable."""
        x = self.int_power_expr(self.value(a, dims), dims, p)
        if isinstance(x, K.Num):
            return number(x.value), ()
        return (x.id, tuple(dims)) if isinstance(x, K.Name) else (a, tuple(dims))

    def int_power_expr(self, a: K.Expr, dims: tuple[str, ...], p: int) -> K.Expr:
        """a ** p for an integer p, right for every sign of a (exp(p log a) is NaN for a < 0):
        by repeated squaring up to |p| = MAX_MULTIPLIED_POWER, beyond by exp(p log |a|) with the
        sign of a for an odd p; a reciprocal for p < 0."""
        if p == 0:
            return K.Num(1.0)          # torch's x ** 0 = 1 for every x (inf and NaN too)
        n = abs(p)
        named = lambda code: self.value(*self.emit(code, dims))     # noqa: E731
        if n > MAX_MULTIPLIED_POWER:
            m = named(_exp(K.BinOp("*", K.Num(float(p)), _log(K.Call("tl.abs", (a,))))))
            return named(K.Call("tl.where", (K.BinOp("<", a, K.Num(0.0)), K.Neg(m), m))) if n % 2 else m
        result, square = None, a
        while True:
            if n & 1:
                result = square if result is None else named(K.BinOp("*", result, square))
            n >>= 1
            if not n:
                break
            square = named(K.BinOp("*", square, square))
        return named(K.BinOp("/", K.Num(1.0), result)) if p < 0 else result

    def x_Contract(self, e: ir.Contract):
        (a, da), (b, db) = self(e.left), self(e.right)
        full = canon(self.order, set(da) | set(db))
        prod, _ = self.emit(K.BinOp("*", self.bcast(a, da, full), self.bcast(b, db, full)), full)
        return self.reduce(prod, full, e.over)

    def x_Call(self, e: ir.Call):
        if e.fn in ("max", "min"):
            (a, da), (b, db) = self(e.args[0]), self(e.args[1])
            out = canon(self.order, set(da) | set(db))
            fn = "tl.maximum" if e.fn == "max" else "tl.minimum"
            return self.emit(K.Call(fn, (self.bcast(a, da, out), self.bcast(b, db, out))), out)
        x, d = self(e.args[0])
        if e.fn == "detach":            # a value the backward holds constant (the stabilizer)
            return x, d
        # the registry's Triton form, dsl/functions.py
        return self.emit(K.Template(FUNCTIONS[e.fn].triton, (("x", self.value(x, d)),)), d)

    def x_Reduce(self, e: ir.Reduce):
        x, d = self(e.x)
        if e.fn == "sum":
            return self.reduce(x, d, e.over)
        if e.fn == "norm":
            X = self.value(x, d)
            sq, _ = self.emit(K.BinOp("*", X, X), d)
            s, rd = self.reduce(sq, d, e.over)
            return self.emit(K.Call("tl.sqrt", (self.value(s, rd),)), rd)
        if e.fn == "max":
            return self.reduce(x, d, e.over, "tl.max", "float('-inf')")
        return self.reduce(x, d, e.over, "tl.min", "float('inf')")

    def x_Rename(self, e: ir.Rename):
        x, d = self(e.x)
        m = dict(e.mapping)
        renamed = tuple(m.get(a, a) for a in d)
        out = canon(self.order, renamed)
        view = K.Permute(self.value(x, d), renamed, out)
        if renamed == out:          # the same block under other names: no statement
            self.values[(x, out)] = view
            return x, out
        return self.emit(view, out)

    def x_Cond(self, e: ir.Cond):
        raise AssertionError("flags are resolved before code generation")


def _exp(x: K.Expr) -> K.Expr:
    return K.Call("tl.exp", (x,))


def _log(x: K.Expr) -> K.Expr:
    return K.Call("tl.log", (x,))

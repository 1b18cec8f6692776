"""IR expressions -> Triton statements over named-dim blocks.

Every value in a kernel is a block whose axes are its dims in the spec's `dims` order (a
scalar is a 0-d value). Broadcasting by name is indexing with None; `@`, sum and norm
multiply and tl.sum over axes. Padded lanes (dim sizes below the block size) are zeroed
before every reduction, so nothing from them reaches a real lane.

Identifiers: generated temporaries start with '_' (a spec name never does) and every spec
name is used only behind a fixed prefix (v_q, p_q ...), so no spec text can shadow or inject
anything; names were validated as plain identifiers by the checker.
"""
from __future__ import annotations

import math

from ..dsl import ir, scalar
from ..dsl.functions import FUNCTIONS


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


class Emitter:
    """Emit Triton statements computing IR expressions. `env` maps a spec name (and
    'prev S' for prev(S)) to (variable, dims) already available in the kernel."""

    def __init__(self, mixer: ir.MixerIR, env: dict[str, tuple[str, tuple[str, ...]]], indent: str = "    ",
                 prefix: str = "_e", order: tuple[str, ...] | None = None):
        self.m = mixer
        # the axes of blocks, outermost first; chunked kernels put the token axis "_T" first
        self.order = order or mixer.dim_names
        self.env = dict(env)
        self.lines: list[str] = []
        self.cache: dict[ir.Expr, tuple[str, tuple[str, ...]]] = {}
        self.indent = indent
        self.prefix = prefix
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n}"

    def emit(self, code: str, dims: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        name = self.fresh()
        self.lines.append(f"{self.indent}{name} = {code}")
        return name, dims

    def mask(self, dims: tuple[str, ...]) -> str:
        """The validity mask of a block with these axes."""
        parts = [f"_mask_{d}" + ("" if len(dims) == 1 else
                                   "[" + ", ".join(":" if x == d else "None" for x in dims) + "]") for d in dims]
        return " & ".join(parts)

    def zero_padding(self, var: str, dims: tuple[str, ...], over: tuple[str, ...], fill: str = "0.0") -> str:
        if not over:
            return var
        return f"tl.where({self.mask(dims)}, {var}, {fill})"

    def reduce(self, var: str, dims: tuple[str, ...], over: tuple[str, ...], fn: str = "tl.sum",
               fill: str = "0.0") -> tuple[str, tuple[str, ...]]:
        masked = self.zero_padding(var, dims, over, fill)
        code = masked
        remaining = list(dims)
        for d in sorted(over, key=lambda x: -remaining.index(x)):     # last axis first
            code = f"{fn}({code}, axis={remaining.index(d)})"
            remaining.remove(d)
        return self.emit(code, tuple(remaining))

    def __call__(self, e: ir.Expr) -> tuple[str, tuple[str, ...]]:
        if e in self.cache:
            return self.cache[e]
        out = getattr(self, "x_" + type(e).__name__)(e)
        self.cache[e] = out
        return out

    # leaves
    def x_Num(self, e: ir.Num):
        return number(e.value), ()

    def x_Ref(self, e: ir.Ref):
        if e.kind == "dim":
            return f"_fsize_{e.name}", ()           # a float kernel argument
        if e.kind == "head":
            return "_head_f", ()
        if e.kind == "let" and e.name not in self.env:
            self.env[e.name] = self(self.m.let(e.name).expr)
        return self.env[e.name]

    def x_Prev(self, e: ir.Prev):
        return self.env["prev " + e.state]

    def x_Neg(self, e: ir.Neg):
        v, d = self(e.x)
        return self.emit(f"-{v}", d)

    def x_BinOp(self, e: ir.BinOp):
        if e.op == "**":
            return self.power(e)
        (a, da), (b, db) = self(e.left), self(e.right)
        out = canon(self.order, set(da) | set(db))
        return self.emit(f"{expand(a, da, out)} {e.op} {expand(b, db, out)}", out)

    def power(self, e: ir.BinOp):
        a, da = self(e.left)
        p = constant_exponent(e.right)
        if p is not None:
            if p == int(p):
                return self.int_power(a, da, int(p))
            if p == 0.5:
                return self.emit(f"tl.sqrt({a})", da)
            if p == -0.5:
                return self.emit(f"1.0 / tl.sqrt({a})", da)
            # a fractional power of a negative number has no real value: NaN, as in torch
            return self.emit(f"tl.exp({number(p)} * tl.log({a}))", da)
        b, db = self(e.right)
        if isinstance(e.left, ir.Num) and e.left.value > 0:         # a base provably > 0
            return self.emit(f"tl.exp({b} * {number(math.log(e.left.value))})", db)
        # an exponent known only at run time: |a| ** b, negated for a < 0 and an odd integer b,
        # NaN for a < 0 and a fractional b (torch.pow's values; exp(b log a) was NaN for all a < 0)
        out = canon(self.order, set(da) | set(db))
        A, B = expand(a, da, out), expand(b, db, out)
        m, _ = self.emit(f"tl.exp({B} * tl.log(tl.abs({A})))", out)
        odd, _ = self.emit(f"{B} - 2.0 * tl.floor(0.5 * {B}) == 1.0", out)
        neg, _ = self.emit(f"tl.where({B} == tl.floor({B}), tl.where({odd}, -{m}, {m}), float('nan'))", out)
        return self.emit(f"tl.where({A} < 0.0, {neg}, {m})", out)

    def int_power(self, a: str, dims: tuple[str, ...], p: int) -> tuple[str, tuple[str, ...]]:
        """a ** p for an integer p, right for every sign of a (exp(p log a) is NaN for a < 0):
        by repeated squaring up to |p| = MAX_MULTIPLIED_POWER, beyond by exp(p log |a|) with the
        sign of a for an odd p; a reciprocal for p < 0."""
        if p == 0:
            return number(1.0), ()          # torch's x ** 0 = 1 for every x (inf and NaN too)
        n = abs(p)
        if n > MAX_MULTIPLIED_POWER:
            m, _ = self.emit(f"tl.exp({number(float(p))} * tl.log(tl.abs({a})))", dims)
            return self.emit(f"tl.where({a} < 0.0, -{m}, {m})", dims) if n % 2 else (m, dims)
        result, square = None, a
        while True:
            if n & 1:
                result = square if result is None else self.emit(f"{result} * {square}", dims)[0]
            n >>= 1
            if not n:
                break
            square, _ = self.emit(f"{square} * {square}", dims)
        return self.emit(f"1.0 / {result}", dims) if p < 0 else (result, dims)

    def x_Contract(self, e: ir.Contract):
        (a, da), (b, db) = self(e.left), self(e.right)
        full = canon(self.order, set(da) | set(db))
        prod, _ = self.emit(f"{expand(a, da, full)} * {expand(b, db, full)}", full)
        return self.reduce(prod, full, e.over)

    def x_Call(self, e: ir.Call):
        if e.fn in ("max", "min"):
            (a, da), (b, db) = self(e.args[0]), self(e.args[1])
            out = canon(self.order, set(da) | set(db))
            fn = "tl.maximum" if e.fn == "max" else "tl.minimum"
            return self.emit(f"{fn}({expand(a, da, out)}, {expand(b, db, out)})", out)
        x, d = self(e.args[0])
        if e.fn == "detach":            # a value the backward holds constant (the stabilizer)
            return x, d
        code = FUNCTIONS[e.fn].triton.format(x=x)       # the registry, dsl/functions.py
        return self.emit(code, d)

    def x_Reduce(self, e: ir.Reduce):
        x, d = self(e.x)
        if e.fn == "sum":
            return self.reduce(x, d, e.over)
        if e.fn == "norm":
            sq, _ = self.emit(f"{x} * {x}", d)
            s, rd = self.reduce(sq, d, e.over)
            return self.emit(f"tl.sqrt({s})", rd)
        if e.fn == "max":
            return self.reduce(x, d, e.over, "tl.max", "float('-inf')")
        return self.reduce(x, d, e.over, "tl.min", "float('inf')")

    def x_Rename(self, e: ir.Rename):
        x, d = self(e.x)
        m = dict(e.mapping)
        renamed = tuple(m.get(a, a) for a in d)
        out = canon(self.order, renamed)
        if renamed == out:
            return x, out
        return self.emit(f"tl.permute({x}, {tuple(renamed.index(d) for d in out)})", out)

    def x_Cond(self, e: ir.Cond):
        raise AssertionError("flags are resolved before code generation")

"""Symbolic block shapes of the statements a kernel template writes (codegen/tile_split.py's
reading of the rendered backward): each value's shape as a tuple of dim expressions such as
("_BLOCK__T", "_BLOCK_K"), inferred over the subset of Triton the templates use."""
from __future__ import annotations

import ast
import re


class UnknownShape(Exception):
    """A statement outside the rules below; the message says which."""


def call_name(func) -> str:
    """"tl.sum" for tl.sum's node, "" for what is not a dotted name."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = call_name(func.value)
        return f"{base}.{func.attr}" if base else ""
    return ""


def rename(src: str, mapping: dict[str, str]) -> str:
    """Every name of `mapping` in src renamed at once (not an attribute: `.shape` stays)."""
    if not mapping:
        return src
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(mapping, key=len, reverse=True))) + r")(?!\w)")
    return pattern.sub(lambda m: mapping[m.group(1)], src)


ELEMENTWISE = {"tl.exp", "tl.log", "tl.abs", "tl.sqrt", "tl.sigmoid", "tl.exp2", "tl.log2", "tl.cos", "tl.sin",
               "tl.maximum", "tl.minimum", "tl.fma", "tl.math.exp", "tl.math.log", "tl.math.log1p", "tl.math.exp2",
               "tl.math.tanh", "tl.math.erf", "tl.math.rsqrt", "tl.math.sqrt", "tl.math.pow", "tl.math.log2",
               "tl.where", "tl.clamp", "tl.rsqrt", "tl.erf", "tl.floor", "tl.ceil", "libdevice.tanh",
               "tl.extra.cuda.libdevice.tanh", "_mixc_tanh"}
REDUCE = {"tl.sum", "tl.max", "tl.min", "tl.argmax", "tl.argmin"}
SCAN = {"tl.cumsum", "tl.cumprod"}
SCALAR = {"tl.program_id", "tl.num_programs", "float", "int", "min", "max"}


class Shapes:
    """Symbolic block shapes (tuples of dim expressions such as "_BLOCK__T") of the names of a
    kernel, inferred over the subset of Triton the templates write. A name whose shape is not
    known maps to None; reading it where a shape is needed raises UnknownShape."""

    def __init__(self, env: dict[str, tuple | None], aliases: dict[str, str] | None = None):
        self.env = dict(env)
        self.why: dict[str, str] = {}          # name -> why its shape is not known
        # a dim declared as another's alias has its block: "_BLOCK_J" reads as "_BLOCK_K"
        self.aliases = {f"_BLOCK_{a}": f"_BLOCK_{b}" for a, b in (aliases or {}).items()}

    def canon(self, d: str) -> str:
        return rename(d, self.aliases)

    def of(self, e) -> tuple:
        if isinstance(e, ast.Name):
            sh = self.env.get(e.id, "missing")
            if sh == "missing" or sh is None:
                raise UnknownShape(f"the shape of {e.id} is not known" + (f" ({self.why[e.id]})" if e.id in self.why else ""))
            return sh
        if isinstance(e, ast.Constant):
            return ()
        if isinstance(e, ast.BinOp):
            return self.broadcast(self.of(e.left), self.of(e.right))
        if isinstance(e, ast.UnaryOp):
            return self.of(e.operand)
        if isinstance(e, ast.Compare):
            return self.broadcast(self.of(e.left), *[self.of(c) for c in e.comparators])
        if isinstance(e, ast.BoolOp):
            return self.broadcast(*[self.of(v) for v in e.values])
        if isinstance(e, ast.IfExp):
            return self.broadcast(self.of(e.body), self.of(e.orelse))
        if isinstance(e, ast.Subscript):
            return self.index(e)
        if isinstance(e, ast.Call):
            return self.call(e)
        raise UnknownShape(f"no shape rule for {ast.unparse(e)[:60]}")

    def dim(self, e) -> str:
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape":
            return self.of(e.value.value)[ast.literal_eval(e.slice)]
        return self.canon(ast.unparse(e))

    def dims(self, e) -> tuple:
        if isinstance(e, (ast.List, ast.Tuple)):
            return tuple(self.dim(x) for x in e.elts)
        if isinstance(e, ast.Attribute) and e.attr == "shape":
            return self.of(e.value)
        raise UnknownShape(f"a shape this pass does not read: {ast.unparse(e)[:60]}")

    @staticmethod
    def broadcast(*shapes) -> tuple:
        n = max(len(s) for s in shapes)
        out = []
        for i in range(n):
            ds = {s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0} - {"1"}
            if len(ds) > 1:
                raise UnknownShape(f"shapes that do not broadcast: {shapes}")
            out.append(ds.pop() if ds else "1")
        return tuple(out)

    def index(self, e: ast.Subscript) -> tuple:
        base = self.of(e.value)
        parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        out, i = [], 0
        for p in parts:
            if isinstance(p, ast.Constant) and p.value is None:
                out.append("1")
            elif isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None:
                out.append(base[i])
                i += 1
            else:
                raise UnknownShape(f"an index this pass does not read: {ast.unparse(e)[:60]}")
        return tuple(out) + tuple(base[i:])

    def call(self, e: ast.Call) -> tuple:
        f = call_name(e.func)
        kw = {k.arg: k.value for k in e.keywords}
        if isinstance(e.func, ast.Attribute) and e.func.attr == "to":
            return self.of(e.func.value)
        if f in ("tl.zeros", "tl.full"):
            return self.dims(e.args[0])
        if f == "tl.arange":
            lo, hi = (ast.unparse(a) for a in e.args[:2])
            return (self.canon(hi if lo == "0" else f"{hi} - {lo}"),)
        if f in ELEMENTWISE:
            return self.broadcast(*[self.of(a) for a in e.args])
        if f in REDUCE:
            sh = self.of(e.args[0])
            axis = kw.get("axis", e.args[1] if len(e.args) > 1 else None)
            if axis is None or (isinstance(axis, ast.Constant) and axis.value is None):
                return ()
            k = ast.literal_eval(axis)
            return sh[:k] + sh[k + 1:] if k >= 0 else sh[:len(sh) + k] + sh[len(sh) + k + 1:]
        if f in ("tl.zeros_like", "tl.full_like"):
            return self.of(e.args[0])
        if f in SCAN:
            return self.of(e.args[0])
        if f == "tl.trans":
            sh = self.of(e.args[0])
            if len(sh) != 2 or len(e.args) > 1:
                raise UnknownShape("tl.trans of a block that is not a matrix")
            return sh[::-1]
        if f in ("tl.reshape", "tl.view", "tl.broadcast_to"):
            return self.dims(e.args[1])
        if f in ("_mixc_dot", "tl.dot"):
            a, b = self.of(e.args[0]), self.of(e.args[1])
            return (a[0], b[1])
        if f in ("_mixc_solve_lower", "_mixc_solve_upper_t"):
            return self.of(e.args[1])
        if f == "_mixc_key_rows":                      # a key block's entries at their rows of the whole dim
            return (ast.unparse(e.args[2]),)
        if f == "tl.gather":
            return self.of(e.args[1])
        if f == "tl.load":
            return self.of(e.args[0])
        if f in SCALAR:
            return ()
        raise UnknownShape(f"no shape rule for {f or ast.unparse(e.func)}")

    def run(self, stmts) -> None:
        """Record the shapes of what the statements assign (both branches of an if; a name
        the branches disagree on is unknown)."""
        for s in stmts:
            if isinstance(s, ast.Assign):
                try:
                    sh = self.of(s.value)
                except UnknownShape as e:
                    sh = None
                    for t in s.targets:
                        if isinstance(t, ast.Name):
                            self.why[t.id] = str(e)
                for t in s.targets:
                    if isinstance(t, ast.Name):
                        self.env[t.id] = sh
            elif isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name):
                try:
                    self.env[s.target.id] = self.broadcast(self.of(s.target), self.of(s.value))
                except UnknownShape:
                    self.env[s.target.id] = None
            elif isinstance(s, ast.For):
                self.env[s.target.id] = ()
                self.run(s.body)
            elif isinstance(s, ast.If):
                before = dict(self.env)
                self.run(s.body)
                after_body, self.env = self.env, dict(before)
                self.run(s.orelse)
                for k in set(after_body) | set(self.env):
                    if after_body.get(k, "x") != self.env.get(k, "y"):
                        self.env[k] = after_body[k] if k not in self.env else (self.env[k] if k not in after_body else None)



"""IR expressions -> torch statements, for the torch backend's generated module.

Every value is a tensor [B, T, H, *dims] (size-1 axes where it does not vary: params are
[1, 1, H, ...]) with its dims in the spec's `dims` order, or a scalar (a number, an option)
with no axes at all. Broadcasting by name is indexing with None after the three leading
axes; `@`, sum and norm reduce over the axes of their dims. Names follow triton_expr.py:
temporaries start with '_', spec names appear only behind fixed prefixes (v_q ...)."""
from __future__ import annotations

import math

from ..dsl import ir
from ..dsl.functions import FUNCTIONS
from .triton_expr import Emitter, canon, number

LEAD = 3
# The registry's torch forms (dsl/functions.py) and the generator's own detach
CALLS = {name: f.torch for name, f in FUNCTIONS.items()} | {"detach": "{x}.detach()"}


class TorchEmitter(Emitter):
    """Emitter's walk and cache, with torch code. `scalars`: variables without leading axes."""

    def __init__(self, mixer: ir.MixerIR, env, scalars=(), indent: str = "    ", prefix: str = "_t", lead: int = LEAD):
        super().__init__(mixer, env, indent=indent, prefix=prefix)
        self.scalars = set(scalars)
        self.lead = lead            # leading axes: (B, T, H) here, (B, H) in the one-token step
        self.calls: dict[str, str] = {}     # a function's torch form where this emitter prints another

    def is_scalar(self, var: str) -> bool:
        return var in self.scalars or var[:1].isdigit() or var[:1] == "-"

    def expand(self, var: str, have: tuple[str, ...], want: tuple[str, ...]) -> str:
        if self.is_scalar(var) or have == want:
            return var
        lead = ":, " * self.lead
        return f"{var}[{lead}{', '.join(':' if d in have else 'None' for d in want)}]" if want else var

    def emit_as(self, code: str, dims, parts) -> tuple[str, tuple[str, ...]]:
        """Emit code; its value is a scalar when every part is."""
        name, d = self.emit(code, tuple(dims))
        if all(self.is_scalar(p) for p in parts):
            self.scalars.add(name)
        return name, d

    def reduce(self, var, dims, over, fn="sum", fill=None):
        axes = tuple(self.lead + dims.index(d) for d in over)
        if len(axes) == 1:      # sum(2), not sum(dim=(2,)): the int overload (~0.4 us less per call in a decode step)
            axes = axes[0]
        rest = tuple(d for d in dims if d not in over)
        code = {"sum": f"{var}.sum(dim={axes})", "max": f"{var}.amax(dim={axes})", "min": f"{var}.amin(dim={axes})",
                "norm": f"torch.linalg.vector_norm({var}, dim={axes})"}[fn]
        return self.emit(code, rest)

    def x_Ref(self, e: ir.Ref):
        if e.kind == "dim":
            v = f"float(_sizes[{e.name!r}])"
            self.scalars.add(v)
            return v, ()
        if e.kind == "head":
            return "_head", ()
        if e.kind == "let" and e.name not in self.env:
            self.env[e.name] = self(self.m.let(e.name).expr)
        return self.env[e.name]

    def x_Neg(self, e: ir.Neg):
        v, d = self(e.x)
        return self.emit_as(f"-{v}", d, [v])

    def x_BinOp(self, e: ir.BinOp):
        if e.op == "**":
            return self.power(e)
        (a, da), (b, db) = self(e.left), self(e.right)
        out = canon(self.order, set(da) | set(db))
        return self.emit_as(f"{self.expand(a, da, out)} {e.op} {self.expand(b, db, out)}", out, [a, b])

    def x_Contract(self, e: ir.Contract):
        (a, da), (b, db) = self(e.left), self(e.right)
        full = canon(self.order, set(da) | set(db))
        prod, _ = self.emit(f"{self.expand(a, da, full)} * {self.expand(b, db, full)}", full)
        return self.reduce(prod, full, e.over)

    def x_Call(self, e: ir.Call):
        if e.fn in ("max", "min"):
            (a, da), (b, db) = self(e.args[0]), self(e.args[1])
            out = canon(self.order, set(da) | set(db))
            fn = "torch.maximum" if e.fn == "max" else "torch.minimum"
            # a number operand as a 0-d tensor (torch.maximum takes tensors only); a tensor as it is
            # (the token loop calls this per token: each wrapper is a Python call)
            ta, tb = (f"_t({v})" if self.is_scalar(v) else v for v in (self.expand(a, da, out), self.expand(b, db, out)))
            return self.emit_as(f"{fn}({ta}, {tb})", out, [a, b])
        x, d = self(e.args[0])
        arg = f"_t({x})" if self.is_scalar(x) else x
        return self.emit_as(self.calls.get(e.fn, CALLS[e.fn]).format(x=arg), d, [x])

    def x_Reduce(self, e: ir.Reduce):
        x, d = self(e.x)
        return self.reduce(x, d, e.over, e.fn)

    def x_Rename(self, e: ir.Rename):
        x, d = self(e.x)
        m = dict(e.mapping)
        renamed = tuple(m.get(a, a) for a in d)
        out = canon(self.order, renamed)
        if renamed == out:
            return x, out
        perm = tuple(range(self.lead)) + tuple(self.lead + renamed.index(x) for x in out)
        return self.emit(f"{x}.permute{perm}", out)

    def power(self, e: ir.BinOp):
        (a, da), (b, db) = self(e.left), self(e.right)
        out = canon(self.order, set(da) | set(db))
        if isinstance(e.right, ir.Num):
            return self.emit_as(f"{self.expand(a, da, out)} ** {number(e.right.value)}", out, [a])
        if isinstance(e.left, ir.Num) and e.left.value > 0:
            return self.emit_as(f"torch.exp(_t({b}) * {number(math.log(e.left.value))})", out, [b])
        return self.emit_as(f"_t({self.expand(a, da, out)}) ** {self.expand(b, db, out)}", out, [a, b])


def input_loads(m: ir.MixerIR, lead: int, indent: str = "    ") -> tuple[list[str], dict, set]:
    """The torch printers' loads of a spec's inputs ([B, H, *dims] at lead 2, [B, T, H, *dims]
    at lead 3), params (reshaped to the lead) and number options, each input's and param's dims
    put in canonical order: (lines, env {name: (variable, dims)}, the scalar variables). One
    definition for the chunked torch form (torch_module.py) and the step (torch_step.py)."""
    order = m.dim_names
    lines, env, scalars = [f"{indent}_x0 = next(iter(_x.values()))"], {}, set()
    axes = ", ".join(str(i) for i in range(lead))
    ones = ", ".join(["None"] * (lead - 1))     # a param [H, *dims] viewed at the lead ([None]: one view op)
    for decls, src, reshape in ((m.inputs, "_x", False), (m.params, "_p", True)):
        for d in decls:
            cd = canon(order, d.shape)
            perm = "" if cd == d.shape else f".permute({axes}, {', '.join(str(lead + d.shape.index(a)) for a in cd)})"
            shaped = f"[{ones}]" if reshape else ""
            lines.append(f"{indent}v_{d.name} = {src}[{d.name!r}]{shaped}{perm}")
            env[d.name] = (f"v_{d.name}", cd)
    for o in m.options:
        if o.kind == "float":
            lines.append(f"{indent}v_{o.name} = _opt[{o.name!r}]")
            env[o.name] = (f"v_{o.name}", ())
            scalars.add(f"v_{o.name}")
    return lines, env, scalars

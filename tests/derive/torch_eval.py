"""Evaluate derived sympy expressions on named tensors (tensor, dims) with torch, nodes
included (sum, norm, max, min, dot, rename): test_plan_numeric.py checks the Plan
numerically with it. A test helper (it was mixc/codegen/torch_eval.py)."""
from __future__ import annotations

import sympy as sp
import torch

from mixc.derive.symbolic import SymbolTable
from mixc.runtime.reference import _align

from .torch_printer import torch_callable

Value = tuple[torch.Tensor, tuple[str, ...]]


class NamedEval:
    def __init__(self, table: SymbolTable, values: dict[str, Value], lead: int, dim_sizes: dict[str, int],
                 order: tuple[str, ...]):
        self.table = table
        self.values = dict(values)
        self.lead = lead
        self.sizes = dim_sizes
        self.order = order

    def dims_of(self, expr: sp.Expr) -> tuple[str, ...]:
        names = set()
        for s in expr.free_symbols:
            names |= set(self.table.shape(s)) if self.table.kinds.get(s) != "dim" else set()
        return tuple(d for d in self.order if d in names)

    def leaf(self, s: sp.Symbol) -> Value:
        kind = self.table.kinds.get(s)
        if kind == "dim":
            return torch.tensor(float(self.sizes[s.name]), dtype=torch.float64), ()
        if s.name in self.values:
            return self.values[s.name]
        if s in self.table.nodes:
            v = self.node(s)
            self.values[s.name] = v
            return v
        raise KeyError(f"no value for {s}")

    def node(self, s: sp.Symbol) -> Value:
        nd = self.table.nodes[s]
        if nd.kind == "dot":
            (a, da), (b, db) = self(nd.operands[0]), self(nd.operands[1])
            dims = tuple(d for d in self.order if d in da or d in db)
            prod = _align((a, da), dims, self.lead) * _align((b, db), dims, self.lead)
            return self._reduce(prod, dims, nd.over, torch.sum)
        t, d = self(nd.operands[0])
        if nd.kind == "rename":
            m = dict(nd.mapping)
            return t, tuple(m.get(x, x) for x in d)
        if nd.kind == "sum":
            return self._reduce(t, d, nd.over, torch.sum)
        if nd.kind == "norm":
            r, dims = self._reduce(t * t, d, nd.over, torch.sum)
            return torch.sqrt(r), dims
        return self._reduce(t, d, nd.over, torch.amax if nd.kind == "max" else torch.amin)

    def _reduce(self, t, dims, over, fn) -> Value:
        t = t.expand(t.shape[:self.lead] + tuple(self.sizes[d] for d in dims)) if dims else t
        axes = [self.lead + dims.index(x) for x in over]
        return fn(t, dim=axes), tuple(d for d in dims if d not in over)

    def __call__(self, expr: sp.Expr) -> Value:
        syms = sorted(expr.free_symbols, key=str)
        vals = [self.leaf(s) for s in syms]
        dims = tuple(d for d in self.order if any(d in v[1] for v in vals))
        args = [_align(v, dims, self.lead) if v[0].dim() >= self.lead else v[0] for v in vals]
        out = torch_callable(expr, syms)(*args)
        if not isinstance(out, torch.Tensor):
            out = torch.tensor(float(out), dtype=torch.float64).reshape((1,) * self.lead)
        return out, dims

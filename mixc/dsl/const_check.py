"""Constant tensors, `const W[E] = [0.5, 1.0]`: the checker's part (check.py hands them here).

A const is a param whose values the spec fixes: the checker evaluates its values here and
lowers it to an ordinary param (MixerIR.params) plus an ir.Const with the numbers, so derive,
codegen and the kernels see a param; the runtime's binder supplies its tensor and no call
passes it (standalone/binding.py). Only numbers the checker evaluated reach generated code or
a compiled module's METADATA, never the spec's text.

Refused at their place: a dim whose size a call binds (a const's size must be the spec's:
`dims E = 2`), a list whose length is not its dim's size, a list where a number belongs (or a
number where a list does), an element that reads a name (an input, a param, a dim, an option)
or has no finite value (1 / 0)."""
from __future__ import annotations

from . import ir, scalar
from .errors import did_you_mean
from .range_check import syntax_nodes
from .parser import CondNode, ConstDeclNode, ListNode, NameNode, Node

MAX_CONST_VALUES = 4096     # a const is small: one-hot mixing weights, a few per-channel constants


def _fmt(shape) -> str:
    return "[" + ", ".join(shape) + "]"


class ConstChecks:
    def __init__(self, checker):
        self.c = checker
        self.consts: dict[str, ir.Const] = {}

    def declare(self, item: ConstDeclNode) -> ir.TensorDecl:
        """const W[...] = ...: its param declaration (TensorDecl, with the range its values span,
        which the sign prover reads) after recording its values."""
        c = self.c
        c.declare(item.name, "const")
        name = item.name.name
        sizes = []
        for d in item.dims:
            if d.name == ir.POSITIONS:
                raise c.error(f"const '{name}' cannot have dim T: a const's dims have sizes the spec fixes "
                              "(T is the call's number of tokens)", d.span)
            if d.name not in c.dims:
                raise c.error(f"unknown dim '{d.name}'{did_you_mean(d.name, c.dims)}", d.span,
                              (f"declare it with a fixed size: dims {d.name} = 2",))
            size = c.dims[c._root(d.name)].size
            if size is None:
                raise c.error(f"dim '{d.name}' of const '{name}' has no fixed size: a call's tensors bind it, but a "
                              f"const's values are written in the spec; fix it with `dims {d.name} = N`", d.span)
            sizes.append(size)
        shape = c.shape_of(item, "const")      # twice-named dims, rank: as for any tensor
        count = 1
        for s in sizes:
            count *= s
        if count > MAX_CONST_VALUES:
            raise c.error(f"const '{name}' has {count} values; the limit is {MAX_CONST_VALUES} (pass a larger "
                          "tensor as a param)", item.span)
        values = self.values(name, shape, tuple(sizes), item.value)
        self.consts[name] = ir.Const(name, shape, values, item.name.span)
        return ir.TensorDecl(name, shape, item.name.span, ir.ValueRange(min(values), max(values)))

    def values(self, name: str, shape: ir.Shape, sizes: tuple[int, ...], value: Node) -> tuple[float, ...]:
        """The numbers of `value`, row-major. One list per dim, walked without recursion (a
        list nested deeper than the const's rank is refused where it starts)."""
        out: list[float] = []
        stack = [(value, 0)]          # (node, its depth: the dim its list runs along)
        while stack:
            node, depth = stack.pop()
            if depth < len(shape):
                if not isinstance(node, ListNode):
                    raise self.c.error(f"const '{name}' is {_fmt(shape)}: expected a list of {sizes[depth]} values "
                                       f"along dim {shape[depth]} here, got a number", node.span)
                if len(node.items) != sizes[depth]:
                    raise self.c.error(f"const '{name}' is {_fmt(shape)}: dim {shape[depth]} has size {sizes[depth]}, "
                                       f"but this list has {len(node.items)} value{'s' * (len(node.items) != 1)}",
                                       node.span)
                stack.extend((x, depth + 1) for x in reversed(node.items))
            elif isinstance(node, ListNode):
                what = f"const '{name}' is {_fmt(shape)}" if shape else f"const '{name}' is a scalar"
                raise self.c.error(f"{what}: expected a number here, got a list (one list per dim)", node.span)
            else:
                out.append(self.number(name, node))
        return tuple(out)

    def number(self, name: str, node: Node) -> float:
        """An element: a number expression of constants (1 / 16, 2 ** -5, exp(-1))."""
        for part in syntax_nodes(node):
            ref = part.name if isinstance(part, NameNode) else part.flag if isinstance(part, CondNode) else None
            if ref is not None:
                kind = self.c.declared_at.get(ref, (None, None))[1]
                what = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" if kind else "not a number"
                raise self.c.error(f"the values of const '{name}' are numbers fixed by the spec (e.g. 0.5, 1 / 16, "
                                   f"2 ** -5), but '{ref}' is {what}", part.span)
        e = self.c.expr(node, "option")       # folds the constants, refusing 1 / 0 and log(0) at their place
        try:
            return float(scalar.evaluate(e))
        except scalar.NotConstant:
            raise self.c.error(f"the values of const '{name}' are numbers fixed by the spec", node.span) from None

    def refuse_update(self, name: str, span) -> None:
        if name in self.consts:
            line = self.consts[name].span.line
            raise self.c.error(f"'{name}' is a const (line {line}): its values are fixed by the spec and cannot be "
                               "updated; declare a state to carry values from token to token", span)


"""Declared ranges, `input beta[] in (0, 2)`: the checker's part (check.py hands them here).

A range belongs on an input or a param (values the caller passes); its ends are number
expressions of constants or -inf / inf, and it is not empty. Everything else is an error at
the range: a range on a state, a let or an option, `[1, 0]`, `(1, 1]`, an end that reads a
name (`[0, K]`) or has no value (`[0, 1 / 0]`)."""
from __future__ import annotations

from . import ir, scalar
from .parser import CondNode, NameNode, Node, RangeNode, UnaryNode

_NOT_HERE = {"state": "a state's values follow from its update",
             "let": "a let's values follow from its expression",
             "option": "an option is a number of the call, not a tensor of values"}


class RangeChecks:
    def __init__(self, checker):
        self.c = checker

    def value_range(self, r: RangeNode, what: str, name: str) -> ir.ValueRange:
        """The range of input or param `name` (what: its kind); refused on anything else."""
        if what not in ("input", "param"):
            self.refuse(r, what)
        lower, upper = self.end(r.lower), self.end(r.upper)
        if lower > upper or (lower == upper and not (r.lower_closed and r.upper_closed)):
            shown = ir.ValueRange(lower, upper, r.lower_closed, r.upper_closed).text()
            why = (f"its lower end {lower:g} is above its upper end {upper:g}" if lower > upper
                   else f"an open end at {lower:g} leaves no value")
            raise self.c.error(f"the range {shown} of {what} '{name}' is empty: {why}", r.span)
        return ir.ValueRange(lower, upper, r.lower_closed, r.upper_closed)

    def refuse(self, r: RangeNode, what: str) -> None:
        article = "an" if what[0] in "aeiou" else "a"
        raise self.c.error(f"{article} {what} takes no range ({_NOT_HERE[what]}); declare the range on the inputs "
                           "and params the caller passes, e.g. `input beta[] in (0, 2)`", r.span)

    def end(self, node: Node) -> float:
        """An end of a range: a number expression of constants (1 / 16, 2 ** -5), or -inf / inf."""
        if isinstance(node, NameNode) and node.name == "inf":
            return float("inf")
        if isinstance(node, UnaryNode) and isinstance(node.x, NameNode) and node.x.name == "inf":
            return float("-inf")
        for part in syntax_nodes(node):
            name = part.name if isinstance(part, NameNode) else part.flag if isinstance(part, CondNode) else None
            if name is not None:
                raise self.c.error(f"the ends of a range are numbers (or -inf, inf), but '{name}' is not a number",
                                   part.span)
        e = self.c.expr(node, "option")       # folds the constants, refusing 1 / 0 and log(0) at their place
        try:
            return scalar.evaluate(e)
        except scalar.NotConstant:            # what the walk above missed (a function of no constant value)
            raise self.c.error("the ends of a range are numbers (or -inf, inf)", node.span) from None


def syntax_nodes(node: Node):
    """node and every syntax node below it."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        for value in vars(n).values():
            for x in (value if isinstance(value, tuple) else (value,)):
                if isinstance(x, Node):
                    stack.append(x)

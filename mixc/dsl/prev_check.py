"""prev(): the checker's part (check.py hands each call here).

prev(S) of a state is the state before this token's update (ir.Prev), in an update (its own
state) or the output. prev(x) of an input is the previous token's x, 0 at each sequence's
start: it is lowered here to a derived input prev_x (ir.Shifted; MixerIR.inputs ends with the
derived ones) that the op computes before any kernel (standalone/shift.py), so derive, codegen
and the classes see an ordinary input. Refused, at the call: prev(prev(x)), prev() of a param,
a let, or anything not a name, prev(x) in an option's default or in a sequence mixer, and a
spec that declares prev_x itself."""
from __future__ import annotations

from . import ir
from .errors import Span, did_you_mean
from .parser import CallNode, NameNode

# prev(x) of an input x: the derived input the kernels read and the entry the state carries
PREV_INPUT = "prev_{}"


class PrevChecks:
    def __init__(self, checker):
        self.c = checker
        self.shifted: dict[str, tuple[ir.Shifted, ir.TensorDecl]] = {}   # by derived name, in order of use

    def derived_inputs(self) -> tuple[ir.TensorDecl, ...]:
        return tuple(d for _, d in self.shifted.values())

    def shifted_inputs(self) -> tuple[ir.Shifted, ...]:
        return tuple(sh for sh, _ in self.shifted.values())

    def call(self, ex, n: CallNode) -> ir.Expr:
        """prev(...) in the expression checker `ex` (its context: ex.ctx, ex.state)."""
        c = self.c
        if len(n.args) == 1 and isinstance(n.args[0], CallNode) and n.args[0].fn == "prev":
            raise c.error("prev(prev(...)): only the previous token is kept; prev() takes a state or an input by "
                          "name (for a value two tokens back, declare it as an input the caller shifts)", n.span)
        if len(n.args) != 1 or not isinstance(n.args[0], NameNode):
            raise c.error("prev() takes the name of a state or an input, e.g. prev(S) or prev(x)", n.span)
        name, at = n.args[0].name, n.args[0].span
        if name in c.inputs:
            if ex.ctx == "option":
                raise c.error(f"an option's default may use only numbers, dims and earlier options, not "
                              f"prev({name})", n.span)
            return self.shift(name, n.span)
        if name not in c.states:
            if name in c.params:
                kind = "const" if name in c.consts.consts else "param"
                raise c.error(f"prev() of {kind} '{name}': a {kind} has the same value at every token (prev({name}) "
                              f"would be {name}); prev() takes a state or an input", at)
            if name in c.lets:
                raise c.error(f"prev() of let '{name}': write the let's previous value with prev() of the inputs "
                              f"it reads (prev(x) of an input is the previous token's x, 0 at a sequence's start)",
                              at)
            raise c.error(f"prev() takes a state or an input, but '{name}' is not one"
                          f"{did_you_mean(name, [*c.states, *c.inputs])}", at)
        if ex.ctx not in ("update", "output"):
            raise c.error(f"prev({name}) may only appear in an update or the output", n.span)
        return ir.Prev(c.states[name].shape, n.span, name)

    def shift(self, name: str, span: Span) -> ir.Ref:
        """prev(x) of input x: a Ref to the derived input prev_x, declared on first use. Its
        declared range is x's widened to take the 0 of a sequence's start."""
        x = self.c.inputs[name]
        derived = PREV_INPUT.format(name)
        if derived not in self.shifted:
            r = x.range
            if r is not None and not r.contains(0.0):
                r = ir.ValueRange(min(r.lower, 0.0), max(r.upper, 0.0), r.lower_closed or r.lower >= 0,
                                  r.upper_closed or r.upper <= 0)
            self.shifted[derived] = (ir.Shifted(derived, name, span), ir.TensorDecl(derived, x.shape, span, r))
        return ir.Ref(x.shape, span, derived, "input")

    def check_shifted(self) -> None:
        """prev(x) of inputs needs a recurrence, and its derived name (prev_x: the kernels' input,
        the state's entry) must be free."""
        c = self.c
        for derived, (sh, _) in self.shifted.items():
            if not c.states:
                raise c.error(f"prev({sh.source}) needs a state: a sequence mixer (conv, mix, attend) reads other "
                              f"tokens with conv(), e.g. conv(h, {sh.source}) with a two-tap filter", sh.span)
            if derived in c.declared_at:
                at, what = c.declared_at[derived]
                article = "an " if what[0] in "aeiou" else "a "
                raise c.error(f"prev({sh.source}) is carried as '{derived}' (an input of the kernels, an entry of "
                              f"the state), but '{derived}' is declared as {article}{what} on line {at.line}; "
                              "rename that", sh.span)

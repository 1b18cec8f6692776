"""The checker's rules for sequence ops (conv, mix, attend) and for the positions dim T.

A sequence op's value at token t reads other tokens, so a mixer that has one is not a
recurrence: it declares no state. Kept apart from check.py so that the rules of the two
kinds of mixer read separately; check.Checker calls in here."""
from __future__ import annotations

from . import ir
from .errors import did_you_mean
from .parser import BoolNode, CallNode, KwargNode, NameNode

SEQUENCE_FNS = ("conv", "mix", "attend")
_KWARGS = {"conv": ("causal",), "mix": ("causal",), "attend": ("window", "causal")}
_FORMS = {"conv": "conv(h, x), conv(h, x, L) or conv(h, x, causal=false)",
          "mix": "mix(W, x) or mix(W, x, causal=false)",
          "attend": "attend(q, k, v), attend(q, k, v, window=W) or attend(q, k, v, causal=false)"}
_ARITY = {"conv": (2, 3), "mix": (2, 2), "attend": (3, 3)}
T = ir.POSITIONS


def _fmt(shape) -> str:
    return "[" + ", ".join(shape) + "]"


class SequenceChecks:
    def __init__(self, checker):
        self.c = checker
        self.ops: list[ir.SeqOp] = []
        self.varying_lets: dict[str, str] = {}     # let -> what makes it differ from token to token
        self.sequence_lets: set[str] = set()       # lets that use a sequence op

    def err(self, msg, span, notes=()):
        return self.c.error(msg, span, notes)

    # ---- declarations ----------------------------------------------------------------

    def position_dim(self, decl, i: int, what: str) -> None:
        """T in a declared shape: only a param's first dim ([T, ...], a value per position) or
        its first two ([T, T, ...], a token-mixing matrix)."""
        span = decl.dims[i].span
        if what == "input":
            raise self.err(f"T is the time axis of every input ([B, T, H, ...]); it is not written in the "
                           f"shape of input '{decl.name.name}'", span)
        if what == "state":
            raise self.err(f"a state has no time axis: T cannot be in the shape of state '{decl.name.name}'", span)
        if not (i == 0 or (i == 1 and decl.dims[0].name == T)):
            raise self.err("T may only lead a param's shape: [T, ...] (one value per position) or [T, T, ...] "
                           "(a token-mixing matrix)", span)

    def check_mixer_kind(self) -> None:
        """A mixer is a recurrence (state, update) or a sequence mixer (conv, mix, attend), not both."""
        c = self.c
        if self.ops and c.states:
            op = self.ops[0]
            st = next(iter(c.states.values()))
            notes = ()
            if op.kind == "conv":       # Mamba's and the delta rules' short conv on their inputs
                notes = ("a short convolution of a recurrence's inputs (Mamba's, GatedDeltaNet's conv1d) belongs in "
                         "the layer, before the mixer: mixc.nn.MixerLayer applies one to its q/k/v-like inputs "
                         "(conv_size, 4 by default); or call a conv spec's op on the inputs and pass its output on",)
            raise self.err(f"{op.kind}() makes '{c.tree.name.name}' a sequence mixer, which has no state, but state "
                           f"'{st.name}' is declared on line {st.span.line}; a mixer is either a recurrence (state, "
                           "update) or built from conv, mix and attend", op.span, notes)
        if c.states:
            for p in c.params.values():
                if p.shape[:1] == (T,):
                    raise self.err(f"param '{p.name}' is declared per position ([T, ...]), which only a sequence "
                                   "mixer (conv, mix, attend) reads; the params of a recurrence are per head",
                                   p.span)

    # ---- what an expression depends on -------------------------------------------------

    def varies(self, e: ir.Expr) -> str | None:
        """What makes e differ from token to token (an input, a per-position param, a sequence
        op, or a let of those), in words; None when it is the same at every token."""
        for node in ir.walk(e):
            if isinstance(node, ir.SeqOp):
                return f"{node.kind}()"
            if isinstance(node, ir.Ref):
                if node.kind == "input":
                    return f"input '{node.name}'"
                if node.kind == "param" and self.c.params[node.name].shape[:1] == (T,):
                    return f"param '{node.name}' (one value per position)"
                if node.kind == "let" and node.name in self.varying_lets:
                    return f"let '{node.name}'"
        return None

    def uses_sequence(self, e: ir.Expr) -> bool:
        return any(isinstance(n, ir.SeqOp) or (isinstance(n, ir.Ref) and n.kind == "let" and n.name in
                                                self.sequence_lets) for n in ir.walk(e))

    def note_let(self, name: str, e: ir.Expr) -> None:
        why = self.varies(e)
        if why is not None:
            self.varying_lets[name] = why
        if self.uses_sequence(e):
            self.sequence_lets.add(name)

    def check_output(self, name: str, e: ir.Expr, span) -> None:
        if T in e.shape:
            raise self.err(f"output '{name}' has the dim T of source positions (a row of a [T, T] param); "
                           "mix(W, x) is what consumes it", span)

    # ---- the calls -----------------------------------------------------------------------

    def call(self, xc, n: CallNode) -> ir.SeqOp:
        fn = n.fn
        if xc.ctx == "update":
            raise self.err(f"{fn}() cannot appear in an update: a sequence op reads other tokens, so a mixer that "
                           "has one is not a recurrence (write it in a let or the output of a mixer without state)",
                           n.span)
        if xc.ctx == "option":
            raise self.err(f"{fn}() cannot appear in an option's default", n.span)
        positional, kwargs = [], {}
        for a in n.args:
            if isinstance(a, KwargNode):
                if a.name not in _KWARGS[fn]:
                    takes = ", ".join(f"{k}=" for k in _KWARGS[fn])
                    raise self.err(f"{fn}() takes no '{a.name}=' argument (it takes {takes}){did_you_mean(a.name, _KWARGS[fn])}",
                                   a.name_span)
                if a.name in kwargs:
                    raise self.err(f"{fn}() is given {a.name}= twice", a.name_span)
                kwargs[a.name] = a
            elif kwargs:
                raise self.err(f"{fn}(): an argument without a name cannot follow a named one; write {_FORMS[fn]}",
                               a.span)
            else:
                positional.append(a)
        lo, hi = _ARITY[fn]
        if not lo <= len(positional) <= hi:
            want = f"{lo}" if lo == hi else f"{lo} or {hi}"
            raise self.err(f"{fn}() takes {want} arguments, got {len(positional)}; write {_FORMS[fn]}", n.span)
        causal = self._causal(kwargs.get("causal"))
        if fn == "conv":
            shape, args, tap = self._conv(xc, n, positional)
            window = None
        elif fn == "mix":
            shape, args = self._mix(xc, positional)
            tap, window = None, None
        else:
            shape, args = self._attend(xc, n, positional)
            tap, window = None, self._window(xc, kwargs.get("window"))
        op = ir.SeqOp(shape, n.span, fn, args, tap, causal, window, len(self.ops))
        self.ops.append(op)
        return op

    def _values(self, xc, fn: str, nodes, names) -> list[ir.Expr]:
        out = []
        for node, what in zip(nodes, names):
            v = xc.check(node)
            if T in v.shape:
                raise self.err(f"{fn}(): {what} has the dim T of source positions (a row of a [T, T] param); "
                               "only the first argument of mix() takes it", node.span)
            out.append(v)
        return out

    def _causal(self, kw: KwargNode | None) -> bool | str:
        if kw is None:
            return True
        v = kw.value
        if isinstance(v, BoolNode):
            return v.value
        if isinstance(v, NameNode):
            opt = self.c.options.get(v.name)
            if opt is not None and opt.kind == "bool":
                return v.name
        raise self.err("causal= takes true, false or a flag (declared as `option causal = true`)", v.span)

    def _window(self, xc, kw: KwargNode | None) -> ir.Expr | None:
        if kw is None:
            return None
        e = xc.check(kw.value)
        for node in ir.walk(e):
            if isinstance(node, ir.SeqOp) or (isinstance(node, ir.Ref) and node.kind not in ("dim", "option")):
                what = f"{node.kind}()" if isinstance(node, ir.SeqOp) else \
                    ("the head index" if node.kind == "head" else f"{node.kind} '{node.name}'")
                raise self.err(f"window= takes a number of tokens: numbers, dims and number options, not {what}",
                               node.span or kw.value.span)
        if e.shape:
            raise self.err(f"window= takes a number of tokens, but this has shape {_fmt(e.shape)}", kw.value.span)
        return e

    def _conv(self, xc, n: CallNode, pos):
        h, x = self._values(xc, "conv", pos[:2], ("the filter", "the input"))
        if len(pos) == 3:
            node = pos[2]
            if not (isinstance(node, NameNode) and node.name in self.c.dims):
                name = node.name if isinstance(node, NameNode) else None
                raise self.err("conv(h, x, L): the third argument names the filter's tap dim"
                               + (did_you_mean(name, self.c.dims) if name else ""), node.span)
            tap = node.name
            if tap not in h.shape:
                raise self.err(f"conv(h, x, {tap}): the filter has shape {_fmt(h.shape)}, without {tap}", node.span)
            if tap in x.shape:
                raise self.err(f"conv(h, x, {tap}): the input has the tap dim {tap} too; a tap dim runs along "
                               "time, so x cannot have it", node.span)
        else:
            extra = [d for d in h.shape if d not in x.shape]
            if len(extra) > 1:
                raise self.err(f"conv(h, x): the filter has dims {_fmt(extra)} that x lacks; name its tap dim, "
                               f"e.g. conv(h, x, {extra[0]})", n.span)
            tap = extra[0] if extra else None
        if tap is not None:
            why = self.varies(h)
            if why is not None:
                raise self.err(f"the filter of conv() has the tap dim {tap}, so it must be the same at every token, "
                               f"but it depends on {why}; a filter that changes with the token has no tap dim "
                               "(its taps run along time)", pos[0].span)
        shape = tuple(d for d in xc.order if (d in h.shape and d != tap) or d in x.shape)
        return shape, (h, x), tap

    def _mix(self, xc, pos):
        W = xc.check(pos[0])
        if T not in W.shape:
            raise self.err(f"mix(W, x): W must be a token-mixing matrix, an expression of a param declared "
                           f"[T, T, ...], but it has shape {_fmt(W.shape)}", pos[0].span)
        (x,) = self._values(xc, "mix", pos[1:], ("the input",))
        shape = tuple(d for d in xc.order if (d in W.shape and d != T) or d in x.shape)
        return shape, (W, x)

    def _attend(self, xc, n: CallNode, pos):
        q, k, v = self._values(xc, "attend", pos, ("q", "k", "v"))
        if set(q.shape) != set(k.shape):
            raise self.err(f"attend(q, k, v): q and k must have the same dims (q . k contracts them), but q is "
                           f"{_fmt(q.shape)} and k is {_fmt(k.shape)}", n.span)
        shared = [d for d in xc.order if d in q.shape and d in v.shape]
        if shared:
            raise self.err(f"attend(q, k, v): v shares dim {shared[0]} with q and k; the dims of v must differ from "
                           "the dims q . k contracts (declare another dim for the values, e.g. `dims K, V`)",
                           pos[2].span)
        return tuple(d for d in xc.order if d in v.shape), (q, k, v)

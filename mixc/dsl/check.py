"""Syntax tree -> MixerIR: resolve names, infer shapes by dimension name, check every rule.

Rules in the user's words; each error points at the offending text.
"""
from __future__ import annotations

import dataclasses
import keyword

from . import dim_functions, ir, scalar
from .dim_functions import DIM_FNS
from .functions import FUNCTIONS
from .errors import SpecError, Span, did_you_mean
from .parser import (KEYWORDS, BinNode, BoolNode, CallNode, CondNode, DimMapNode, KwargNode, NameNode,
                     Node, NumNode, SpecTree, Statement, UnaryNode)
from .const_check import ConstChecks
from .prev_check import PrevChecks
from .range_check import RangeChecks
from .sequence_check import SEQUENCE_FNS, SequenceChecks
# the names and limits (dsl/names.py), read here by the checks and re-exported for the tests
from .names import (BUILTIN_FNS, BUILTIN_NAMES, CALL_ARGUMENTS, DEPENDENCY_MODULES, ELEMENTWISE_FNS,  # noqa: F401
                    FIXED_KERNEL_ARGUMENTS, KERNEL_ARGUMENTS, MAX_DECLS, MAX_DEPTH_WITH_LETS, MAX_DIMS,
                    MAX_FIXED_DIM, MAX_RANK, MAX_UPDATE_SIZE, MINMAX_FNS, REDUCE_FNS, RESERVED, SPECIAL_FNS,
                    STABILIZER_STATE, python_modules)


def _union(shapes, order) -> ir.Shape:
    names = set().union(*map(set, shapes)) if shapes else set()
    return tuple(d for d in order if d in names)


def _fmt(shape) -> str:
    return "[" + ", ".join(shape) + "]"


def _a(what: str) -> str:
    """'an input', 'a dim': the article for a kind of declaration."""
    return ("an " if what[0] in "aeiou" else "a ") + what


class Checker:
    def __init__(self, tree: SpecTree):
        self.tree = tree
        self.source = tree.source
        self.dims: dict[str, ir.Dim] = {}
        self.inputs: dict[str, ir.TensorDecl] = {}
        self.params: dict[str, ir.TensorDecl] = {}
        self.options: dict[str, ir.Option] = {}
        self.lets: dict[str, ir.Let] = {}
        self.states: dict[str, ir.TensorDecl] = {}
        self.updates: dict[str, ir.Update] = {}
        self.output: ir.Output | None = None
        self.declared_at: dict[str, tuple[Span, str]] = {}     # name -> (where, what kind)
        self.let_depth: dict[str, int] = {}                     # nesting of a let with its lets written out
        self.option_defaults: dict[str, float] = {}             # number options whose default is a constant
        self.seq = SequenceChecks(self)                         # conv, mix, attend (sequence_check.py)
        self.ranges = RangeChecks(self)                         # `input beta[] in (0, 2)` (range_check.py)
        self.prev = PrevChecks(self)                            # prev(S), prev(x) of inputs (prev_check.py)
        self.consts = ConstChecks(self)                         # const W[E] = [...] (const_check.py)

    def error(self, msg: str, span: Span | None, notes=()) -> SpecError:
        return SpecError(msg, self.source, span, notes)

    def source_text(self, span: Span | None, limit: int = 40) -> str | None:
        """The text at span, quoted ('0 ** (0 - 1)'), or None where it spans lines or is long."""
        if span is None or span.line != span.end_line or span.end_column - span.column > limit:
            return None
        return "'" + self.source.line(span.line)[span.column - 1:span.end_column - 1] + "'"

    # ---- declarations ---------------------------------------------------------------

    def declare(self, named, what: str) -> None:
        name, span = named.name, named.span
        if name in RESERVED:
            if name in KEYWORDS:
                raise self.error(f"'{name}' is a keyword of the spec language and cannot be the name of "
                                 f"{_a(what)}", span)
            if name in BUILTIN_FNS or name in BUILTIN_NAMES:
                raise self.error(f"'{name}' is a built-in of the spec language and cannot be the name of "
                                 f"{_a(what)}", span)
            raise self.error(f"'{name}' is a reserved name and cannot be the name of {_a(what)}", span)
        if name.startswith("_"):
            raise self.error(f"names may not start with '_' (reserved for generated code): '{name}'", span)
        if name in self.declared_at:
            prev, prev_what = self.declared_at[name]
            raise self.error(f"'{name}' is already declared (as {_a(prev_what)} on line {prev.line})", span)
        if len(self.declared_at) >= MAX_DECLS:
            raise self.error(f"too many declarations (the limit is {MAX_DECLS})", span)
        self.declared_at[name] = (span, what)

    def shape_of(self, decl, what: str = "input") -> ir.Shape:
        seen = []
        for i, d in enumerate(decl.dims):
            if d.name == ir.POSITIONS:
                self.seq.position_dim(decl, i, what)
                seen.append(d.name)
                continue
            if d.name not in self.dims:
                raise self.error(f"unknown dim '{d.name}'{did_you_mean(d.name, self.dims)}", d.span,
                                 (f"declare it with: dims {', '.join([*self.dims, d.name])}",))
            if d.name in seen:
                raise self.error(f"dim '{d.name}' appears twice in the shape of '{decl.name.name}'", d.span)
            seen.append(d.name)
        if len(seen) > MAX_RANK:
            raise self.error(f"'{decl.name.name}' has {len(seen)} dims; the limit is {MAX_RANK}", decl.span)
        return tuple(seen)     # declared order: it is the layout the user passes and gets

    def run(self) -> ir.MixerIR:
        tree = self.tree
        mixer = tree.name
        if mixer.name in KEYWORDS or keyword.iskeyword(mixer.name) or mixer.name.startswith("_"):
            raise self.error(f"'{mixer.name}' cannot be a mixer name", mixer.span)
        if mixer.name in python_modules():
            raise self.error(f"mixer name '{mixer.name}' is the name of a Python module: the module that "
                             f"`mixc compile -o DIR` writes, named after the mixer, would hide '{mixer.name}' from "
                             "imports wherever DIR is on sys.path; choose another name", mixer.span)
        for st in tree.statements:
            getattr(self, f"stmt_{st.kind}")(st)
        self.prev.check_shifted()
        self.check_kernel_arguments()
        self.seq.check_mixer_kind()
        if not self.states and not self.seq.ops:
            raise self.error(f"mixer '{mixer.name}' declares no state; add e.g. `state S[K, V]` "
                             "and its `update`", mixer.span)
        for name, decl in self.states.items():
            if name not in self.updates:
                raise self.error(f"state '{name}' has no update; add `update {name} = ...`", decl.span)
        if self.output is None:
            raise self.error(f"mixer '{mixer.name}' has no output; add `output o = ...`", mixer.span)
        self.check_dims_bound()
        return ir.MixerIR(
            name=mixer.name, dims=tuple(self.dims.values()),
            inputs=tuple(self.inputs.values()) + self.prev.derived_inputs(),
            # the consts last (as the derived inputs are): params in the order a caller passes them
            params=tuple(sorted(self.params.values(), key=lambda p: p.name in self.consts.consts)), options=tuple(self.options.values()),
            lets=tuple(self.lets.values()), states=tuple(self.states.values()),
            updates=tuple(self.updates[s] for s in self.states), output=self.output,
            source=self.source, shifted=self.prev.shifted_inputs(), consts=tuple(self.consts.consts.values()))

    def check_kernel_arguments(self) -> None:
        """No two kernel arguments of generated code get the same name (see KERNEL_ARGUMENTS)."""
        decls = [(d.span, kind, d.name) for kind, table in (("input", self.inputs), ("param", self.params),
                                                             ("state", self.states)) for d in table.values()]
        decls += [(d.span, "input", d.name) for d in self.prev.derived_inputs()]
        taken = dict(FIXED_KERNEL_ARGUMENTS)
        for span, kind, name in sorted(decls, key=lambda x: (x[0].line, x[0].column)):
            for prefix, what in KERNEL_ARGUMENTS[kind]:
                arg, what = prefix + name, what.format(name)
                if arg in taken:
                    raise self.error(f"{what} and {taken[arg]} would have the same name in generated code "
                                     f"({arg}); rename {kind} '{name}'", span)
                taken[arg] = what

    def check_depth_with_lets(self, e: ir.Expr, span: Span) -> int:
        """The nesting of e with the lets it reads written out; refused beyond MAX_DEPTH_WITH_LETS,
        pointing at the let whose reading takes it there."""
        depth, ref = self._depth_with_lets(e)
        if depth > MAX_DEPTH_WITH_LETS:
            raise self.error(f"expression is nested too deeply with the lets it reads written out ({depth} levels "
                             f"of operators and calls through let '{ref.name}'; the limit is {MAX_DEPTH_WITH_LETS}); "
                             "shorten the chain of lets", ref.span or span)
        return depth

    def _depth_with_lets(self, e: ir.Expr) -> tuple[int, ir.Ref | None]:
        # Recursion is bounded: one expression nests at most parser.MAX_DEPTH levels, and a
        # let's own depth is looked up, not walked again.
        if isinstance(e, ir.Ref) and e.kind == "let":
            return self.let_depth[e.name], e
        deepest, ref = 0, None
        for child in ir.children(e):
            d, r = self._depth_with_lets(child)
            if d + 1 > deepest or (r is not None and ref is None and d + 1 == deepest):
                deepest, ref = d + 1, r
        return deepest, ref

    def check_dims_bound(self) -> None:
        """Every dim's size must come from some input or param (or be an alias of one)."""
        bound = {d for t in [*self.inputs.values(), *self.params.values()] for d in t.shape if d != ir.POSITIONS}
        for d in self.dims.values():
            root = d.name
            while self.dims[root].alias_of:
                root = self.dims[root].alias_of
            if self.dims[root].size is None and root not in bound and \
                    not any(self.dims[b].alias_of and self._root(b) == root for b in bound):
                raise self.error(f"the size of dim '{d.name}' is not given by any input or param; "
                                 f"use it in an input or param shape, or fix it: dims {d.name} = 2", d.span)

    def _root(self, name: str) -> str:
        while self.dims[name].alias_of:
            name = self.dims[name].alias_of
        return name

    def stmt_dims(self, st: Statement) -> None:
        for item in st.items:
            if item.name.name in ("B", "T", "H"):
                raise self.error(f"'{item.name.name}' names an axis of every call (B batch, T time, H heads) "
                                 "and cannot be a dim name", item.name.span)
            self.declare(item.name, "dim")
            alias = size = None
            if item.size is not None:
                size = self.fixed_dim_size(item)
            if item.alias is not None:
                if item.alias.name not in self.dims:
                    raise self.error(f"unknown dim '{item.alias.name}'{did_you_mean(item.alias.name, self.dims)}"
                                     " (an alias must name a dim declared before it)", item.alias.span)
                alias = item.alias.name
            self.dims[item.name.name] = ir.Dim(item.name.name, alias, item.name.span, size)
            if len(self.dims) > MAX_DIMS:
                raise self.error(f"too many dims (the limit is {MAX_DIMS})", item.name.span)

    def fixed_dim_size(self, item) -> int:
        """`dims E = 2`: a whole number from 1 to MAX_FIXED_DIM."""
        n = item.size
        if not n.value.is_integer() or not 1 <= n.value <= MAX_FIXED_DIM:
            raise self.error(f"the size of dim '{item.name.name}' must be a whole number from 1 to {MAX_FIXED_DIM}, "
                             f"not {n.text}", n.span)
        return int(n.value)

    def _tensors(self, st: Statement, table: dict, what: str) -> None:
        for item in st.items:
            self.declare(item.name, what)
            shape = self.shape_of(item, what)
            value_range = self.ranges.value_range(item.range, what, item.name.name) if item.range is not None else None
            table[item.name.name] = ir.TensorDecl(item.name.name, shape, item.name.span, value_range)

    def stmt_input(self, st):
        self._tensors(st, self.inputs, "input")

    def stmt_param(self, st):
        self._tensors(st, self.params, "param")

    def stmt_const(self, st: Statement) -> None:
        # a const is a param whose values the spec fixes (const_check.py): read as a param,
        # its kernel arguments (p_W, p_dp_W) taken as a param's
        for item in st.items:
            self.params[item.name.name] = self.consts.declare(item)

    def stmt_state(self, st):
        self._tensors(st, self.states, "state")

    def stmt_option(self, st: Statement) -> None:
        for b in st.items:
            if b.range is not None:
                self.ranges.refuse(b.range, "option")
            if isinstance(b.expr, BoolNode):
                opt = ir.Option(b.name.name, "bool", b.expr.value, b.name.span)
            else:
                e = self.expr(b.expr, "option", defining=b.name.name)
                if e.shape:
                    raise self.error(f"option '{b.name.name}' must be a scalar, but its default has shape "
                                     f"{_fmt(e.shape)}", b.expr.span)
                self.check_option_default(b.name.name, e)
                opt = ir.Option(b.name.name, "float", e, b.name.span)
            self.declare(b.name, "option")
            self.options[b.name.name] = opt

    def check_option_default(self, name: str, e: ir.Expr) -> None:
        """A default of numbers and constant options is evaluated here; one that reads a dim is
        evaluated when a call binds the dims (runtime/signature.py)."""
        try:
            self.option_defaults[name] = scalar.evaluate(e, values=self.option_defaults)
        except scalar.NotConstant:
            return
        except scalar.ScalarError as err:      # only through an option's default: constants failed earlier
            read = sorted(ir.refs(err.node, "option"))
            using = ", ".join(f"{o} = {self.option_defaults[o]:g}" for o in read)
            raise self.error(f"the default of option '{name}' {err.reason}"
                             + (f" with the defaults of the options it reads ({using})" if using else ""),
                             err.node.span or e.span) from None

    def stmt_let(self, st: Statement) -> None:
        for b in st.items:
            if b.range is not None:
                self.ranges.refuse(b.range, "let")
            e = self.expr(b.expr, "let", defining=b.name.name)     # before declaring: a let cannot read itself
            depth = self.check_depth_with_lets(e, b.expr.span)
            self.declare(b.name, "let")
            self.seq.note_let(b.name.name, e)
            self.let_depth[b.name.name] = depth
            self.lets[b.name.name] = ir.Let(b.name.name, e, b.name.span)

    def stmt_update(self, st: Statement) -> None:
        (b,) = st.items
        name = b.name.name
        self.consts.refuse_update(name, b.name.span)
        if name not in self.states:
            raise self.error(f"'{name}' is not a state{did_you_mean(name, self.states)}; declare it with "
                             f"`state {name}[...]` before its update", b.name.span)
        if name in self.updates:
            raise self.error(f"state '{name}' is updated twice (first on line {self.updates[name].span.line})",
                             b.name.span)
        e = self.expr(b.expr, "update", state=name)
        self.check_depth_with_lets(e, b.expr.span)
        self.check_update_size(e, name)
        want = self.states[name].shape
        if set(e.shape) != set(want):
            raise self.error(f"update of {name} has shape {_fmt(e.shape)} but {name} is {_fmt(want)}", b.expr.span)
        self.updates[name] = ir.Update(name, e, b.name.span)

    def read_in_update(self, name: str, span: Span) -> ir.Expr:
        """State `name` read by another state's update, as a program reads it: its new value where
        its update came before (that update's expression, written out), else its previous value.
        In the IR an update reads only previous values (every state it names, as `X` or
        prev(X), is X_{t-1}): the updates of a token are simultaneous, and every later stage (the
        reference, the kernels, the classes) takes them in any order. The new value written out
        keeps the earlier update's own nodes, so the kernels compute it once."""
        upd = self.updates.get(name)
        if upd is None:
            return ir.Prev(self.states[name].shape, span, name)
        return dataclasses.replace(upd.expr, span=span)     # spanned where read: errors quote the name written

    def check_update_size(self, e: ir.Expr, name: str) -> None:
        """An update with the new values it reads written out stays within MAX_UPDATE_SIZE
        operations (counted over the shared trees without walking them again)."""
        sizes: dict[int, int] = {}

        def size(x: ir.Expr) -> int:
            if id(x) not in sizes:
                sizes[id(x)] = 1 + sum(size(k) for k in ir.children(x))
            return sizes[id(x)]
        if size(e) > MAX_UPDATE_SIZE:
            raise self.error(f"the update of {name} is {size(e)} operations with the new values of the states it "
                             f"reads written out (the limit is {MAX_UPDATE_SIZE}); where the previous value of a state will do, read it "
                             "as prev(X)", e.span)

    def stmt_output(self, st: Statement) -> None:
        (b,) = st.items
        if self.output is not None:
            raise self.error(f"a mixer has one output; '{self.output.name}' was declared on line "
                             f"{self.output.span.line}", b.name.span)
        self.declare(b.name, "output")
        e = self.expr(b.expr, "output", defining=b.name.name)
        self.check_depth_with_lets(e, b.expr.span)
        if not ir.refs(e, "state") and not self.seq.uses_sequence(e):
            if self.seq.ops:
                raise self.error(f"output '{b.name.name}' uses no sequence op (conv, mix, attend) and reads no "
                                 "state", b.expr.span)
            raise self.error(f"output '{b.name.name}' does not read any state", b.expr.span)
        self.seq.check_output(b.name.name, e, b.expr.span)
        self.output = ir.Output(b.name.name, e, b.name.span)

    # ---- expressions ----------------------------------------------------------------

    def expr(self, node: Node, ctx: str, state: str | None = None, defining: str | None = None) -> ir.Expr:
        """Type one expression. ctx: option | let | update | output (what may be read)."""
        return _ExprChecker(self, ctx, state, defining).check(node)


class _ExprChecker:
    def __init__(self, checker: Checker, ctx: str, state: str | None, defining: str | None):
        self.c = checker
        self.defining = defining
        self.ctx = ctx
        self.state = state
        self.order = list(checker.dims) + [ir.POSITIONS]     # T last: the source positions of a [T, T] row
        self.consts: dict[int, tuple[ir.Expr, float]] = {}   # id of a number-only node -> (it, its value)

    def err(self, msg, span, notes=()):
        return self.c.error(msg, span, notes)

    def check(self, node: Node) -> ir.Expr:
        m = getattr(self, "node_" + type(node).__name__)
        e = m(node)
        self.fold(e)
        return e

    def fold(self, e: ir.Expr) -> None:
        """Evaluate e when it is made of numbers only (its children were folded before it), and
        refuse it at its place when it has no finite real value: 0 ** (0 - 1), log(0),
        sqrt(-1), 10 ** 10 ** 10 would otherwise reach the kernels as inf or NaN."""
        kids = ir.children(e)
        if not isinstance(e, (ir.Num, ir.Neg, ir.BinOp, ir.Call)) or \
                not all(self.consts.get(id(k), (None,))[0] is k for k in kids):
            return
        if isinstance(e, ir.Call) and e.fn not in scalar.FUNCTIONS and e.fn not in MINMAX_FNS:
            return
        try:
            self.consts[id(e)] = (e, scalar.apply(e, [self.consts[id(k)][1] for k in kids]))
        except scalar.ScalarError as err:
            text = self.c.source_text(e.span)
            raise self.err(f"{text} {err.reason}" if text else f"this expression {err.reason}", e.span) from None

    # leaves
    def node_NumNode(self, n: NumNode) -> ir.Expr:
        if n.value != n.value or n.value in (float("inf"),):
            # The span shows the whole number; the message quotes at most its start.
            text = n.text if len(n.text) <= 24 else n.text[:20] + "..."
            raise self.err(f"number '{text}' is out of range", n.span)
        return ir.Num((), n.span, n.value)

    def node_BoolNode(self, n: BoolNode) -> ir.Expr:
        raise self.err("true and false may only be the default of an option (`option flag = false`); "
                       "use `if flag then a else b` to choose between expressions", n.span)

    def node_NameNode(self, n: NameNode) -> ir.Expr:
        c, name = self.c, n.name
        if name in c.dims:
            return ir.Ref((), n.span, name, "dim")
        if name == "head":
            if self.ctx == "option":
                raise self.err("an option's default cannot depend on the head index", n.span)
            return ir.Ref((), n.span, name, "head")
        if name in c.options:
            opt = c.options[name]
            if opt.kind == "bool":
                raise self.err(f"'{name}' is a flag (true/false); use it as `if {name} then a else b`", n.span)
            return ir.Ref((), n.span, name, "option")
        if self.ctx == "option":
            if name in c.inputs or name in c.params or name in c.lets or name in c.states:
                raise self.err(f"an option's default may use only numbers, dims and earlier options, "
                               f"not '{name}'", n.span)
        for table, kind in ((c.inputs, "input"), (c.params, "param")):
            if name in table:
                shape = table[name].shape
                if shape[:1] == (ir.POSITIONS,):      # one value per position: per token, as an input
                    shape = shape[1:]
                return ir.Ref(shape, n.span, name, kind)
        if name in c.lets:
            return ir.Ref(c.lets[name].expr.shape, n.span, name, "let")
        if name in c.states:
            if self.ctx == "let":
                raise self.err(f"a let cannot read state '{name}': lets are computed per token from inputs, "
                               "params and options; read states in an update or the output", n.span)
            if self.ctx == "update" and name != self.state:
                return c.read_in_update(name, n.span)
            return ir.Ref(c.states[name].shape, n.span, name, "state")
        if name in BUILTIN_FNS:
            raise self.err(f"'{name}' is a function; call it as {name}(...)", n.span)
        known = [*c.dims, *c.inputs, *c.params, *c.options, *c.lets, *c.states, "head"]
        if name == self.defining:
            raise self.err(f"{self.ctx} '{name}' refers to itself", n.span)
        line, kind = self._declaration(name)
        if kind == "output":
            # The output is what the mixer returns; nothing inside the spec can read it.
            raise self.err(f"'{name}' is the output of the mixer; nothing in the spec can read it", n.span)
        if line is not None and name not in c.declared_at:
            raise self.err(f"'{name}' is used before it is declared (on line {line})", n.span)
        raise self.err(f"unknown name '{name}'{did_you_mean(name, known)}", n.span)

    def _declaration(self, name: str) -> tuple[int | None, str | None]:
        """Where and as what `name` is declared anywhere in the spec (updates declare nothing)."""
        for st in self.c.tree.statements:
            for item in st.items:
                nm = getattr(item, "name", None)
                if st.kind != "update" and getattr(nm, "name", None) == name:
                    return nm.span.line, st.kind
        return None, None

    # operators
    def node_UnaryNode(self, n: UnaryNode) -> ir.Expr:
        x = self.check(n.x)
        return ir.Neg(x.shape, n.span, x)

    def node_BinNode(self, n: BinNode) -> ir.Expr:
        a, b = self.check(n.left), self.check(n.right)
        if n.op == "@":
            shared = tuple(d for d in self.order if d in a.shape and d in b.shape)
            if not shared:
                raise self.err(f"'@' contracts shared dims, but the left side has shape {_fmt(a.shape)} and "
                               f"the right side {_fmt(b.shape)}; use '*' for an outer product", n.span)
            out = tuple(d for d in _union([a.shape, b.shape], self.order) if d not in shared)
            return ir.Contract(out, n.span, a, b, shared)
        if n.op == "**" and b.shape:
            raise self.err(f"the exponent of '**' must be a scalar, but it has shape {_fmt(b.shape)}", n.right.span)
        if n.op == "**" and isinstance(a, ir.Num) and a.value <= 0 and not isinstance(b, ir.Num):
            # d/db a ** b = a ** b * log(a): no real value for a number <= 0
            self.fold(ir.BinOp((), n.span, "**", a, b))     # 0 ** (0 - 1): say that it divides by zero
            raise self.err(f"a power of {a.value:g} takes a plain number as its exponent (its derivative in the "
                           "exponent needs the log of the base); write e.g. 0 ** 2, or a positive base", n.span)
        return ir.BinOp(_union([a.shape, b.shape], self.order), n.span, n.op, a, b)

    def node_CondNode(self, n: CondNode) -> ir.Expr:
        opt = self.c.options.get(n.flag)
        if opt is None or opt.kind != "bool":
            what = "a number option" if opt is not None else "not an option"
            flags = [o for o in self.c.options.values() if o.kind == "bool"]
            hint = did_you_mean(n.flag, [o.name for o in flags])
            raise self.err(f"'{n.flag}' after 'if' must be a flag declared as `option {n.flag} = false`, "
                           f"but it is {what}{hint}", n.flag_span)
        a, b = self.check(n.then), self.check(n.otherwise)
        if set(a.shape) != set(b.shape):
            raise self.err(f"the branches of this if have shapes {_fmt(a.shape)} and {_fmt(b.shape)}; "
                           "they must be equal", n.span)
        return ir.Cond(_union([a.shape, b.shape], self.order), n.span, n.flag, a, b)

    def node_DimMapNode(self, n: DimMapNode) -> ir.Expr:
        raise self.err("'A -> B' may only appear as an argument of rename(x, A -> B)", n.span)

    def node_KwargNode(self, n: KwargNode) -> ir.Expr:
        raise self.err(f"'{n.name}=...' may only appear as an argument of conv, mix or attend", n.span)

    def node_CallNode(self, n: CallNode) -> ir.Expr:
        fn = n.fn
        if fn in SEQUENCE_FNS:
            return self.c.seq.call(self, n)
        if fn in DIM_FNS:
            return dim_functions.check_call(self, n)
        kw = next((a for a in n.args if isinstance(a, KwargNode)), None)
        if kw is not None and fn in BUILTIN_FNS:
            raise self.err(f"{fn}() takes no '{kw.name}=' argument; only conv, mix and attend take "
                           "arguments by name", kw.span)
        if fn == "prev":
            return self.call_prev(n)
        if fn == "rename":
            return self.call_rename(n)
        if fn in ELEMENTWISE_FNS:
            if len(n.args) != ELEMENTWISE_FNS[fn]:
                raise self.err(f"{fn}() takes {ELEMENTWISE_FNS[fn]} argument, got {len(n.args)}", n.span)
            x = self.check(n.args[0])
            return ir.Call(x.shape, n.span, fn, (x,))
        if fn in REDUCE_FNS or fn in MINMAX_FNS:
            if len(n.args) < 2:
                raise self.err(f"{fn}() takes a value and the dims to reduce over, e.g. {fn}(x, K)"
                               + ("; or two values: max(a, b)" if fn in MINMAX_FNS else ""), n.span)
            dims_args = n.args[1:]
            is_reduction = all(isinstance(a, NameNode) and a.name in self.c.dims for a in dims_args)
            if fn in MINMAX_FNS and not is_reduction:
                if len(n.args) != 2:
                    raise self.err(f"{fn}() takes two values, {fn}(a, b), or a value and dims, {fn}(x, K)", n.span)
                a, b = self.check(n.args[0]), self.check(n.args[1])
                return ir.Call(_union([a.shape, b.shape], self.order), n.span, fn, (a, b))
            x = self.check(n.args[0])
            over_t = self.dims_of(fn, x, dims_args, "reduces over dims")
            return ir.Reduce(tuple(d for d in x.shape if d not in over_t), n.span, fn, x, over_t)
        known = BUILTIN_FNS
        raise self.err(f"unknown function '{fn}'{did_you_mean(fn, known)}", n.fn_span,
                       ("functions: " + ", ".join(sorted(known)),))

    def dims_of(self, fn: str, x: ir.Expr, args, what: str) -> ir.Shape:
        """The dims named by a reduction's (or a function over dims') arguments after x: each a
        dim of x, once; in the spec's dim order."""
        over = []
        for a in args:
            if not (isinstance(a, NameNode) and a.name in self.c.dims):
                name = a.name if isinstance(a, NameNode) else None
                hint = did_you_mean(name, self.c.dims) if name else ""
                raise self.err(f"{fn}() {what}: expected a dim name here{hint}", a.span)
            if a.name not in x.shape:
                raise self.err(f"{fn}() over {a.name}, but its argument has shape {_fmt(x.shape)}", a.span)
            if a.name in over:
                raise self.err(f"{fn}() names dim {a.name} twice", a.span)
            over.append(a.name)
        return tuple(d for d in self.order if d in over)

    def call_prev(self, n: CallNode) -> ir.Expr:
        return self.c.prev.call(self, n)

    def call_rename(self, n: CallNode) -> ir.Expr:
        if len(n.args) < 2 or not all(isinstance(a, DimMapNode) for a in n.args[1:]):
            raise self.err("rename() takes a value and dim maps, e.g. rename(q, K -> J)", n.span)
        x = self.check(n.args[0])
        mapping, out = [], list(x.shape)
        for m in n.args[1:]:
            for nm, sp in ((m.src, m.src_span), (m.dst, m.dst_span)):
                if nm not in self.c.dims:
                    raise self.err(f"unknown dim '{nm}'{did_you_mean(nm, self.c.dims)}", sp)
            if m.src not in x.shape:
                raise self.err(f"rename() of dim {m.src}, but the value has shape {_fmt(x.shape)}", m.src_span)
            if m.dst in out and m.dst != m.src:
                raise self.err(f"rename() to dim {m.dst}, which the value already has", m.dst_span)
            if self.c._root(m.src) != self.c._root(m.dst):
                raise self.err(f"rename() from {m.src} to {m.dst}: the dims must have the same size; declare "
                               f"`dims {m.dst} = {m.src}`", m.dst_span)
            out[out.index(m.src)] = m.dst
            mapping.append((m.src, m.dst))
        return ir.Rename(_union([tuple(out)], self.order), n.span, x, tuple(mapping))


def check(tree: SpecTree) -> ir.MixerIR:
    return Checker(tree).run()

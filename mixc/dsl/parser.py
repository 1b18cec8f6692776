"""Text -> syntax tree (untyped). Lark does the parsing; its errors become SpecErrors in
the user's words (never a terminal name such as RSQB or $END)."""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import lark
from lark import Lark, Token, Tree

from .errors import Source, Span, SpecError

MAX_SPEC_CHARS = 100_000
MAX_DEPTH = 64          # nesting of expressions; deeper specs are refused, not recursed into
MAX_NAME = 64

KEYWORDS = ("mixer", "dims", "input", "param", "const", "option", "let", "state", "update",
            "output", "if", "then", "else", "true", "false", "in")


# ---- untyped syntax tree -------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    span: Span


@dataclass(frozen=True)
class NumNode(Node):
    value: float
    text: str


@dataclass(frozen=True)
class BoolNode(Node):
    value: bool


@dataclass(frozen=True)
class NameNode(Node):
    name: str


@dataclass(frozen=True)
class UnaryNode(Node):
    op: str
    x: Node


@dataclass(frozen=True)
class BinNode(Node):
    op: str            # + - * / ** @
    left: Node
    right: Node


@dataclass(frozen=True)
class CallNode(Node):
    fn: str
    fn_span: Span
    args: tuple[Node, ...]


@dataclass(frozen=True)
class DimMapNode(Node):
    src: str
    dst: str
    src_span: Span
    dst_span: Span


@dataclass(frozen=True)
class KwargNode(Node):
    """NAME=value, an argument of a sequence op: conv(h, x, causal=false)."""

    name: str
    name_span: Span
    value: Node


@dataclass(frozen=True)
class CondNode(Node):
    flag: str
    flag_span: Span
    then: Node
    otherwise: Node


@dataclass(frozen=True)
class Named:
    """A declared name with where it was declared."""

    name: str
    span: Span


@dataclass(frozen=True)
class DimDecl:
    name: Named
    alias: Named | None
    size: NumNode | None = None        # `dims E = 2`: a size the spec fixes


@dataclass(frozen=True)
class RangeNode:
    """`in [lower, upper]` after a declaration; an end is closed ('[', ']') or open ('(', ')')."""

    lower: Node
    upper: Node
    lower_closed: bool
    upper_closed: bool
    span: Span


@dataclass(frozen=True)
class TensorDeclNode:
    name: Named
    dims: tuple[Named, ...]
    span: Span
    range: RangeNode | None = None


@dataclass(frozen=True)
class ListNode(Node):
    """`[a, b, ...]`: the values of a const along one dim (only in a const's value)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class ConstDeclNode:
    """`const W[E] = [0.5, 1.0]`: value is a ListNode per dim (an expression for a scalar)."""

    name: Named
    dims: tuple[Named, ...]
    value: Node
    span: Span


@dataclass(frozen=True)
class Binding:
    name: Named
    expr: Node
    span: Span
    range: RangeNode | None = None     # only to refuse it at its place: lets and options take none


@dataclass(frozen=True)
class Statement:
    kind: str          # dims input param const option let state update output
    items: tuple       # DimDecl / TensorDeclNode / ConstDeclNode / Binding
    span: Span


@dataclass(frozen=True)
class SpecTree:
    name: Named
    statements: tuple[Statement, ...]
    source: Source


# ---- lark ---------------------------------------------------------------------------

class _KeywordAsName(Exception):
    """A keyword where only a name fits (the lexer then reads it as a name)."""

    def __init__(self, token: Token):
        super().__init__(str(token))
        self.token = token


def _refuse_keyword(tok: Token) -> Token:
    # The contextual lexer reads a keyword as a NAME where the keyword cannot come next
    # (`1 + if f ...`, `input state[K]`, a statement after a dangling `+`). Every such case
    # is a mistake; catching it here points at the keyword itself, not at the token after.
    if tok.value in KEYWORDS:
        raise _KeywordAsName(tok)
    return tok


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = (Path(__file__).parent / "mix.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False,
                lexer_callbacks={"NAME": _refuse_keyword})


def _tok_span(tok: Token) -> Span:
    end_line = tok.end_line if tok.end_line is not None else tok.line
    end_col = tok.end_column if tok.end_column is not None else tok.column + len(tok)
    return Span(tok.line, tok.column, end_line, end_col)


def _tree_span(tree: Tree) -> Span:
    m = tree.meta
    if getattr(m, "empty", True):
        return Span(1, 1, 1, 2)
    return Span(m.line, m.column, m.end_line, m.end_column)


STATEMENT_KEYWORDS = ("dims", "input", "param", "const", "option", "let", "state", "update", "output")
_OPERATORS = ("+", "-", "*", "/", "@", "**")
_EXPR_START = {"a name", "a number", "'('", "'-'"}


def _describe_terminal(name: str) -> str:
    if name == "$END":
        return "end of file"
    if name == "NAME":
        return "a name"
    if name == "NUMBER":
        return "a number"
    for term in _lark().terminals:
        if term.name == name and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return "a token"            # a regex terminal without a user word; never lark's own name


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _expected(names) -> str:
    """'expected ...' in user words; groups of terminals are named as a whole."""
    words = {_describe_terminal(n) for n in names}
    out = []
    if _EXPR_START <= words:
        words -= _EXPR_START | {"'true'", "'false'", "'if'"}
        out.append("an expression")
    ops = {f"'{o}'" for o in _OPERATORS}
    if len(words & ops) >= 3:
        # after an expression: a range (`in [0, 1]`) may follow only a let's or option's, which
        # take none (the checker says so where one is written); naming it here would mislead
        words -= ops | {"'in'"}
        out.append("an operator (" + " ".join(_OPERATORS) + ")")
    stmts = {f"'{k}'" for k in STATEMENT_KEYWORDS}
    if stmts <= words:
        # After a complete statement the file may also end; saying so adds nothing.
        words -= stmts | {"end of file"}
        out.append("a new statement (" + ", ".join(STATEMENT_KEYWORDS) + ")")
    out = sorted(words) + out
    return "expected " + _join(out) if out else ""


def _unexpected_character(err: lark.exceptions.UnexpectedCharacters, source: Source) -> SpecError:
    text, pos = source.text, err.pos_in_stream
    ch = text[pos] if pos < len(text) else "?"
    if ch == ">" and pos > 0 and text[pos - 1] == "-":
        return SpecError("'->' may only appear in rename(x, A -> B)", source,
                         Span(err.line, err.column - 1, err.line, err.column + 1))
    return _unexpected_character_at(source, err.line, err.column, ch)


def _unexpected_character_at(source: Source, line: int, column: int, ch: str) -> SpecError:
    span = Span.point(line, column)
    mark = unicodedata.category(ch).startswith("M")     # a combining mark, drawn onto its neighbour
    if not ch.isprintable() or mark:    # invisible in the message: name it by its code point
        what = f"U+{ord(ch):04X}"
    elif ch == "'":
        what = "\"'\""
    else:
        what = f"'{ch}'"
    msg = f"unexpected character {what}"
    if ch.isdigit():            # a digit of another script: numbers are written with 0-9 only
        msg += " (numbers are written with the ASCII digits 0-9)"
    elif ch.isalnum() or mark:    # a letter, digit or accent outside ASCII, in what was meant as a name
        msg += " (names are ASCII letters, digits and _)"
    notes = ()
    if not ch.isascii():
        # Say which character it is: a Cyrillic 'а' or a Greek 'ο' looks like the ASCII letter.
        # Lower case: the names of characters are not words of the language.
        name = unicodedata.name(ch, "").lower() or "unassigned"
        notes = (f"{what}: {name}" if what.startswith("U+") else f"{what} is U+{ord(ch):04X} ({name}), not ASCII",)
    return SpecError(msg, source, span, notes)


def _unexpected_token(err: lark.exceptions.UnexpectedToken, source: Source) -> SpecError:
    tok = err.token
    # The parser's own `expected` is a superset (LALR merges states); ask it which tokens
    # it would really accept here.
    try:
        accepted = err.interactive_parser.accepts()
    except Exception:           # the precise set is a nicety: fall back to the coarse one
        accepted = err.expected
    exp = _expected(accepted)
    if tok.type == "$END":
        return SpecError("unexpected end of file" + (f"; {exp}" if exp else ""), source, source.end())
    return SpecError(f"unexpected '{tok.value}'" + (f"; {exp}" if exp else ""), source, _tok_span(tok))


def _keyword_as_name(tok: Token, source: Source) -> SpecError:
    # `1 + if f then a else b` reads as the keyword in a name's place; say what was meant.
    if tok.value == "if" and re.match(r"\s+[A-Za-z_]\w*\s+then\b", source.text[tok.end_pos:]):
        msg = "an if-expression inside another expression needs parentheses: (if FLAG then a else b)"
    else:
        msg = f"'{tok.value}' is a keyword of the spec language and cannot be used as a name"
    return SpecError(msg, source, _tok_span(tok))


def _syntax_error(err: lark.exceptions.LarkError, source: Source) -> SpecError:
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        return _unexpected_character(err, source)
    if isinstance(err, lark.exceptions.UnexpectedToken):
        return _unexpected_token(err, source)
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        exp = _expected(err.expected)
        return SpecError("unexpected end of file" + (f"; {exp}" if exp else ""), source, source.end())
    return SpecError("cannot parse the spec", source, Span.point(1, 1))


# Rules that nest an expression one level deeper (leaves and parentheses do not count).
_NESTING_RULES = frozenset({"add", "sub", "mul", "div", "matmul", "pow", "neg", "call", "cond"})


def _check_depth(tree: Tree, source: Source) -> None:
    """Refuse expressions nested deeper than MAX_DEPTH, before anything recurses into them."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if node.data in _NESTING_RULES:
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"expression is nested too deeply (more than {MAX_DEPTH} levels of operators "
                                "and calls; a chain a + b + c + ... adds a level per operator); "
                                "split it with `let`", source, _tree_span(node))
        stack.extend((child, depth) for child in node.children if isinstance(child, Tree))


# Bidirectional embedding, override and isolate controls (the ones rustc refuses). Outside a
# comment nothing accepts them anyway; inside one they can make a line display differently
# from how it is read ("Trojan Source", CVE-2021-42574), so they are refused everywhere.
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def _refuse_bidi_controls(source: Source) -> None:
    m = _BIDI_CONTROLS.search(source.text)
    if m:
        pos = m.start()
        line_start = source.text.rfind("\n", 0, pos) + 1
        span = Span.point(source.text.count("\n", 0, pos) + 1, pos - line_start + 1)
        raise SpecError(f"bidirectional control character U+{ord(m.group()):04X}: it can make the text display "
                        "differently from how it is read; remove it", source, span)


def _refuse_non_ascii_digits(source: Source) -> None:
    """A digit of another script outside a comment is refused at itself, before lexing: in
    `1e\u0663` the parser would otherwise stop at the `e` it cannot place, not at the digit."""
    for number, line in enumerate(source.text.split("\n"), 1):
        code = line.split("#", 1)[0]        # no token of the language holds '#': the rest is a comment
        if code.isascii():
            continue
        for col, ch in enumerate(code, 1):
            if not ch.isascii() and ch.isdigit():
                raise _unexpected_character_at(source, number, col, ch)


def parse_tree(text: str, filename: str = "<spec>") -> SpecTree:
    source = Source(text, filename)
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"spec is too long ({len(text)} characters; the limit is {MAX_SPEC_CHARS})",
                        source, None)
    _refuse_bidi_controls(source)
    _refuse_non_ascii_digits(source)
    try:
        tree = _lark().parse(text)
    except _KeywordAsName as err:
        raise _keyword_as_name(err.token, source) from None
    except lark.exceptions.LarkError as err:
        raise _syntax_error(err, source) from None
    _check_depth(tree, source)
    return _Builder(source).spec(tree)


# ---- lark tree -> syntax tree (iterative where depth matters) --------------------------

_BINOPS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "matmul": "@", "pow": "**"}


class _Builder:
    def __init__(self, source: Source):
        self.source = source

    def named(self, tok: Token) -> Named:
        if len(tok) > MAX_NAME:
            raise SpecError(f"name is too long ({len(tok)} characters; the limit is {MAX_NAME})",
                            self.source, _tok_span(tok))
        return Named(str(tok), _tok_span(tok))

    def spec(self, tree: Tree) -> SpecTree:
        header, *stmts = tree.children
        name = self.named(header.children[0])
        return SpecTree(name, tuple(self.statement(s) for s in stmts), self.source)

    def statement(self, t: Tree) -> Statement:
        kind = t.data.removesuffix("_stmt")
        span = _tree_span(t)
        if kind == "dims":
            items = tuple(self.dim_decl(d) for d in t.children)
        elif kind in ("input", "param", "state"):
            items = tuple(self.tensor_decl(d) for d in t.children)
        elif kind == "const":
            items = tuple(self.const_decl(d) for d in t.children)
        elif kind in ("option", "let"):
            items = tuple(Binding(self.named(b.children[0]), self.expr(b.children[1]), _tree_span(b),
                                  self.value_range(b.children[2]) if len(b.children) > 2 else None)
                          for b in t.children)
        else:  # update, output
            name_tok, expr = t.children
            items = (Binding(self.named(name_tok), self.expr(expr), span),)
        return Statement(kind, items, span)

    def dim_decl(self, t: Tree) -> DimDecl:
        name, *rest = t.children
        if not rest:
            return DimDecl(self.named(name), None)
        if rest[0].type == "NUMBER":
            return DimDecl(self.named(name), None, NumNode(_tok_span(rest[0]), float(rest[0]), str(rest[0])))
        return DimDecl(self.named(name), self.named(rest[0]))

    def const_decl(self, t: Tree) -> ConstDeclNode:
        name_tok, dim_list, value = t.children
        return ConstDeclNode(self.named(name_tok), tuple(self.named(d) for d in dim_list.children),
                             self.const_value(value), _tree_span(t))

    def const_value(self, t) -> Node:
        """A const's value: nested lists of expressions. Nesting is bounded by the checker (a
        list per dim, at most MAX_RANK), but a hostile spec may nest lists deeper: walked
        without recursion, as expressions are."""
        done: dict[int, Node] = {}
        stack = [(t, False)]
        while stack:
            node, visited = stack.pop()
            if node.data != "const_list":
                done[id(node)] = self.expr(node)
            elif not visited:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children if c is not None)
            else:
                done[id(node)] = ListNode(_tree_span(node), tuple(done[id(c)] for c in node.children
                                                                  if c is not None))
        return done[id(t)]

    def tensor_decl(self, t: Tree) -> TensorDeclNode:
        name_tok, dim_list, *value_range = t.children
        return TensorDeclNode(self.named(name_tok), tuple(self.named(d) for d in dim_list.children),
                              _tree_span(t), self.value_range(value_range[0]) if value_range else None)

    def value_range(self, t: Tree) -> RangeNode:
        opening, lower, upper, closing = t.children
        return RangeNode(self.expr(lower), self.expr(upper), opening.children[0] == "[",
                         closing.children[0] == "]", _tree_span(t))

    def expr(self, t) -> Node:
        # Post-order without recursion: depth was bounded already, but a long flat chain
        # (a + b + c + ...) still nests left-deep.
        done: dict[int, Node] = {}
        stack = [(t, False)]
        while stack:
            node, visited = stack.pop()
            if not visited:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children if isinstance(c, Tree))
                continue
            done[id(node)] = self.build(node, done)
        return done[id(t)]

    def build(self, t: Tree, done) -> Node:
        span = _tree_span(t)
        kids = t.children
        if t.data == "number":
            text = str(kids[0])
            return NumNode(span, float(text), text)
        if t.data == "name":
            return NameNode(span, self.named(kids[0]).name)
        if t.data in ("true", "false"):
            return BoolNode(span, t.data == "true")
        if t.data == "neg":
            return UnaryNode(span, "-", done[id(kids[0])])
        if t.data in _BINOPS:
            return BinNode(span, _BINOPS[t.data], done[id(kids[0])], done[id(kids[1])])
        if t.data == "call":
            fn = self.named(kids[0])
            args = tuple(done[id(a)] for a in kids[1:] if a is not None)
            return CallNode(span, fn.name, fn.span, args)
        if t.data == "dim_map":
            src, dst = self.named(kids[0]), self.named(kids[1])
            return DimMapNode(span, src.name, dst.name, src.span, dst.span)
        if t.data == "kwarg":
            key = self.named(kids[0])
            return KwargNode(span, key.name, key.span, done[id(kids[1])])
        if t.data == "cond":
            flag = self.named(kids[0])
            return CondNode(span, flag.name, flag.span, done[id(kids[1])], done[id(kids[2])])
        raise SpecError(f"unsupported construct '{t.data}'", self.source, span)

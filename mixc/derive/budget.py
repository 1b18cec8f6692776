"""The derivation's budget: a spec inside the language's limits can still ask sympy for more
than it can give (a decay whose written-out form has millions of nodes, an algebra that takes
minutes). derive() checks the time spent and the size of each expression after every step,
and a spec past either gets a SpecError at the line it was deriving, not a hang.

MIXC_DERIVE_SECONDS sets the time (default 60 s: the library derives in well under 1 s each)."""
from __future__ import annotations

import math
import os
import time

import sympy as sp

from ..dsl import ir
from ..dsl.errors import SpecError, Span
from .symbolic import tree_size

DERIVE_SECONDS = 60.0
# Nodes of one derived expression written out as a tree: lets past LET_INLINE_MAX_NODES are
# kept as symbols, so a spec within the language's limits stays far below this.
MAX_EXPR_NODES = 200_000


def env_seconds() -> float:
    """MIXC_DERIVE_SECONDS, checked: a finite number >= 0 (0 refuses every derivation, as the
    tests use it); `abc` was float()'s bare ValueError, which named no variable."""
    text = os.environ.get("MIXC_DERIVE_SECONDS")
    if text is None:
        return DERIVE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise ValueError(f"MIXC_DERIVE_SECONDS: expected a number of seconds >= 0, got {text!r}")
    return value


class Budget:
    def __init__(self, mixer: ir.MixerIR, seconds: float | None = None):
        self.mixer = mixer
        if seconds is None:
            seconds = env_seconds()
        self.seconds = seconds
        self.start = time.perf_counter()
        self.memo: dict = {}

    def check(self, span: Span | None, what: str, *exprs: sp.Expr | None) -> None:
        """After deriving `what` (written at span): within the time, and its expressions
        within MAX_EXPR_NODES."""
        for e in exprs:
            if e is None:
                continue
            n = tree_size(e, self.memo)
            if n > MAX_EXPR_NODES:
                raise SpecError(f"the derivation grew too large at {what}: an expression written out has {n:,} "
                                f"nodes (the limit is {MAX_EXPR_NODES:,}); simplify it or read its lets fewer times",
                                self.mixer.source, span)
        spent = time.perf_counter() - self.start
        if spent > self.seconds:
            raise SpecError(f"deriving the spec took more than its budget of {self.seconds:g} s (it was at {what} "
                            f"after {spent:.1f} s); simplify this expression or split it with `let` "
                            "(MIXC_DERIVE_SECONDS sets the budget)", self.mixer.source, span)

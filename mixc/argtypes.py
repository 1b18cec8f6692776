"""argparse types for the command line: a bad number is refused by argparse with the option's
name and what it expects (`mixc run: error: argument --T: expected a whole number >= 1, got
'0'`), before any work starts."""
from __future__ import annotations

import argparse


def _int(text: str, least: int, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
    if value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"from {least} to {most}"
        raise argparse.ArgumentTypeError(f"expected a whole number {bound}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    return _int(text, 0)


def positive_ints(text: str) -> tuple[int, ...]:
    """'64,128' -> (64, 128): one or more whole numbers >= 1, comma-separated."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    out = []
    for p in parts:
        try:
            out.append(_int(p, 1))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r} "
                                             f"({p!r})") from None
    return tuple(out)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value

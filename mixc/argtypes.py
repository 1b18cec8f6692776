"""argparse types for the command line: a bad number is refused by argparse with the option's
name and what it expects (`mixc run: error: argument --T: expected a whole number >= 1, got
'0'`), before any work starts. Also the help formatter every command uses (defaults shown) and
the hint the commands print where a plot needs matplotlib."""
from __future__ import annotations

import argparse

# how to get the plots of `mixc bench`, `mixc recall` and the examples: mixc is installed from its
# repository (README's first line), so the extra goes with -e from the checkout, not from an index
PLOT_HINT = "pip install -e '.[bench]' in mixc's checkout"


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


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default after its help, as argparse's
    ArgumentDefaultsHelpFormatter writes it, except where the help already says it (a "default"
    in its text) or there is none to say (None, False: an option that is off unless given); a
    tuple default is written as the comma-separated text the option takes (`32,64`)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("default" in text or d is None or d is False or d is argparse.SUPPRESS or not action.option_strings
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        shown = ",".join(str(x) for x in d) if isinstance(d, (tuple, list)) else f"{d:g}" if isinstance(d, float) else d
        return f"{text} (default: {str(shown).replace('%', '%%')})".lstrip()

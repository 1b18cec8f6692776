"""The one error a call's bad argument raises, for mixc's ops and for the modules that `mixc
compile -o DIR` writes alike (support.py imports it: torch and triton only, no compiler)."""


class ArgumentError(ValueError):
    """A call's argument is missing, extra, or of the wrong shape or dtype."""

"""The one error a call's bad argument raises, for mixc's ops and for the modules that `mixc
compile -o DIR` writes alike (support.py and binding.py import it; a compiled module's copy of
this package raises its copy's class, the same class as mixc's wherever the two are the same
files: codegen/module.py's loader)."""


class ArgumentError(ValueError):
    """A call's argument is missing, extra, or of the wrong shape or dtype."""

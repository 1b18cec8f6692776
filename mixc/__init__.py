"""mixc: a compiler from short specs of sequence mixers to kernels and PyTorch ops."""
__version__ = "0.1.0"


def __getattr__(name):
    # SpecError and parse load the spec language (lark) on first use: a compiled module imports
    # mixc.standalone.support without it
    if name in ("SpecError", "parse"):
        from . import dsl       # lazy: lark only when the spec language is used
        return getattr(dsl, name)
    raise AttributeError(f"module 'mixc' has no attribute {name!r}")


def load(name_or_path, **kwargs):
    """Load a library spec ('gla') or a .mix file as an op (see mixc.runtime.op.MixerOp): the
    stages of mixc/pipeline.py."""
    # lazy: a compiled module imports mixc.standalone.support without the compiler (lark, sympy)
    from .pipeline import load_op
    return load_op(name_or_path, **kwargs)


__all__ = ["SpecError", "parse", "load", "__version__"]

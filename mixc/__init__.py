"""mixc: a compiler from short specs of sequence mixers to kernels and PyTorch ops."""
__version__ = "0.1.0"

from .dsl import SpecError, parse  # noqa: E402


def load(name_or_path, **kwargs):
    """Load a library spec ('gla') or a .mix file as an op (see mixc.runtime.op.MixerOp)."""
    from .runtime.op import load as _load
    return _load(name_or_path, **kwargs)


__all__ = ["SpecError", "parse", "load", "__version__"]

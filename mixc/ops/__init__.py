"""mixc.ops: flash-linear-attention 0.6's functions (fla.ops) on mixc's library specs, so that a
call site written for fla runs on mixc by changing one import:

    from fla.ops import chunk_gla            ->   from mixc.ops import chunk_gla
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)

The same names, fla's parameters by name and by position with fla's defaults, fla's layouts
([B, T, H, dim] inputs, log-space gates, states [N, H, K, V] as tensors) and fla's returns.
A parameter mixc cannot honour is refused by name with an ArgumentError (a ValueError) when it
differs from fla's default; every function's docstring lists how each parameter is read.
chunk_* and parallel_* run the spec's chunked form, fused_recurrent_* its recurrent kernels
(mode=... picks any of mixc's modes). Details and the list of fla functions left out:
docs/ops.md. The description each function is built from: `fn.fla_op`."""
from .attention import *  # noqa: F401,F403
from .attention import __all__ as _attention
from .decay import *  # noqa: F401,F403
from .decay import __all__ as _decay
from .delta import *  # noqa: F401,F403
from .delta import __all__ as _delta
from .slots import *  # noqa: F401,F403
from .slots import __all__ as _slots

__all__ = sorted(_decay + _delta + _attention + _slots)

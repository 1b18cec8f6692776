"""The names and limits a spec meets (dsl/check.py applies them): the builtin functions and
names, the call's own keyword arguments, the names a spec may not take (Python's, the generated
code's, the kernels' argument names derived from declared names) and the sizes a spec may have."""
from __future__ import annotations

import functools
import keyword
import sys

from .dim_functions import DIM_FNS
from .functions import FUNCTIONS
from .parser import KEYWORDS
from .sequence_check import SEQUENCE_FNS

ELEMENTWISE_FNS = {name: f.arity for name, f in FUNCTIONS.items()}     # the registry (dsl/functions.py)
REDUCE_FNS = ("sum", "norm")          # always reduce: fn(x, D, ...)
MINMAX_FNS = ("max", "min")           # fn(a, b) elementwise, or fn(x, D, ...) a reduction
SPECIAL_FNS = ("prev", "rename")
BUILTIN_FNS = tuple(ELEMENTWISE_FNS) + REDUCE_FNS + MINMAX_FNS + tuple(DIM_FNS) + SPECIAL_FNS + SEQUENCE_FNS
BUILTIN_NAMES = ("head",)             # the head index, a scalar

# Keyword arguments of a call besides the spec's own (op(...), op.step(...) and the reference
# in mixc/runtime): an input or option of the same name would be taken by them instead.
CALL_ARGUMENTS = frozenset({"initial_state", "output_final_state", "cu_seqlens", "mode", "state", "CK", "chunk",
                            "dtype", "cp_group", "inplace", "state_indices"})

# Names a spec may not take: they would shadow what generated code relies on.
RESERVED = frozenset(
    set(KEYWORDS) | set(keyword.kwlist) | set(BUILTIN_FNS) | set(BUILTIN_NAMES) | CALL_ARGUMENTS
    | {"tl", "triton", "torch", "math", "np", "numpy", "sympy", "mixc", "self", "cls",
       "exec", "eval", "compile", "open", "print", "input_", "getattr", "setattr", "globals",
       "locals", "vars", "type", "object", "super", "ctx"}
)

# Top-level modules a mixer's name may not take: `compile -o DIR` writes DIR/NAME.py, and
# with DIR on sys.path (sys.path.insert(0, "build")) that file would hide the module of the
# same name from every later import (torch, os, triton, numpy, mixc itself).
DEPENDENCY_MODULES = frozenset({"torch", "triton", "numpy", "sympy", "lark", "jinja2", "mixc", "pytest",
                                "hypothesis", "mpmath", "markupsafe"})


@functools.lru_cache(maxsize=1)
def python_modules() -> frozenset[str]:
    """The standard library's modules, mixc's dependencies and every installed package's."""
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | DEPENDENCY_MODULES
    try:
        # lazy: importlib.metadata costs 13 ms that `mixc --help` (which imports this module) does without
        from importlib.metadata import packages_distributions
        names |= set(packages_distributions())
    except Exception:           # a broken installation's metadata: the fixed lists still hold
        pass
    return frozenset(names)


MAX_DIMS = 8
MAX_FIXED_DIM = 1024      # `dims E = 2`: a spec's own sizes are small (a stack of states, a few taps)
MAX_RANK = 4
MAX_DECLS = 64
# Nesting of an expression with the lets it reads written out (each let is within the parser's
# MAX_DEPTH on its own, but code generation substitutes lets and recurses through them: a chain
# of deep lets would exhaust Python's stack, not give an error).
MAX_DEPTH_WITH_LETS = 128
# Operations of an update with the new values of the states it reads written out (a later update
# reading an earlier state's new value: read_in_update). Each reading copies the earlier update's
# tree, so a chain of updates that each read the one before twice would double at every step.
MAX_UPDATE_SIZE = 1024

# Kernel arguments that generated code (codegen/templates/*.j2) derives from declared names,
# by kind, as (prefix, what it holds), and the fixed ones. Two must never be the same name:
# input `dq` next to input `q` would make both the data of dq and the gradient of q `p_dq`.
KERNEL_ARGUMENTS = {
    "input": (("p_", "input '{}'"), ("p_d", "the gradient of input '{}'")),
    "param": (("p_", "param '{}'"), ("p_dp_", "the gradient of param '{}'")),
    "state": (("p_init_", "the initial value of state '{}'"), ("p_final_", "the final value of state '{}'"),
              ("p_ckpt_", "the checkpoints of state '{}'"), ("p_scratch_", "the scratch copy of state '{}'"),
              ("p_dense_", "the state '{}' at every chunk start"),
              ("p_dinit_", "the gradient of the initial value of state '{}'"),
              ("p_dfinal_", "the gradient of the final value of state '{}'"),
              ("p_dh_", "the gradient of state '{}' at each chunk's end"),
              ("p_segstart_", "state '{}' (or its gradient) at each segment's start (end) of a segmented walk"),
              ("p_segdecay_", "the log decay of state '{}' from each checkpoint to its segment's start (end)")),
}
FIXED_KERNEL_ARGUMENTS = {"p_out": "the output", "p_do": "the gradient of the output",
                          "p_cu_seqlens": "the sequence starts (cu_seqlens)",
                          "p_chunk_seq": "the sequence of each chunk slot",
                          "p_intra": "the chunked forward's intra-chunk matrices",
                          "p_state_indices": "each sequence's slot of a decode cache (step's state_indices)"}
# The max-stabilizer's extra state (derive/stabilize.M): its arguments are a state's
# (p_ckpt__m, ...), and an input named ckpt__m would take one of them.
STABILIZER_STATE = "_m"
FIXED_KERNEL_ARGUMENTS |= {prefix + STABILIZER_STATE: what.format(STABILIZER_STATE) + " (the stabilizer's)"
                           for prefix, what in KERNEL_ARGUMENTS["state"]}

"""What a transition class is: one unit that owns everything the compiler knows about one
shape of state update S_t = A_t S_{t-1} + B_t (DESIGN.md section 1).

A unit says
- which updates it claims (`claims`, from the update's shape: its decay, which dims that decay
  runs over, its projection terms) and its one name, used by the Plan, the generated module's
  METADATA and tables, `mixc explain` and the runtime alike;
- which parallel form it has (the chunked kernels, an associative scan, none), whether a
  time-invariant state of the class has the convolution form, and whether the exponential-gate
  stabilizer can rescale it;
- its chunk-size policy and the chunk sizes the tuner tries;
- its chunked algorithm three times over, one per notation, each next to the others: the
  Triton kernel stages (Jinja macros in <unit>.j2 that read as Triton, rendered by the `chunk_*`
  hooks below for codegen/chunk.py and chunk_bwd.py), the torch backend's chunked form
  (`torch_*`, for runtime/torch_chunk*.py) and the context-parallel summary of a shard
  (`cp_*`, for runtime/context_parallel.py);
- the lines `mixc explain` prints for the class (`explain_chunk`).

The units sit below derive (dsl <- classes <- derive <- codegen <- runtime): they read the
plan's objects (StatePlan, ChunkCode, tensors) handed to them and import no stage above dsl, so
derive, codegen and the runtime all ask the same unit. Registry: mixc/classes/__init__.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Projection:
    """A term scale * (proj @ S) of an update, contracting `over`: the dims of each factor."""

    scale_dims: tuple[str, ...] | None     # None: no scale (1)
    proj_dims: tuple[str, ...]
    over: tuple[str, ...]


@dataclass(frozen=True)
class UpdateShape:
    """The facts about one state's update that decide its class."""

    state_dims: tuple[str, ...]
    key_dims: tuple[str, ...]              # the dims the output contracts (K of S[K, V])
    value_dims: tuple[str, ...]
    decay_is_one: bool                     # the diagonal part is the identity
    decay_dims: tuple[str, ...]            # the dims its diagonal decay varies over
    projections: tuple[Projection, ...]


class TransitionClass:
    """The defaults of a unit; each class overrides what differs."""

    name: str = ""
    hardness: int = 0                      # Plan.transition names the hardest class of its states
    parallel_form: str | None = None       # "chunk" (the chunked kernels), "scan", or None
    torch_chunked: bool = False            # the torch backend's chunked form serves it
    conv_form: bool = False                # a time-invariant state of the class: the convolution form
    stabilizable: bool = False             # the exponential-gate max-stabilizer can rescale it
    template: str | None = None            # its kernel macros: mixc/classes/<template>

    def claims(self, u: UpdateShape) -> bool:
        raise NotImplementedError

    # ---- chunk policy ----
    def chunk_size(self, st) -> int:
        """The default chunk C of the chunked kernels for a state of the class (the plan takes
        the smallest over its states)."""
        return 64

    def chunk_candidates(self, C: int) -> list[int]:
        """The chunk sizes the tuner times, the default first: half of it too where the
        intra-chunk term is a [C, C] matrix and C / 2 is still a tensor-core tile (16)."""
        return [C, C // 2] if C // 2 >= 16 else [C]

    # ---- explain ----
    def explain_chunk(self, st, s) -> list[str]:
        """The class's chunked (or parallel) equations for `mixc explain`; `s` prints a sympy
        expression as the explain text writes it."""
        return []

    def __repr__(self) -> str:
        return f"<transition class {self.name}>"

"""MixerOp: what mixc.load() returns. Today it carries the spec, its Plan and the float64
reference; the kernels (chunked, recurrent, step) attach here as they are generated."""
from __future__ import annotations

from functools import lru_cache

from ..derive.plan import Plan, derive
from ..dsl import MixerIR, parse, read_spec
from . import reference as _reference


class MixerOp:
    def __init__(self, mixer: MixerIR):
        self.ir = mixer

    @property
    def name(self) -> str:
        return self.ir.name

    def __repr__(self) -> str:
        return f"<mixc op '{self.name}' from {self.ir.source.filename}>"

    def plan(self, **flags) -> Plan:
        """The derivation for the given flag values (the spec's defaults otherwise)."""
        return _cached_plan(self.ir, tuple(sorted(flags.items())))

    def reference(self, **kwargs):
        """The spec as a float64 loop over t with autograd.

        reference(q=..., k=..., ..., <options>, initial_state=None, output_final_state=False,
        cu_seqlens=None) -> (o [B, T, H, *dims] float64, state dict or None)."""
        return _reference.reference(self.ir, **kwargs)

    def reference_step(self, *, state, **kwargs):
        """One token per sequence through the reference: returns (o, new state dict)."""
        return _reference.reference_step(self.ir, state=state, **kwargs)


@lru_cache(maxsize=256)
def _cached_plan(mixer: MixerIR, flags: tuple) -> Plan:
    return derive(mixer, dict(flags))


def load(name_or_path) -> MixerOp:
    """A library spec by name ('gla') or a .mix file by path -> MixerOp. Raises SpecError."""
    src = read_spec(name_or_path)
    return MixerOp(parse(src.text, src.filename))


def from_text(text: str, filename: str = "<spec>") -> MixerOp:
    return MixerOp(parse(text, filename))

"""The general linear transition: more than one projection term, or one that is not a rank-1
correction over the key dims (DeltaProduct written out): no parallel form is known, the
recurrent and step kernels serve it."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class GeneralLinear(TransitionClass):
    name = "general linear"
    hardness = 6

    def claims(self, u: UpdateShape) -> bool:
        return bool(u.projections)          # the projection terms no other class claimed

    def no_parallel_note(self, st) -> str | None:
        return (f"state {st.name} has a general linear transition ({len(st.rank1)} projection terms): no parallel "
                "form is known; the recurrent and step forms remain")

    def explain_chunk(self, st, s) -> list[str]:
        return ["no parallel form: the transition is a general linear map (more than one projection term)"]


UNIT = GeneralLinear()

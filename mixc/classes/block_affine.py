"""The block-affine system: states whose updates read one another, with a token's transition
linear in all of them (derive/coupled.py): the stacked state X_t = A_t X_{t-1} + B_t in blocks.
Every state of a system takes this class. The recurrent and step forms run it (the updates
as written, their backward the adjoint of the same code); no parallel form is generated yet:
a chunked form for blocks that are scalar or diagonal per head (Titans' 2x2 block with a
rank-1 correction, the WY/UT machinery over the stacked state) is future work."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class BlockAffine(TransitionClass):
    name = "block-affine system"
    hardness = 7

    def claims(self, u: UpdateShape) -> bool:
        return False            # given by the plan to the states of a system, never by an update's shape alone

    def explain_chunk(self, st, s) -> list[str]:
        return ["no parallel form: the state is one of a block-affine system (states that read one another); "
                "the recurrent and step forms run it"]


UNIT = BlockAffine()

"""The transition classes, one unit each (base.py says what a unit owns). Adding a class is a
new module here (its chunked kernel stages built in it as kernel IR, codegen/chunk_stage.py), and
one line in CLASSES.

CLASSES is also the order in which the units are asked to claim an update: the first that
claims it is its class (a rank-r class would go before `general`)."""
from __future__ import annotations

from . import block_affine, elementwise, general, key_diag, outer_sum, prefix_sum, rank1, rank_r, scalar, value_column, value_diag
from .base import Projection, TransitionClass, UpdateShape

CLASSES: tuple[TransitionClass, ...] = (
    rank1.UNIT,
    rank_r.UNIT,            # r >= 2 projections over the key dims (DeltaProduct)
    value_column.UNIT,      # one projection whose left or decay varies per value column (Longhorn)
    general.UNIT,           # any other update with projection terms
    outer_sum.UNIT,         # no projection, B_t a sum of >= 2 outer products (Mamba-3's trapezoid)
    prefix_sum.UNIT,
    scalar.UNIT,
    key_diag.UNIT,
    value_diag.UNIT,
    elementwise.UNIT,       # any other diagonal decay
    block_affine.UNIT,      # claims no update: the plan gives it to the states of a coupled system
)

BY_NAME: dict[str, TransitionClass] = {u.name: u for u in CLASSES}

# the names, for the code that asks about one class by name
PREFIX_SUM = prefix_sum.UNIT.name
SCALAR = scalar.UNIT.name
KEY_DIAG = key_diag.UNIT.name
VALUE_DIAG = value_diag.UNIT.name
ELEMENTWISE = elementwise.UNIT.name
RANK1 = rank1.UNIT.name
VALUE_COLUMN = value_column.UNIT.name
GENERAL = general.UNIT.name

# the class a stabilized state's kernels take (codegen/chunk.py): its log decay is the stabilizer's
STABILIZED_CLASS = scalar.UNIT.name
# the class every state of a coupled system takes (derive/coupled.py): given by the plan, never claimed
SYSTEM_CLASS = block_affine.UNIT.name

# the classes with the chunked kernels (the recurrent and step forms exist for every class)
CHUNK_CLASSES = tuple(u.name for u in CLASSES if u.parallel_form == "chunk")


def unit(name: str) -> TransitionClass:
    """The unit of a class by its name (StatePlan.transition, METADATA's "class")."""
    return BY_NAME[name]


def classify(u: UpdateShape) -> TransitionClass:
    """The class of an update: the first unit in CLASSES that claims it."""
    return next(c for c in CLASSES if c.claims(u))


__all__ = ["CLASSES", "BY_NAME", "unit", "classify", "TransitionClass", "UpdateShape", "Projection",
           "PREFIX_SUM", "SCALAR", "KEY_DIAG", "VALUE_DIAG", "ELEMENTWISE", "RANK1", "VALUE_COLUMN", "GENERAL",
           "CHUNK_CLASSES", "STABILIZED_CLASS", "SYSTEM_CLASS"]

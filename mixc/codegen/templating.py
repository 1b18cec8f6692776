"""The class macros: the kernel stages of the classes not yet built as kernel IR (key-diagonal,
rank-1, rank-r: codegen/chunk_stage.py is how the others build theirs) are Jinja macros that
read as Triton, in mixc/classes/<unit.template>; `macros(unit)` hands them to the unit's `chunk_*` hooks
(codegen/chunk.py, chunk_bwd.py call the hooks). jinja2 loads with codegen, which the pipeline
imports only to render: derive and `mixc check` never pay for it."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from .. import classes

CLASS_TEMPLATES = Path(classes.__file__).parent


@lru_cache(maxsize=1)
def macro_env() -> jinja2.Environment:
    # Triton lines between block tags: trim_blocks and lstrip_blocks drop a tag's own line, so
    # a macro renders exactly its Triton lines. No autoescape: the output is Python.
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(CLASS_TEMPLATES)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, autoescape=False)


@lru_cache(maxsize=None)
def macros(unit: classes.TransitionClass, stage: str = "fused", staged: bool = False):
    """The macros of a class's template as attributes (each renders its lines of Triton), for
    the kernel of one stage: the template reads `stage` (forward: fused, walk, output, refill,
    intra; backward: fused, walk, tiles) where a stage's code differs, so a kernel holds its own;
    `staged`: the kernel is the variant that reads the intra kernel's matrices (the walk and
    output kernels' `_staged` variants: codegen/chunk_kernels.py), else it computes them."""
    return macro_env().get_template(unit.template).make_module({"stage": stage, "staged": staged})

"""Plan -> LaunchPlan: what the launcher (mixc/standalone/launcher.py) reads of a spec, as plain
data. Written here, in the code generator, because the generated module carries it
(METADATA["launch"]) so that a compiled module launches without mixc.derive or the class
units; runtime/launch.py derives the same for mixc.load's op (one function, so the two cannot
disagree). The class units' launch policies (output and backward tile blocks, key blocks,
tokens per checkpoint, a staged inverse) are read here, once per plan."""
from __future__ import annotations

from .. import classes
from ..derive.plan import Plan
from ..derive.stabilize import M as STABILIZER_M
from ..standalone.kernel_args import CHUNK_STAGES, stage_kernel
from ..standalone.launch_data import LaunchPlan
from .key_split import key_dim


def kernel_name(plan: Plan, form: str) -> str:
    """A recurrent kernel's name; a chunked form's stem (its kernels: stage_kernel_name)."""
    return f"{plan.name}_{form}"


def chunk_stages(plan: Plan, form: str) -> tuple[str, ...]:
    """The stages of a chunked form this plan has a kernel for: every one but the forward's
    intra, which only a spec that stages intra-chunk matrices has (plan.layout.intra_matrices)."""
    return tuple(s for s in CHUNK_STAGES[form] if s != "intra" or plan.layout.intra_matrices)


def stage_kernel_name(plan: Plan, form: str, stage: str) -> str:
    """The name of a chunked form's kernel for one stage: gla_chunk_fwd_walk ..."""
    return stage_kernel(kernel_name(plan, form), stage)


def launch_plan(plan: Plan) -> LaunchPlan:
    m, layout = plan.kernel_ir, plan.layout
    forms = ("recurrent_fwd", "recurrent_bwd") + (("chunk_fwd", "chunk_bwd") if layout.chunked else ())
    units = [classes.unit(st.transition) for st in plan.states]
    unit = classes.unit(plan.transition)
    return LaunchPlan(
        mixer=plan.name,
        kernels=tuple((form, kernel_name(plan, form)) for form in forms),
        dims=tuple(m.dim_names),
        inputs=tuple((d.name, tuple(d.shape)) for d in m.inputs),
        params=tuple((d.name, tuple(d.shape)) for d in m.params),
        options=tuple(o.name for o in m.options if o.kind == "float"),
        states=tuple((s.name, tuple(s.shape)) for s in m.states),
        output=tuple(m.output.expr.shape),
        chunk_size=layout.chunk_size,
        tile=layout.tile,
        split=layout.split,
        key=key_dim(plan),
        fp32_states=tuple(s.name for s in m.states if s.name == STABILIZER_M),
        half_states=layout.half_states,
        half_matmuls=layout.half_matmuls,
        intra_matrices=layout.intra_matrices or 0,
        stages_solve=any(u.stages_solve for u in units),
        output_tile=unit.output_tile,
        backward_tile=unit.backward_tile,
        key_block=min((u.key_block for u in units if u.key_block), default=None),
        checkpoint_tokens=min((t for st, u in zip(plan.states, units) if (t := u.checkpoint_tokens(st))),
                              default=None),
    )

"""Plan -> the source of one importable Python module: a header naming the spec, its hash
and the versions, the Triton kernels rendered from the templates, and metadata."""
from __future__ import annotations

import pprint
import textwrap
from functools import lru_cache
from pathlib import Path

import jinja2
import triton

from .. import __version__
from .. import classes, standalone
from ..derive.plan import Plan
from ..dsl import ir
from ..dsl.functions import FUNCTIONS
from .chunk import chunk_fwd_hooks
from .key_split import key_dim, split_keys
from .launch_plan import chunk_stages, kernel_name, launch_plan, stage_kernel_name
from ..standalone.kernel_args import STAGE_VARIANTS, stage_kernel
from .chunk_bwd import chunk_bwd_hooks, split_backward
from .header import docstring_safe
from . import chunk_ir
from .kir import nodes as kir_nodes
from .kir import passes, printer
from .recurrent_bwd_ir import backward_kernel
from .recurrent_ir import RECURRENT_PASSES, forward_kernel
from .sequence_module import generate_sequence
from .torch_module import torch_hooks
from .torch_step import torch_step_hooks

TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    # Templates produce Python, not HTML: no autoescape. Hooks receive code built from
    # validated IR only (names are checked identifiers behind fixed prefixes).
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def metadata(plan: Plan) -> dict:
    m = plan.ir
    launch = launch_plan(plan)
    return {
        "mixer": m.name,
        "spec_hash": m.spec_hash,
        "flags": dict(plan.flags),
        "mixc_version": __version__,
        "triton_version": triton.__version__,
        "class": plan.transition,
        "dims": list(m.dim_names),
        "inputs": {d.name: list(d.shape) for d in m.inputs},
        # prev(x) of inputs: derived input -> the input it shifts (standalone/shift.py computes it)
        "shifted": {s.name: s.source for s in m.shifted},
        "params": {d.name: list(d.shape) for d in m.params},
        # const W[E] = [...]: params whose values the spec fixes (numbers only); the binder supplies them
        "consts": {c.name: {"shape": list(c.shape), "values": list(c.values)} for c in m.consts},
        "options": [o.name for o in m.options if o.kind == "float"],
        "states": {s.name: list(s.shape) for s in m.states},
        "output": {"name": m.output.name, "shape": list(m.output.expr.shape)},
        # what mixc.standalone.support needs to bind a call and launch the kernels without the spec
        "dim_roots": {d.name: m.root_dim(d.name) for d in m.dims if d.alias_of},
        # what standalone/binding.py's Signature reads (the binder of mixc.load's op): the options
        # in the spec's order with their kinds, each alias as declared
        "option_kinds": {o.name: o.kind for o in m.options},
        "dim_aliases": {d.name: d.alias_of for d in m.dims if d.alias_of},
        "dim_sizes": {d.name: d.size for d in m.dims if d.size is not None},     # `dims E = 2`
        "option_defaults": {o.name: _scalar_tree(o.default) for o in m.options if o.kind == "float"},
        "kernel_states": {s.name: list(s.shape) for s in plan.kernel_ir.states},
        "stabilized": list(plan.stabilizer.states) if plan.stabilizer is not None else [],
        "kernels": dict(launch.kernels),
        "chunk_unsupported": plan.layout.chunk_unsupported,
        # the torch backend (plain torch, CPU without the interpreter): with the chunked form
        "torch_forward": "torch_forward" if plan.layout.torch_chunked else None,
        # the recurrence one token at a time (decode) and its token loop (codegen/torch_step.py)
        "torch_step": "torch_step",
        # what the launcher (standalone/launcher.py) reads: LaunchPlan.from_metadata rebuilds it
        "launch": launch.to_metadata(),
    }


def _scalar_tree(e: ir.Expr) -> list:
    """An option's default as nested lists (mixc.standalone.support.scalar evaluates them)."""
    if isinstance(e, ir.Num):
        return ["num", e.value]
    if isinstance(e, ir.Ref):
        return ["dim" if e.kind == "dim" else "opt", e.name]
    if isinstance(e, ir.Neg):
        return ["neg", _scalar_tree(e.x)]
    if isinstance(e, ir.BinOp):
        return ["bin", e.op, _scalar_tree(e.left), _scalar_tree(e.right)]
    if isinstance(e, ir.Call) and e.fn in FUNCTIONS:
        # the float64 form travels with the call: the compiled module's runtime has no registry
        return ["call", e.fn, [_scalar_tree(x) for x in e.args], f"lambda x: {FUNCTIONS[e.fn].python}"]
    if isinstance(e, ir.Call):
        return ["call", e.fn, [_scalar_tree(x) for x in e.args]]
    raise TypeError(f"an option default of {type(e).__name__}")


def op_functions(plan: Plan) -> str:
    """SPEC_TEXT, SPEC_FILE, FLAGS and the module's op() and step(), which launch THIS module's
    kernels through its runtime, mixc/standalone's support.py (torch and triton only: no spec
    parsing, no derivation), imported from the copy `mixc compile -o DIR` writes beside the
    module, else from mixc (templates/op.py.j2 says how). The spec text travels as a Python
    string literal (repr), never as code."""
    return _env().get_template("op.py.j2").render(
        spec_text=repr(plan.ir.source.text), spec_file=repr(plan.ir.source.filename), flags=repr(dict(plan.flags)),
        folder=standalone.FOLDER)


# what each kernel form is, for the comment above it
STAGES = {
    "recurrent_fwd": "the recurrent forward: tokens in order, every state in registers",
    "recurrent_bwd": "the recurrent backward: chunks of CK tokens from last to first, recomputed from checkpoints",
}
# each chunked kernel: (what it does, what it reads and writes, fla's counterpart); one kernel
# per stage a launch runs (standalone/launch_data.py CHUNK_STAGES; the launcher names them)
CHUNK_STAGES = {
    ("chunk_fwd", "fused"): (
        "the chunked forward in one walk: per (sequence, head) and tile block, the chunks of C tokens in "
        "order, the state in registers, each chunk's outputs on the way",
        "reads the inputs, params, initial states; writes the output, the checkpoints (STORE_CHECKPOINTS) "
        "and the final states", "fla's fused_chunk kernels"),
    ("chunk_fwd", "walk"): (
        "the chunked forward's walk: per (sequence, head) and tile block, the chunks in order, the state "
        "in registers, no output",
        "reads the inputs, params, initial states (and the staged inverses: its _staged variant); writes the state "
        "at every CKPT_EVERY-th chunk start (the checkpoints) and the final states", "fla's chunk_fwd_h"),
    ("chunk_fwd", "output"): (
        "the chunked forward's outputs: per (checkpoint slot, head) and tile block, the CKPT_EVERY chunks "
        "of one checkpoint from it, all slots at once",
        "reads the inputs, params, the walk's checkpoints (and the staged intra-chunk matrices: its _staged "
        "variants); writes the output", "fla's chunk_fwd_o"),
    ("chunk_fwd", "refill"): (
        "the state at every chunk start, for the backward: per (checkpoint slot, head) and tile block, "
        "the slot's chunks walked from its checkpoint",
        "reads the inputs, params and the checkpoints; writes the state at every chunk start (dense)",
        "none: fla stores every chunk's state in chunk_fwd_h"),
    ("chunk_fwd", "intra"): (
        "the chunked forward's intra-chunk matrices: per (checkpoint slot, head), no state, no tile block",
        "reads the inputs and params; writes each chunk's staged intra-chunk matrices (the readouts' A, "
        "the rank-1 setup's inverse) for the output kernel (and the rank-1 walk) to read",
        "fla's chunk_fwd_intra / chunk_scaled_dot_kkt + solve_tril"),
    ("chunk_bwd", "fused"): (
        "the chunked backward in one walk: per (sequence, head) and tile block, the chunks from last to "
        "first, dL/dS in registers, each chunk's forward recomputed from its checkpoint",
        "reads the inputs, params, the state at every chunk start, the output's and final states' gradients; "
        "writes every gradient", "none: fla's backward is its dh kernel and its dq/dk/dv kernels"),
    ("chunk_bwd", "walk"): (
        "the chunked backward's walk: per (sequence, head) and tile block, the chunks from last to first, "
        "dL/dS in registers",
        "reads what the fused walk reads; writes dL/dS at every chunk's end (dh) and the initial states' "
        "gradients", "fla's chunk_bwd_dh"),
    ("chunk_bwd", "tiles"): (
        "the chunked backward's gradients: per (chunk, head), the chunk's forward and gradients, looping "
        "over the tile dim's blocks inside (codegen/tile_split.py), all chunks at once",
        "reads the inputs, params, the state at the chunk's start and the walk's dL/dS at its end; writes "
        "the inputs' and params' gradients", "fla's chunk_bwd_dqkwg / dv kernels"),
}
NOTATION = {
    "recurrent": "v_<x> an input's values at this token, s_<S> a state, d_<S> dL/dS, _c*/_b* temporaries",
    "chunk": "rows are the chunk's tokens (_offs__T, _mask__T), s_<S> a state as a [key, value] matrix, "
             "_b_<S> its cumulative log decay, K/V/Q the chunk's key, value and query matrices, d_<S> dL/dS",
}


def kernel_header(plan: Plan, form: str, stage: str | None = None) -> tuple[str, ...]:
    """The comment lines above a kernel: which kernel (a chunked one: its stage, what it reads
    and writes, fla's counterpart), which class per state and where its stages come from
    (chunked kernels: the class's macros), and the notation."""
    if stage is None:
        lines = [f"---- {kernel_name(plan, form)}: {STAGES[form]} ----"]
    else:
        what, io, fla = CHUNK_STAGES[form, stage]
        lines = [f"---- {stage_kernel_name(plan, form, stage)}: {what} ----", f"{io}; counterpart: {fla}"]
    for st in plan.states:
        unit = classes.unit(st.transition)
        where = f" (its stages: mixc/classes/{unit.stages_file})" if form.startswith("chunk") and unit.stages_file else ""
        lines.append(f"state {st.name}[{', '.join(st.shape)}]: {st.transition}{where}")
    lines.append(f"notation: {NOTATION[form.split('_')[0]]}")
    return tuple(lines)


def _chunk_header(plan: Plan, form: str, stage: str) -> tuple[str, ...]:
    """A chunked kernel's header, wrapped (what it does, reads and writes, fla's counterpart)."""
    return tuple(part for line in kernel_header(plan, form, stage)
                 for part in textwrap.wrap(line, 98, subsequent_indent="  ", break_on_hyphens=False))


RECURRENT = ("recurrent_fwd", "recurrent_bwd")


def recurrent_ir(plan: Plan, record: dict | None = None) -> dict:
    """The recurrent kernels as kernel IR (codegen/recurrent_ir.py, recurrent_bwd_ir.py) after
    RECURRENT_PASSES, verified after building and after each pass; `record[form]`: the kernel
    after each pass, as (pass name, kernel) (--dump kir)."""
    build = {"recurrent_fwd": forward_kernel, "recurrent_bwd": backward_kernel}
    out = {}
    for form in RECURRENT:
        steps = [] if record is not None else None
        out[form] = passes.run(build[form](plan, kernel_name(plan, form), kernel_header(plan, form)),
                               RECURRENT_PASSES, steps)
        if record is not None:
            record[form] = steps
    return out


def kir_text(plan: Plan) -> str:
    """--dump kir: each recurrent kernel as built and after each pass (each verified), printed
    with its shape comments; what each pass dropped or changed, in one line above it. Then each
    chunked kernel as built (verified; its hooks' texts still Text, codegen/chunk_ir.py), before
    the ast passes (key_split.py, tile_split.py) that still rewrite its printed text."""
    record: dict = {}
    recurrent_ir(plan, record)
    out = []
    for form, steps in record.items():
        before = None
        for name, k in steps:
            note = passes.summary(before, k) if before is not None else f"{passes.count(k)} statements"
            out.append(f"#### {k.name} after {name} (verified): {note}")
            out.append(printer.kernel(k))
            before = k
    if plan.layout.chunked:
        for form in ("chunk_fwd", "chunk_bwd"):
            for stage in chunk_stages(plan, form):
                k = chunk_kernel(plan, form, stage)
                texts = [s.what for s in kir_nodes.walk_stmts(k.body) if isinstance(s, kir_nodes.Text)]
                out.append(f"#### {k.name} as built (verified): {passes.count(k)} statements, "
                           f"{len(texts)} of them text ({', '.join(texts)})")
                out.append(printer.kernel(k))
    return "\n".join(out)


# each variant part's line in a variant kernel's header (kernel_args.VARIANT_PARTS; Launcher.variant picks)
VARIANT_TEXT = {
    "rewalk": ("CKPT_EVERY > 1 chunks a program, walked from their checkpoint", "one chunk a program"),
    "staged": ("reads the intra kernel's staged matrices", "computes its intra-chunk matrices"),
    "keyblocks": ("the key dim in blocks of KEY_BLOCK", "the whole key dim"),
}


def _variant_header(plan: Plan, form: str, stage: str, parts: tuple[str, ...]) -> tuple[str, ...]:
    header = list(_chunk_header(plan, form, stage))
    name = stage_kernel(kernel_name(plan, form), stage, parts)
    header[0] = header[0].replace(stage_kernel_name(plan, form, stage) + ":", name + ":", 1)
    if (form, stage) in STAGE_VARIANTS:
        have = [v for s, v in (forward_variants(plan) if form == "chunk_fwd" else
                               backward_variants(plan) + [("tiles", ("keyblocks",))]) if s == stage]
        # the parts this spec's variants of the stage differ in (keyblocks: where the split may apply)
        what = [VARIANT_TEXT[p][0 if p in parts else 1] for p in STAGE_VARIANTS[form, stage]
                if p == "keyblocks" or any(p in v for v in have)]
        header.insert(1, f"variant: {'; '.join(what)} (the launcher picks it: Launcher.variant)")
    return tuple(header)


def chunk_kernel(plan: Plan, form: str, stage: str, parts: tuple[str, ...] = ()) -> kir_nodes.Kernel:
    """One stage's kernel of a chunked form as kernel IR (codegen/chunk_ir.py: its scaffolding
    as statements, the hooks rendered for that stage as Text), verified: its name, its
    arguments (the one definition, plan.layout.kernel_args: standalone/kernel_args.py), under
    a header that says which kernel, variant and class it is. parts: the variant's rewalk and
    staged (a keyblocks variant is this kernel's text split: forward_kernels)."""
    parts = tuple(p for p in parts if p != "keyblocks")
    name = stage_kernel(kernel_name(plan, form), stage, parts)
    header = _variant_header(plan, form, stage, parts)
    if form == "chunk_fwd":
        hooks = chunk_fwd_hooks(plan, stage, "staged" in parts)
        k = chunk_ir.forward_kernel(plan, name, header, stage, hooks, rewalk="rewalk" in parts)
    else:
        k = chunk_ir.backward_kernel(plan, name, header, stage, chunk_bwd_hooks(plan, stage, "staged" in parts))
    return passes.run(k, ())


def _render_kernel(plan: Plan, form: str, stage: str, parts: tuple[str, ...] = ()) -> str:
    """One stage's kernel of a chunked form, printed (the ast passes read this text)."""
    return printer.kernel(chunk_kernel(plan, form, stage, parts))


def _keyed(plan: Plan, form: str, stage: str, parts: tuple[str, ...], source: str) -> str:
    """A split kernel's text as its keyblocks variant: that variant's name and header."""
    parts = parts + ("keyblocks",)
    old = stage_kernel(kernel_name(plan, form), stage, tuple(p for p in parts if p != "keyblocks"))
    body = source[source.index("@triton.jit"):].replace(f"def {old}(", f"def {stage_kernel(kernel_name(plan, form), stage, parts)}(", 1)
    return "\n".join(f"# {h}" for h in _variant_header(plan, form, stage, parts)) + "\n" + body


def stages_solve(plan: Plan) -> bool:
    """A state's class stages its setup's inverse (the rank-1 (I - M)^-1): the walks' staged variants."""
    return bool(plan.layout.intra_matrices) and any(classes.unit(st.transition).stages_solve for st in plan.states)


def backward_variants(plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """(stage, parts) of the chunked backward's kernels but the keyblocks variants: the walk's
    staged one where a class reads its staged inverse there (the intra kernel run again before
    it: no triangular solve on the walk's dependent path)."""
    out = []
    for stage in chunk_stages(plan, "chunk_bwd"):
        out.append((stage, ()))
        if stage == "walk" and stages_solve(plan):
            out.append((stage, ("staged",)))
    return out


def forward_variants(plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """(stage, parts) of the chunked forward's kernels but the keyblocks variants: the walk's
    staged one where a class reads its staged inverse there (stages_solve), the output
    kernel's rewalk x staged (staged where the spec stages matrices)."""
    staged = bool(plan.layout.intra_matrices)
    solve = stages_solve(plan)
    out = []
    for stage in chunk_stages(plan, "chunk_fwd"):
        if stage == "walk":
            out += [(stage, ())] + ([(stage, ("staged",))] if solve else [])
        elif stage == "output":
            out += [(stage, r + s) for r in ((), ("rewalk",)) for s in (((), ("staged",)) if staged else ((),))]
        else:
            out.append((stage, ()))
    return out


def forward_kernels(plan: Plan) -> list[str]:
    """The chunked forward's kernels, one per stage and variant (forward_variants), with the
    intra and output kernels' keyblocks variants where the key split applies (codegen/key_split.py:
    the states share one key dim, key_dim; the output kernel walking chunks: its state in static
    key blocks, key_walk.py, for a class that walks them, reading the staged A); a key block tests
    its own keys' non-finite entries (_bad_<S>)."""
    key = key_dim(plan)
    flags = {f"_bad_{st.name}" for st in plan.states} | {f"_badv_{st.name}" for st in plan.states}
    walk = any(classes.unit(st.transition).walks_key_blocks for st in plan.states)
    staged = bool(plan.layout.intra_matrices)
    out = []
    for stage, parts in forward_variants(plan):
        source = _render_kernel(plan, "chunk_fwd", stage, parts)
        keyed = None
        name = stage_kernel(kernel_name(plan, "chunk_fwd"), stage, parts)
        if stage == "intra" or (stage == "output" and "rewalk" not in parts):
            source, keyed = split_keys(source, name, key, flags)
        elif stage == "output" and walk and ("staged" in parts or not staged):
            source, keyed = split_keys(source, name, key, flags, walk=True)
        out.append(source)
        if keyed is not None:
            out.append(_keyed(plan, "chunk_fwd", stage, parts, keyed))
    return out


def backward_kernels(plan: Plan) -> list[str]:
    """The chunked backward's kernels, one per stage, the tiles kernel's tile loop split
    (codegen/tile_split.py), and its keyblocks variant where the key split applies after it."""
    out = []
    for stage, parts in backward_variants(plan):
        source = _render_kernel(plan, "chunk_bwd", stage, parts)
        keyed = None
        if stage == "tiles":
            source, keyed = split_backward(plan, source, stage_kernel_name(plan, "chunk_bwd", stage))
        out.append(source)
        if keyed is not None:
            out.append(_keyed(plan, "chunk_bwd", stage, (), keyed))
    return out


def generate(plan: Plan) -> str:
    if plan.sequence is not None:          # conv, mix, attend: a module without kernels
        return generate_sequence(plan)
    meta = metadata(plan)
    flags = ", ".join(f"{k}={v}" for k, v in plan.flags) or "none"
    header = (f'"""Generated by mixc {__version__} (Triton {triton.__version__}) from spec '
              f"'{plan.name}' ({docstring_safe(plan.ir.source.filename)}), spec hash {plan.ir.spec_hash}, "
              f"flags: {flags}.\n\n"
              f'Do not edit: regenerate with `mixc compile {plan.name}`."""\n')
    kernels = recurrent_ir(plan)
    body = printer.kernel(kernels["recurrent_fwd"]) + "\n\n" + printer.kernel(kernels["recurrent_bwd"])
    if plan.layout.chunked:
        for source in forward_kernels(plan) + backward_kernels(plan):
            body += "\n\n" + source.rstrip("\n") + "\n"
        body += "\n\n" + _env().get_template("chunk_helpers.py.j2").render()

    body += "\n\n" + _env().get_template("torch_step.py.j2").render(**torch_step_hooks(plan))
    if plan.layout.torch_chunked:
        body += "\n\n" + _env().get_template("torch_chunk.py.j2").render(**torch_hooks(plan))
    trailer = "\n" + op_functions(plan)
    return (header + "import triton\nimport triton.language as tl\n\n"
            f"METADATA = {pprint.pformat(meta, width=100, sort_dicts=False)}\n\n\n" + body + trailer)

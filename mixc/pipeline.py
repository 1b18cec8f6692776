"""The whole compiler, stage by stage. Each stage is a function of the previous stage's frozen
result; `mixc.load`, the CLI (`mixc check | explain | compile | run`, `--dump STAGE`) and the
ahead-of-time compiler (mixc/tools/aot.py) go through these functions.

    name or path
        |  read     dsl.read_spec            a library spec ('gla') or a .mix file
        v
    Source          text + file name
        |  parse    dsl.parser.parse_tree    lark grammar; syntax errors at file:line:col
        v
    SpecTree        statements, unchecked
        |  check    dsl.check.check          names, shapes by dim name, sequence ops
        v
    MixerIR         the checked spec                                   --dump check  (ir)
        |  derive   derive.plan.derive       sympy: transition class, log-space decay,
        v                                    readouts, derivatives, kernel layout
    Plan            + plan.layout: which kernels exist, tile/split dims, chunk size
        |                                                              --dump derive (plan)
        |  kir      codegen.module.recurrent_ir   the recurrent kernels as kernel IR, after
        |                                    each pass, verified       --dump kir
        |  render   codegen.module.generate  kir printer, Jinja (torch forms, op), chunked ast passes
        v
    source          one Python module: Triton kernels, torch backend, METADATA, op()
        |                                                              --dump render (source)
        |  load     runtime.cache            content-hashed, verified, imported once per plan
        v
    module          its kernels, launched by runtime/launch.py (or by standalone/support.py
                    from METADATA in a module that `mixc compile -o` wrote, from its copy)

and beside the chain, the op a user calls: op(mixer) = runtime.op.make_op, a MixerOp whose
calls derive per flag values, load the module and launch its kernels (or the torch backend,
the float64 reference, the convolution form).

The stages import only downwards: dsl <- derive <- codegen <- runtime <- this module
(tests/test_layering.py holds them to it). The runtime's cache renders a module on a miss
with the render stage's own function (codegen.module.generate): it looks down, never up here.
"""
from __future__ import annotations

import types

from .derive.explain import plan_json
from .derive.plan import Plan, derive as _derive
from .dsl import read_spec
from .dsl.check import check as _check_tree
from .dsl.errors import Source
from .dsl.ir import MixerIR
from .dsl.parser import SpecTree, parse_tree
from .dsl.unparse import spec_text

STAGES = ("read", "parse", "check", "derive", "kir", "render", "load")
# what `--dump` prints: a stage's result (the old names stay: ir, plan, source)
DUMPS = ("parse", "check", "derive", "kir", "render")
DUMP_ALIASES = {"ir": "check", "plan": "derive", "source": "render"}


def read(name_or_path) -> Source:
    """A library spec by name ('gla') or a .mix file by path."""
    return read_spec(name_or_path)


def parse(source: Source) -> SpecTree:
    """The spec's syntax tree. A byte-order mark (Windows editors write one) is not part of the
    spec: columns count from the first character after it, as the editor shows them."""
    return parse_tree(source.text.removeprefix("\ufeff"), source.filename)


def check(tree: SpecTree) -> MixerIR:
    """Names, shapes and sequence ops checked: the spec's IR."""
    return _check_tree(tree)


def derive(mixer: MixerIR, flags: dict[str, bool] | None = None) -> Plan:
    """The derivation for these flag values (the spec's defaults otherwise)."""
    return _derive(mixer, flags)


def kir(plan: Plan) -> dict:
    """The recurrent kernels as kernel IR (form -> kir Kernel, frozen), after their passes,
    verified after each."""
    from .codegen.module import recurrent_ir     # lazy: jinja2 and the templates load only to render
    return recurrent_ir(plan)


def render(plan: Plan) -> str:
    """The generated module's source."""
    from .codegen.module import generate      # lazy: jinja2 and the templates load only to render
    return generate(plan)


def load(plan: Plan) -> types.ModuleType:
    """The generated module, from the cache (rendered and written on a miss), imported once."""
    from .runtime.cache import load_module     # lazy: torch and Triton only once a module runs
    return load_module(plan)


# ---- the chain, as its users call it ----

def spec(name_or_path) -> MixerIR:
    """read -> parse -> check."""
    return check(parse(read(name_or_path)))


def spec_from_text(text: str, filename: str = "<spec>") -> MixerIR:
    """parse -> check of a spec's text."""
    return check(parse(Source(text, filename)))


def compile(name_or_path, flags: dict[str, bool] | None = None) -> Plan:
    """read -> parse -> check -> derive."""
    return derive(spec(name_or_path), flags)


def op(mixer: MixerIR):
    """The op of a checked spec (a MixerOp, or a SequenceOp for conv, mix, attend), its default
    flags prepared: derived, the module loaded, the custom ops registered."""
    from .runtime.op import make_op             # lazy: `mixc check` and `explain` need no torch
    o = make_op(mixer)
    o.prepare()
    return o


def load_op(name_or_path):
    """mixc.load: a library spec by name or a .mix file by path -> its op. Raises SpecError."""
    return op(spec(name_or_path))


def from_text(text: str, filename: str = "<spec>"):
    """The op of a spec's text."""
    return op(spec_from_text(text, filename))


def dump(stage: str, name_or_path, flags: dict[str, bool] | None = None) -> str:
    """A stage's result as text (`mixc check|explain|compile --dump STAGE`); the old names ir,
    plan and source are taken as check, derive and render."""
    stage = DUMP_ALIASES.get(stage, stage)
    if stage not in DUMPS:
        raise ValueError(f"--dump: expected one of {', '.join(DUMPS + tuple(DUMP_ALIASES))}, got {stage!r}")
    tree = parse(read(name_or_path))
    if stage == "parse":
        return tree_text(tree)
    mixer = check(tree)
    if stage == "check":
        return spec_text(mixer)
    plan = derive(mixer, flags)
    if stage == "derive":
        return plan_json(plan)
    if stage == "kir":
        if plan.sequence is not None:
            return f"{plan.name} is a sequence mixer (conv, mix, attend): computed by torch, it has no kernels"
        from .codegen.module import kir_text     # lazy: as kir() above
        return kir_text(plan)
    return render(plan)


def tree_text(tree: SpecTree) -> str:
    """The syntax tree as its statements: where each starts (line:column) and its text."""
    lines = [f"mixer {tree.name.name}    ({tree.source.filename})"]
    for st in tree.statements:
        sp = st.span
        text = " ".join(tree.source.line(n).strip() for n in range(sp.line, sp.end_line + 1))
        lines.append(f"{sp.line}:{sp.column}  {text}")
    return "\n".join(lines)

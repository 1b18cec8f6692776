"""How one of fla 0.6's functions becomes a function of mixc.ops: `FlaOp` describes it (fla's
parameters as fla writes them, the library spec that computes it, how its arguments map onto
the spec's), and `fla_function` builds the function: fla's signature (by position and by name,
with fla's defaults), a docstring built from the spec, and a call that

  1. binds the arguments as fla's function would, a bad call being an ArgumentError that names
     the parameter (never a TypeError from deep inside);
  2. refuses, by name, each parameter mixc cannot honour when it differs from fla's default;
  3. maps fla's arguments onto the spec's (renamed gates, gates computed from raw logits,
     defaults such as beta = 1), and fla's state tensor [N, H, K, V] onto the spec's dict;
  4. runs the spec's op in the function's form: chunk_* and parallel_* in the chunked form
     ("auto": the chunked kernels where the spec has them), fused_recurrent_* in the recurrent
     kernels; on a CPU tensor without TRITON_INTERPRET=1 both take the torch backend, as
     mixc.load's ops do;
  5. returns what fla returns: (o, final_state) with final_state a tensor in fla's layout (or
     None), or o alone where fla returns o alone.

reverse=True (fused_recurrent_*) is honoured by flipping the per-token inputs along T (each
packed sequence on its own) and the output back; state_v_first=True by transposing the states."""
from __future__ import annotations

import ast
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import pipeline
from ..standalone.binding import cu_seqlens_values
from ..standalone.errors import ArgumentError
from ..runtime.op import MixerOp

FORMS = {
    "chunk": "the chunked form (mode 'auto': the chunked kernels where the spec has them)",
    "parallel": "the chunked form (mode 'auto': mixc has no separate parallel form; the results are the same)",
    "recurrent": "the recurrent kernels (mode 'recurrent')",
}

# How mixc reads fla's parameters that are alike in every function that has them.
COMMON_NOTES = {
    "scale": "multiplies q (r); None: K ** -0.5, fla's default",
    "initial_state": "[N, H, K, V] float32, fla's layout ([N, H, V, K] with state_v_first=True); N = B, "
                     "or len(cu_seqlens) - 1",
    "output_final_state": "also return the state after the last token (else final_state is None)",
    "cu_seqlens": "[N + 1] int offsets of N sequences packed along T (B = 1)",
    "cu_seqlens_cpu": "a host copy of cu_seqlens: accepted and not needed (mixc reads the offsets on the host)",
    "state_v_first": "honoured: initial_state and final_state are [N, H, V, K] (transposed for mixc)",
    "transpose_state_layout": "fla's deprecated name of state_v_first: honoured, with fla's DeprecationWarning",
    "reverse": "honoured: each sequence runs from its last token to its first (mixc flips T)",
    "chunk_size": "mixc's chunk size where it is a power of two >= 16 (the results do not depend on it)",
    "use_qk_l2norm_in_kernel": "the spec's flag: q and k divided by sqrt(sum(x ** 2) + 1e-6)",
    "chunk_indices": "fla's chunk index of cu_seqlens: accepted and not read (mixc derives its own)",
    "disable_recompute": "a memory/speed choice of fla's backward: accepted, no effect on the results",
    "safe_gate": "fla's promise that the gates are bounded (a faster kernel): accepted, no effect here",
    "use_graph": "fla's graph-capture layout (Ascend NPU): accepted, no effect on the results",
    "max_num_seqs": "with use_graph: accepted, no effect on the results",
    "mode": "mixc's, not fla's: None runs this function's form; any mode of mixc.load's ops otherwise "
            "('chunk', 'recurrent', 'torch', 'reference', ...)",
}

# Parameters fla itself refuses or renames, and mixc with it.
HEAD_FIRST = "removed in fla 0.6 as well: inputs are [B, T, H, ...]"
CP_CONTEXT = ("fla's context-parallel context; mixc's context parallelism is op(..., cp_group=group) on the "
              "library op (mixc.load(spec), docs/distributed.md)")


class Call:
    """The bound arguments of one call: fla's parameters as attributes, defaults applied."""

    def __init__(self, name: str, values: dict):
        self.fn = name
        self.__dict__.update(values)

    def get(self, name: str, default=None):
        return self.__dict__.get(name, default)


@dataclass(frozen=True)
class FlaOp:
    name: str                       # fla's function name
    where: str                      # fla's module, e.g. "fla.ops.gla"
    spec: str                       # the library spec that computes it (the first of `specs`)
    form: str                       # "chunk", "parallel" or "recurrent" (FORMS)
    params: str                     # fla 0.6's parameters, in its order, with its defaults
    arguments: Callable[[Call], dict]   # the call -> the spec's inputs, params and options
    refused: dict = field(default_factory=dict)    # parameter -> why mixc cannot honour a non-default value
    notes: dict = field(default_factory=dict)      # parameter -> how mixc reads it (the docstring)
    renamed: dict = field(default_factory=dict)    # fla's parameter -> the spec's input it becomes
    choose: Callable[[Call], str] | None = None    # the spec per call, where it depends on the arguments
    specs: tuple = ()               # every spec `choose` may pick (the docstring)
    state_in: Callable | None = None    # (call) -> the spec's initial state dict (default: one [K, V] state S)
    state_out: Callable | None = None   # (call, state dict or None) -> fla's final_state
    returns: str = "state"          # "state": (o, final_state); "output": o; "attentions": (o, None)
    output: Callable | None = None  # the spec's output -> fla's (hgrn: without the head axis)
    # (call) -> whether fla returns a state even without output_final_state (linear_attn's normalize)
    always_state: Callable[[Call], bool] = lambda a: False


def parse_params(text: str) -> inspect.Signature:
    """fla's parameter list as written in Python ("q, k, v, g=None, *, chunk_size=None"), with
    mixc's own keyword-only `mode` appended."""
    tree = ast.parse(f"def f({text}, {'*, ' if '*' not in text else ''}mode=None): pass")
    args = tree.body[0].args
    P = inspect.Parameter
    positional = args.posonlyargs + args.args
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    params = [P(a.arg, P.POSITIONAL_OR_KEYWORD, default=d) for a, d in zip(positional, defaults)]
    params += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ast.literal_eval(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return inspect.Signature(params, return_annotation="tuple[torch.Tensor, torch.Tensor | None]")


def fla_function(d: FlaOp):
    """The function of mixc.ops for one of fla's: fla's signature, a docstring from the spec."""
    sig = parse_params(d.params)

    def call(*args, **kwargs):
        return run(d, sig, bind_call(d, sig, args, kwargs))

    call.__name__ = call.__qualname__ = d.name
    call.__module__ = "mixc.ops"
    call.__signature__ = sig
    call.__doc__ = docstring(d, sig)
    call.fla_op = d                 # what tests and docs read: the description it was built from
    return call


def bind_call(d: FlaOp, sig: inspect.Signature, args, kwargs) -> Call:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:        # sig.bind's words name the parameter; say which function and what it takes
        takes = ", ".join(p.name for p in sig.parameters.values())
        raise ArgumentError(f"{d.name}: {err}; it takes ({takes}): fla 0.6's {d.where}.{d.name} parameters "
                            "and mixc's mode") from None
    bound.apply_defaults()
    return Call(d.name, dict(bound.arguments))


def _is_default(value, default) -> bool:
    if value is default:
        return True
    return not isinstance(value, torch.Tensor) and default is not None and value == default


def refuse_unhonoured(d: FlaOp, sig: inspect.Signature, a: Call) -> None:
    for name, why in d.refused.items():
        value = a.get(name)
        if not _is_default(value, sig.parameters[name].default):
            shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
            raise ArgumentError(f"{name}: {d.name} on mixc cannot take {name}={shown}: {why}")


_OPS: dict[str, object] = {}


def library_op(spec: str):
    """mixc.load(spec), once per process."""
    if spec not in _OPS:
        _OPS[spec] = pipeline.load_op(spec)
    return _OPS[spec]


# fla's required parameters that are numbers, and its optional ones that are tensors when given
NUMBERS = {"layer_idx", "num_layers", "num_householder"}
OPTIONAL_TENSORS = {"g", "g_gamma", "gk", "gv", "beta", "p", "A_log", "dt_bias"}


def check_tensors(sig: inspect.Signature, a: Call) -> None:
    """Tensors where fla takes tensors, before any arithmetic on them (a list where q goes is
    an ArgumentError naming q, not an AttributeError from the translation)."""
    for p in sig.parameters.values():
        value = a.get(p.name)
        if value is None and p.name in OPTIONAL_TENSORS:    # fla takes None for these even where required
            continue
        required = p.default is inspect.Parameter.empty and p.name not in NUMBERS
        if (required or p.name in OPTIONAL_TENSORS) and not isinstance(value, torch.Tensor):
            raise ArgumentError(f"{p.name}: {a.fn} takes a tensor here, got {type(value).__name__}")


def run(d: FlaOp, sig: inspect.Signature, a: Call):
    refuse_unhonoured(d, sig, a)
    check_tensors(sig, a)
    if a.get("transpose_state_layout") is not None:
        if a.get("state_v_first"):
            raise ArgumentError("transpose_state_layout: pass state_v_first or the deprecated "
                                "transpose_state_layout, not both (as fla)")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        a.state_v_first = bool(a.transpose_state_layout)
    spec = d.choose(a) if d.choose is not None else d.spec
    op = library_op(spec)
    kwargs = d.arguments(a)
    x = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    mode = a.mode if a.mode is not None else default_mode(d.form, op, x)
    cu = a.get("cu_seqlens")
    flip = bool(a.get("reverse"))
    if flip:
        kwargs = reversed_inputs(op, kwargs, cu)
    call = dict(kwargs, mode=mode, cu_seqlens=cu)
    if not op.is_sequence:
        keep = a.get("output_final_state", False)       # mixc's op checks it is a bool
        call.update(initial_state=(d.state_in or kv_state_in)(a),
                    output_final_state=True if keep is False and d.always_state(a) else keep)
        chunk = a.get("chunk_size")
        if isinstance(chunk, int) and chunk >= 16 and chunk & (chunk - 1) == 0:
            call["chunk"] = chunk
    try:
        o, st = op(**call)
    except ArgumentError as err:    # the spec's names in the message: say whose, and fla's where renamed
        renames = "".join(f", {f} as {s}" for f, s in d.renamed.items())
        raise ArgumentError(f"{d.name} (mixc spec '{spec}'{renames}): {err}") from None
    if flip:
        o = reversed_time(o, cu)
    if d.output is not None:
        o = d.output(o)
    if d.returns == "output":
        return o
    if d.returns == "attentions":
        return o, None
    if st is None:
        return o, None
    return o, (d.state_out or kv_state_out)(a, st)


def default_mode(form: str, op, x: torch.Tensor) -> str:
    """The kernels of the function's form where mixc.load's ops run kernels (CUDA, or CPU under
    TRITON_INTERPRET=1); the CPU's torch backend otherwise ("auto" picks it)."""
    if op.is_sequence or MixerOp._resolve("auto", x.device) != "auto":
        return "auto"
    return "recurrent" if form == "recurrent" else "auto"


# ---- states: fla's tensor [N, H, K, V] <-> the spec's {"S": [N, H, K, V]} ----

def kv_state_in(a: Call, name: str = "S"):
    h0 = a.get("initial_state")
    if h0 is None:
        return None
    if not isinstance(h0, torch.Tensor):
        raise ArgumentError(f"initial_state: {a.fn} takes a tensor [N, H, K, V] (fla's layout), "
                            f"got {type(h0).__name__}")
    return {name: h0.transpose(-1, -2) if a.get("state_v_first") else h0}


def kv_state_out(a: Call, st: dict, name: str = "S"):
    S = st[name]
    return S.transpose(-1, -2).contiguous() if a.get("state_v_first") else S


# ---- reverse=True: the per-token inputs flipped along T, each packed sequence on its own ----

def reversed_time(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    if cu_seqlens is None:
        return x.flip(1)
    offsets = cu_seqlens_values(cu_seqlens, x.shape[0], x.shape[1], (x.device, "the inputs"))
    index = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in zip(offsets, offsets[1:])]
                      + [torch.zeros(0, dtype=torch.long)])
    return x.index_select(1, index.to(x.device))


def reversed_inputs(op, kwargs: dict, cu_seqlens) -> dict:
    names = {d.name for d in op.ir.inputs}
    return {k: reversed_time(v, cu_seqlens) if k in names else v for k, v in kwargs.items()}


# ---- helpers the descriptions share ----

def scale_of(a: Call, default: float | None = None) -> dict:
    """The spec's scale: fla's value, else `default` (K ** -0.5 when the spec's differs), else
    the spec's own default (K ** -0.5 in the specs that fla's functions share it with)."""
    if a.scale is not None:
        return {"scale": a.scale}
    return {} if default is None else {"scale": default}


def ones_like_head(x: torch.Tensor) -> torch.Tensor:
    """fla's beta = None: ones per token and head ([B, T, H], q's heads)."""
    return torch.ones_like(x[..., 0])


# ---- the docstring ----

def _shape(lead, decl) -> str:
    return "[" + ", ".join(lead + tuple(decl.shape)) + "]"


def docstring(d: FlaOp, sig: inspect.Signature) -> str:
    specs = d.specs or (d.spec,)
    irs = {s: pipeline.spec(s) for s in specs}
    m = irs[d.spec]
    which = (f"the library spec '{d.spec}' (docs/specs/{d.spec}.md)" if len(specs) == 1 else
             "the library specs " + ", ".join(f"'{s}'" for s in specs) + " (docs/specs/NAME.md), by the arguments")
    lines = [f"{d.where}.{d.name} of fla 0.6, computed by {which}, in {FORMS[d.form]}.",
             "fla's parameters by name and position, fla's defaults and return; mixc's ArgumentError "
             "names a parameter it cannot take (docs/ops.md)."]
    for s, mi in irs.items():
        lines += ["", f"Spec '{s}':"]
        lines += ["    " + line.rstrip() for line in mi.source.text.splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    lines += ["", "Args:"]
    inputs = {x.name: x for x in m.inputs}
    for p in sig.parameters.values():
        spec_name = d.renamed.get(p.name, p.name)
        if p.name in d.notes:
            note = d.notes[p.name]
        elif spec_name in inputs and p.name not in COMMON_NOTES:
            note = _shape(("B", "T", "H"), inputs[spec_name]) + (f", the spec's {spec_name}" if spec_name != p.name else "")
        elif p.name in COMMON_NOTES:
            note = COMMON_NOTES[p.name]
        elif p.name in d.refused:
            note = ""
        else:
            note = "the spec's option of that name"
        if p.name in d.refused:
            note = (note + "; " if note else "") + f"refused unless {p.default!r}: {d.refused[p.name]}"
        lines.append(f"    {p.name}: {note}")
    lines += ["", "Returns:"]
    out = f"{m.output.name}: [B, T, H, " + ", ".join(m.output.expr.shape) + "]"
    if d.returns == "output":
        lines.append(f"    {out}")
    elif d.returns == "attentions":
        lines.append(f"    ({out}, None): fla's attention scores are never materialized")
    else:
        lines.append(f"    ({out}, final_state): final_state as initial_state, or None unless output_final_state")
    return "\n".join(lines)

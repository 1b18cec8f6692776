"""The signature and docstring of a loaded op, built from its spec, so that
`inspect.signature(op)` and `help(op)` show the arguments a call takes (every argument of an
op is a keyword: the spec's inputs, params and options by name, then the call's own).

A number option whose default is a plain number shows that number; one whose default is an
expression of dims (`scale = K ** -0.5`) shows None, which the binder reads as "the spec's
default" (standalone/binding.py), and the docstring gives the expression."""
from __future__ import annotations

import inspect

import torch

from ..dsl import ir, scalar
from ..dsl.unparse import expr_text

KW = inspect.Parameter.KEYWORD_ONLY

# the call's own arguments after the spec's: (name, default, annotation, what it is)
_RECURRENT_CALL = (
    ("initial_state", None, "dict[str, torch.Tensor] | None",
     "the state dict that output_final_state=True returns (a tensor where the spec has one state)"),
    ("output_final_state", False, "bool", "also return the state after the last token"),
    ("cu_seqlens", None, "torch.LongTensor | None",
     "[N + 1] offsets of N sequences packed along T (B = 1); states are then [N, H, ...]"),
    ("mode", "auto", "str",
     "'auto', 'chunk', 'recurrent', 'conv', 'torch' or 'reference' (README.md, 'Modes and devices')"),
    ("CK", 32, "int", "tokens per checkpoint of the recurrent kernels' backward"),
    ("chunk", None, "int | None", "the chunked form's chunk size (a power of two >= 16 for the kernels)"),
    ("cp_group", None, "torch.distributed.ProcessGroup | None",
     "context parallelism: each rank holds a contiguous shard of the sequence (docs/distributed.md)"),
)
_SEQUENCE_CALL = _RECURRENT_CALL[:3] + (
    ("mode", "auto", "str", "'auto', 'torch' or 'reference'"),
)


def _shape(lead: tuple[str, ...], shape: tuple[str, ...]) -> str:
    return "[" + ", ".join(lead + tuple(shape)) + "]"


def option_default(opt: ir.Option):
    """What the signature shows: a flag's True/False, a number option's plain-number default,
    None where the default is an expression of dims (evaluated per call)."""
    if opt.kind == "bool":
        return opt.default
    try:
        value = scalar.evaluate(opt.default)
    except (scalar.ScalarError, scalar.NotConstant):
        return None
    return int(value) if value.is_integer() and abs(value) < 2 ** 53 else value


def _option_type(opt: ir.Option):
    if opt.kind == "bool":
        return bool
    return float if option_default(opt) is not None else "float | None"


def _call_arguments(mixer: ir.MixerIR):
    return _SEQUENCE_CALL if mixer.is_sequence else _RECURRENT_CALL


def call_signature(mixer: ir.MixerIR) -> inspect.Signature:
    """op(*, <inputs>, <params>, <options>, initial_state=None, output_final_state=False, ...)."""
    params = [inspect.Parameter(d.name, KW, annotation=torch.Tensor) for d in (*mixer.given_inputs, *mixer.given_params)]
    params += [inspect.Parameter(o.name, KW, default=option_default(o), annotation=_option_type(o))
               for o in mixer.options]
    params += [inspect.Parameter(name, KW, default=default, annotation=note)
               for name, default, note, _ in _call_arguments(mixer)]
    return inspect.Signature(params, return_annotation="tuple[torch.Tensor, dict[str, torch.Tensor] | None]")


def call_doc(mixer: ir.MixerIR) -> str:
    """The op's docstring: its call line, each argument with its shape or default, the spec."""
    sig = call_signature(mixer)
    head = f"{mixer.name}{str(sig).split(' -> ')[0]} -> (o, state)"
    lines = [head, "", f"The op of mixer '{mixer.name}' ({mixer.source.filename}), from mixc.load."]
    lines += ["", "Inputs, one per token (a scalar per head is [B, T, H]):"]
    lines += [f"    {d.name}: {_shape(('B', 'T', 'H'), d.shape)}" for d in mixer.given_inputs]
    if mixer.given_params:
        lines += ["Params, one per head:"]
        lines += [f"    {d.name}: {_shape(('H',), d.shape)}" for d in mixer.given_params]
    if mixer.consts:
        lines += ["Consts, fixed by the spec (not arguments):"]
        lines += [f"    {c.name}: {_shape((), c.shape)}" for c in mixer.consts]
    if mixer.options:
        lines += ["Options:"]
        for o in mixer.options:
            if o.kind == "bool":
                lines.append(f"    {o.name}: a flag, default {o.default}")
            else:
                shown = option_default(o)
                tail = "" if shown is not None else " (None: the default)"
                lines.append(f"    {o.name}: a number, default {expr_text(o.default)}{tail}")
    lines += ["Call:"]
    lines += [f"    {name}: {what}" for name, _, _, what in _call_arguments(mixer)]
    lines += ["", "Returns (o, state):", f"    {mixer.output.name}: {_shape(('B', 'T', 'H'), mixer.output.expr.shape)}"]
    if mixer.states:
        states = ", ".join(f"'{s.name}': {_shape(('B', 'H'), s.shape)}" for s in mixer.states)
        lines.append(f"    state: {{{states}}} float32 (N for B with cu_seqlens), or None unless "
                     "output_final_state=True")
        for s in mixer.shifted:
            lines.append(f"    state['{s.name}']: {_shape(('B', 'H'), mixer.input(s.source).shape)} in {s.source}'s dtype: "
                         f"{s.source} at the last token, prev({s.source}) of the next (0 where initial_state lacks it)")
        lines.append("op.step(..., state=state) decodes one token per sequence (inputs without T).")
    else:
        lines.append("    state: a cache of the past (runtime/sequence.py), or None unless output_final_state=True")
    lines += ["", "Spec:"] + ["    " + line for line in mixer.source.text.strip("\ufeff\n").splitlines()]
    return "\n".join(lines)

"""The runtime of a compiled module (`mixc compile -o DIR`): binds a call's arguments and
launches the module's OWN kernels from its METADATA alone.

It imports torch, triton and the files beside it only (no spec parsing, no derivation, no code
generation: none of mixc.dsl, mixc.derive, mixc.codegen, sympy, lark or jinja2), so `mixc
compile -o DIR` copies this package into DIR/_mixc_standalone and the module runs where only
torch and Triton are installed; an edit to the module's kernels changes what runs. A call's
arguments are checked by mixc.load's own binder (binding.py, torch only): what one refuses the
other refuses, with the same message (tests/runtime/test_compiled_binding.py fuzzes both). The
launches are made by mixc.load's own launcher (launcher.py) from METADATA["launch"] (a
LaunchPlan) with the launch knobs' defaults and no tuner: the same grids, blocks, constexprs,
buffers and checks as mixc.load's op makes untuned (tests/runtime/test_one_launcher.py records
both), each form with its backward through an autograd.Function. This file holds no launch
rule of its own. mixc.load's op adds the torch and reference backends, autotuning on CUDA,
torch.compile custom ops and context parallelism (runtime/op.py).

CPU tensors without Triton's interpreter (where no kernel can run) take the module's torch form
instead, in every mode: its generated torch_step and token loop (codegen/torch_step.py, driven
by torch_tokens.py; autograd gives the gradients), the recurrence mode 'torch' of mixc.load's op
steps with. A module generated before it had them refuses such tensors with an ArgumentError."""
from __future__ import annotations

import functools
import math
import operator
import os
from dataclasses import replace

import torch

from .binding import (FLOAT_DTYPES, Bound, Signature, bind, check_chunking, check_flag_argument,  # noqa: F401
                      clamp_chunk, clamp_ck)
from .errors import ArgumentError  # noqa: F401  (one class: mixc.load's op raises it too)
from .launch_data import LaunchPlan, LaunchSettings
from .launcher import Launcher
from .shift import Carry, StepCarry
from .torch_tokens import compiled_call, compiled_step

MODES = ("auto", "chunk", "recurrent")


_MAX_MIN = {"max": max, "min": min}
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "**": operator.pow}


@functools.lru_cache(maxsize=None)
def _function(source: str):
    """A function's float64 form as its call in METADATA carries it ("lambda x: ..." over math,
    written by the code generator from mixc/dsl/functions.py): this file has no registry."""
    return eval(source, {"math": math})  # noqa: S307 (the compiled module's own metadata)


def scalar(e, sizes: dict, values: dict) -> float:
    """An option's default from METADATA["option_defaults"] (nested lists: ["num", v],
    ["dim", name], ["opt", name], ["neg", x], ["bin", op, a, b], ["call", fn, [args]] for max
    and min, ["call", fn, [args], "lambda x: ..."] for the elementwise functions)."""
    kind = e[0]
    if kind == "num":
        return float(e[1])
    if kind == "dim":
        return float(sizes[e[1]])
    if kind == "opt":
        return values[e[1]]
    if kind == "neg":
        return -scalar(e[1], sizes, values)
    if kind == "bin":
        a, b = scalar(e[2], sizes, values), scalar(e[3], sizes, values)
        # only this node's operator: every one at once raised for the others (10.0 ** 400 in
        # `K + 400` at K = 10, 0.0 ** -1 in `K + -1` at K = 0); no finite real value is NaN, refused by the caller
        if e[1] == "/":
            return a / b if b else math.nan
        if e[1] == "**" and not (a > 0 or float(b).is_integer()):
            return math.nan
        try:
            return _BINARY[e[1]](a, b)
        except (ZeroDivisionError, OverflowError):
            return math.nan
    args = [scalar(x, sizes, values) for x in e[2]]
    if e[1] in _MAX_MIN:
        return _MAX_MIN[e[1]](*args)
    if len(e) < 4:
        raise ArgumentError(f"this module's METADATA gives no float64 form for {e[1]}() in an option default "
                            "(compiled by an older mixc): compile the spec again")
    try:
        return _function(e[3])(*args)
    except (ValueError, OverflowError):         # the log of 0, exp(1000): as the bin ops, no exception
        return math.nan


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Namespace:
    """A compiled module's globals as attributes (the launcher looks its kernels up by name)."""

    def __init__(self, namespace: dict):
        self._ns = namespace

    def __getattr__(self, name: str):
        try:
            return self._ns[name]
        except KeyError:
            raise AttributeError(name) from None


class CompiledOp:
    """op(**kwargs) and op.step(**kwargs) of a compiled module: `meta` its METADATA, `namespace`
    its globals (the @triton.jit functions METADATA["kernels"] names: a chunked form's stem, its
    kernels <stem>_<stage>, LaunchPlan.kernel_name)."""

    def __init__(self, meta: dict, namespace: dict):
        self.meta, self.ns = meta, namespace
        self.signature = Signature(meta)           # what the binder reads of the spec
        self.plan = LaunchPlan.from_metadata(meta["launch"])      # what the launcher reads

    # ---- binding ----
    def _bind(self, kw: dict, state, cu, step: bool) -> Bound:
        """The call's arguments checked by mixc.load's binder (binding.py: the same
        checks and messages), then this module's own: its flags, its option defaults."""
        meta = self.meta
        bound = bind(self.signature, dict(kw, initial_state=state, cu_seqlens=cu), step=step)
        for name, value in bound.flags.items():
            if value != meta["flags"][name]:
                raise ArgumentError(f"{name}: this module is compiled with {name}={meta['flags'][name]}; compile "
                                    f"another (`mixc compile` with the flag) for the other value")
        keep = bound.sizes
        opts = {}
        for name in meta["options"]:
            opts[name] = (bound.options[name] if name in bound.options
                          else scalar(meta["option_defaults"][name], keep, opts))
            if not math.isfinite(opts[name]):       # a default (a value passed is checked finite by bind)
                at = ", ".join(f"{d} = {v}" for d, v in keep.items())
                raise ArgumentError(f"option '{name}': its default has no finite real value at {at}; pass {name}=")
        return replace(bound, options=opts)

    def _torch_form(self, b: Bound) -> bool:
        """CPU tensors without Triton's interpreter: the module's torch form (torch_tokens.py)."""
        return (next(iter(b.inputs.values())).device.type == "cpu" and not _interpreting()
                and "torch_step" in self.ns)

    # ---- launches: the one launcher's (launcher.py), as mixc.load's op makes them ----
    def _refuse_device(self, device) -> None:
        if device.type == "cpu" and not _interpreting():
            raise ArgumentError(
                "the tensors are on the CPU and Triton's interpreter is off: a compiled module runs its Triton "
                "kernels only, on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before Python starts; "
                "this module has no torch form for CPU tensors (it was generated by an older mixc: compile it again "
                "with `mixc compile NAME -o DIR`, whose module carries one)")

    def launcher(self) -> Launcher:
        """This module's kernels, the launch knobs' defaults, no tuner (the untuned launch)."""
        return Launcher(self.plan, _Namespace(self.ns), LaunchSettings.from_env(), refuse=self._refuse_device)

    def forward(self, b: Bound, chunked: bool, C: int, output_final_state: bool, checkpoints: bool):
        kernels = self.launcher()
        if chunked:
            return kernels.chunk_forward(b, output_final_state=output_final_state, checkpoints=checkpoints, C=C)
        return kernels.recurrent_forward(b, output_final_state=output_final_state, checkpoints=checkpoints, CK=C)

    def backward(self, b: Bound, chunked: bool, C: int, ckpts: dict, do: torch.Tensor, dfinal: dict | None):
        kernels = self.launcher()
        if chunked:
            return kernels.chunk_backward(b, ckpts, do, dfinal, C)
        return kernels.recurrent_backward(b, ckpts, do, dfinal, C)

    # ---- the op ----
    def __call__(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                 mode: str = "auto", CK: int = 32, chunk: int | None = None, **kwargs):
        if not self.signature.shifted:
            return self._call(initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, mode=mode, CK=CK, chunk=chunk, **kwargs)
        carry = Carry(self.signature, kwargs, initial_state, cu_seqlens)      # prev(x) of inputs (shift.py)
        o, st = self._call(initial_state=carry.state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           mode=mode, CK=CK, chunk=chunk, **carry.kwargs)
        return o, carry.final(st)

    def _call(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
              mode: str = "auto", CK: int = 32, chunk: int | None = None, **kwargs):
        # the checks of mixc.load's op, in its order (runtime/op.py), by the same functions
        if mode not in MODES:
            raise ArgumentError(f"mode: a compiled module runs its kernels: 'auto', 'chunk' or 'recurrent', got "
                                f"{mode!r} (mixc.load's op has the torch and reference backends)")
        check_flag_argument("output_final_state", output_final_state)
        if "cp_group" in kwargs:
            raise ArgumentError("cp_group: a compiled module has no context parallelism; use mixc.load's op")
        check_chunking(mode, CK, chunk)
        b = self._bind(kwargs, initial_state, cu_seqlens, step=False)
        has_chunk = "chunk_fwd" in self.meta["kernels"]
        if mode == "chunk" and not has_chunk:
            raise ArgumentError(f"mode='chunk': mixer '{self.meta['mixer']}' has no chunked kernel "
                                f"({self.meta['chunk_unsupported']}); use mode='recurrent'")
        if self._torch_form(b):
            return compiled_call(self.ns, b, output_final_state)
        chunked = has_chunk and mode != "recurrent"
        C = (clamp_chunk(chunk, b.T, True) or self.plan.chunk_size) if chunked else clamp_ck(CK, b.T)
        return _run(self, b, chunked, C, output_final_state)

    def step(self, *, state, mode: str = "auto", **kwargs):
        """One token per sequence: inputs [B, H, *dims], state the dict from output_final_state.
        Returns (o [B, H, *dims], new state). Every mode runs the recurrent kernel (one token)."""
        if not self.signature.shifted:
            return self._step(state=state, mode=mode, **kwargs)
        carry = StepCarry(self.signature, kwargs, state, False, None)           # prev(x) of inputs (shift.py)
        o, st = self._step(state=carry.state, mode=mode, **carry.kwargs)
        return o, carry.new_state(st)

    def _step(self, *, state, mode: str = "auto", **kwargs):
        if mode not in MODES:
            raise ArgumentError(f"mode: a compiled module runs its kernels: 'auto', 'chunk' or 'recurrent', got "
                                f"{mode!r} (mixc.load's op has the torch and reference backends)")
        if "initial_state" in kwargs:
            raise ArgumentError("initial_state: step() takes the state as state=..., not initial_state=")
        if not isinstance(state, (dict, torch.Tensor)):
            raise ArgumentError("state: step() needs the state dict that output_final_state=True returns")
        b = self._bind(kwargs, state, None, step=True)
        if self._torch_form(b):
            return compiled_step(self.ns, b)
        b = replace(b, inputs={k: v.unsqueeze(1) for k, v in b.inputs.items()})       # T = 1
        o, st = _run(self, b, False, 32, True)
        return o[:, 0], st


def _run(op: CompiledOp, b: Bound, chunked: bool, C: int, output_final_state: bool):
    meta = op.meta
    kstates = list(meta["kernel_states"])
    given = b.initial_state
    init = [given[s] if (given is not None and s in given) else None for s in kstates]
    if given is not None and len(kstates) > len(meta["states"]):      # a stabilizer's m starts at 0
        x = init[0]
        init = init[:len(meta["states"])] + [x.new_zeros(x.shape[:2], dtype=torch.float32)]
    b = replace(b, initial_state=dict(zip(kstates, init)) if given is not None else None)
    tensors = (list(b.inputs.values()) + list(b.params.values())
               + (list(b.initial_state.values()) if b.initial_state else []))
    outs = _Kernels.apply(op, b, chunked, C, output_final_state, *tensors)
    o = outs[0]
    if not output_final_state:
        return o, None
    st = dict(zip(kstates, outs[1:]))
    if "_m" in st:          # the kernels keep S~ = S exp(-m); the spec's state is S
        m = st.pop("_m")
        for name in meta["stabilized"]:
            x = st[name]
            st[name] = x * torch.exp(m).reshape(m.shape + (1,) * (x.dim() - 2))
    return o, st


class _Kernels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, b, chunked, C, output_final_state, *tensors):
        save = any(t.requires_grad for t in tensors)
        o, finals, ckpts = op.forward(b, chunked, C, output_final_state, checkpoints=save)
        ctx.op, ctx.b, ctx.chunked, ctx.C, ctx.ofs, ctx.ckpts = op, b, chunked, C, output_final_state, ckpts
        ctx.o_shape = o.shape
        ctx.init_dtypes = [x.dtype for x in b.initial_state.values()] if b.initial_state else []
        return (o,) + tuple(finals[s] for s in op.meta["kernel_states"]) if output_final_state else (o,)

    @staticmethod
    def backward(ctx, do, *dfinals):
        op, b = ctx.op, ctx.b
        kstates = list(op.meta["kernel_states"])
        dfin = None
        if ctx.ofs and any(g is not None for g in dfinals):
            dfin = {s: g for s, g in zip(kstates, dfinals) if g is not None}
        if do is None:
            do = next(iter(b.inputs.values())).new_zeros(ctx.o_shape)
        dins, dpars, dinit = op.backward(b, ctx.chunked, ctx.C, ctx.ckpts, do, dfin)
        grads = list(dins.values()) + list(dpars.values())
        if b.initial_state:
            grads += [dinit[s].to(dt) for s, dt in zip(kstates, ctx.init_dtypes)]
        return (None, None, None, None, None) + tuple(grads)

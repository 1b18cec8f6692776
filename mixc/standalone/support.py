"""The runtime of a compiled module (`mixc compile -o DIR`): binds a call's arguments and
launches the module's OWN kernels from its METADATA alone.

It imports torch, triton and the files beside it only (no spec parsing, no derivation, no code
generation: none of mixc.dsl, mixc.derive, mixc.codegen, sympy, lark or jinja2; kernel_args.py
is the kernels' argument lists, plain Python that builds them from METADATA's names, the one
definition the code generator printed the signatures from), so `mixc compile -o DIR` copies
this package into DIR/_mixc_standalone and the module runs where only torch and Triton are
installed; an edit to the module's kernels changes what runs. A call's arguments are checked
by mixc.load's own binder (binding.py, torch only): what one refuses the other refuses, with
the same message (tests/runtime/test_compiled_binding.py fuzzes both). The launches are the
untuned ones mixc.load's op takes under Triton's interpreter: the recurrent kernels (tile and
split blocks of 32 and 64) and the chunked kernels in one walk (PHASE 0), each with its
backward through an autograd.Function. mixc.load's op adds the torch and reference backends,
autotuning on CUDA, the two-launch chunked form, torch.compile custom ops and context
parallelism (runtime/op.py); the numbers are the same kernels' (tests/codegen/test_module.py,
and tests/codegen/test_standalone.py where mixc cannot be imported).

CPU tensors without Triton's interpreter (where no kernel can run) take the module's torch form
instead, in every mode: its generated torch_step and token loop (codegen/torch_step.py, driven
by torch_tokens.py; autograd gives the gradients), the recurrence mode 'torch' of mixc.load's op
steps with. A module generated before it had them refuses such tensors with an ArgumentError."""
from __future__ import annotations

import functools
import math
import operator
import os

import torch
import triton

from .binding import (FLOAT_DTYPES, Signature, bind, check_chunking, check_flag_argument, clamp_chunk,  # noqa: F401
                      clamp_ck)
from .errors import ArgumentError  # noqa: F401  (one class: mixc.load's op raises it too)
from .kernel_args import metadata_kernel_args
from .torch_tokens import compiled_call, compiled_step

MODES = ("auto", "chunk", "recurrent")
RECURRENT_TILE, RECURRENT_SPLIT, CHUNK_TILE = 32, 64, 64       # as runtime/launch.py




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


def _block(size: int) -> int:
    return max(triton.next_power_of_2(size), 1)


def _empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("MIXC_POISON") == "1":
        t.fill_(float("nan"))
    return t


def _sum_groups(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A gradient per head [B, T, H, *dims] summed over the heads sharing each of x's (as
    runtime/launch.py's sum_groups), in x's dtype."""
    if g.shape[2] != x.shape[2]:
        g = g.unflatten(2, (x.shape[2], g.shape[2] // x.shape[2])).sum(3)
    return g.to(x.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Bound:
    def __init__(self, B, T, H, sizes, inputs, params, options, init, cu, groups=None):
        self.B, self.T, self.H, self.sizes = B, T, H, sizes
        self.inputs, self.params, self.options, self.init, self.cu = inputs, params, options, init, cu
        self.n = B if cu is None else cu.shape[0] - 1
        self.groups = groups or {}          # grouped inputs' heads per shared head (the torch form repeats them)


class CompiledOp:
    """op(**kwargs) and op.step(**kwargs) of a compiled module: `meta` its METADATA, `kernels`
    its namespace (the @triton.jit functions METADATA["kernels"] names)."""

    def __init__(self, meta: dict, namespace: dict):
        self.meta, self.ns = meta, namespace
        self.args = metadata_kernel_args(meta)     # each kernel's arguments, in its order
        self.signature = Signature(meta)           # what the binder reads of the spec

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
        return Bound(bound.B, bound.T, bound.H, keep, bound.inputs, bound.params, opts, bound.initial_state,
                     bound.cu_seqlens, bound.groups)

    def _torch_form(self, b: Bound) -> bool:
        """CPU tensors without Triton's interpreter: the module's torch form (torch_tokens.py)."""
        return (next(iter(b.inputs.values())).device.type == "cpu" and not _interpreting()
                and "torch_step" in self.ns)

    # ---- launches ----
    def _blocks(self, b: Bound, chunked: bool, C: int) -> tuple[dict, int, int]:
        meta, tile, split = self.meta, self.meta["tile"], self.meta["split"]
        kw = {}           # keyed as the arguments (standalone/kernel_args.py)
        for d in meta["dims"]:
            kw["size", d] = b.sizes[d]
            blk = _block(b.sizes[d])
            if chunked:
                blk = max(16, min(blk, CHUNK_TILE) if d == tile else blk)
            else:
                blk = min(blk, RECURRENT_TILE) if d == tile else min(blk, RECURRENT_SPLIT) if d == split else blk
            kw["block", d] = blk
        tiles = -(-b.sizes[tile] // kw["block", tile]) if tile else 1
        splits = max(1, -(-b.sizes[split] // kw["block", split])) if split and not chunked else 1
        if chunked:
            x0 = next(iter(b.inputs.values()))
            half = x0.dtype in (torch.bfloat16, torch.float16)
            dot = (3 if half and not self.meta.get("half_matmuls", True)      # launch._dot_code's rule
                   else 0 if (x0.dtype == torch.bfloat16 and _interpreting())
                   else {torch.bfloat16: 1, torch.float16: 2}.get(x0.dtype, 0))
            # one walk (PHASE 0) with a checkpoint at every chunk start (what the backward reads)
            kw.update(chunk=C, unit=16, dot=dot, n_seqs=b.n, chunk_seq=x0, phase=0, ckpt_every=1)
            # PHASE 0 has no loop over key blocks: KEY_BLOCK no less than any dim's block
            kw["key_block"] = max(kw["block", d] for d in meta["dims"])
        else:
            kw.update(ck=C)
        return kw, tiles, splits

    def _common(self, kw: dict, b: Bound, device) -> dict:
        """The values every kernel takes: the inputs, params and options, cu_seqlens, T, H and
        the dims as floats (`kw`: the blocks and switches, updated)."""
        kw.update({("input", k): x.contiguous() for k, x in b.inputs.items()})
        # grouped heads: H / the input's heads (launch.group_values)
        kw.update({("group", k): b.H // x.shape[2] if x.shape[2] else 1 for k, x in b.inputs.items()})
        kw.update({("param", k): x.contiguous() for k, x in b.params.items()})
        kw.update({("option", k): x for k, x in b.options.items()})
        kw["T"], kw["H"] = b.T, b.H
        kw.update({("fsize", d): float(b.sizes[d]) for d in self.meta["dims"]})
        kw["varlen"] = b.cu is not None
        return kw

    def _kernel(self, form: str, device):
        if device.type == "cpu" and not _interpreting():
            raise ArgumentError(
                "the tensors are on the CPU and Triton's interpreter is off: a compiled module runs its Triton "
                "kernels only, on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before Python starts; "
                "this module has no torch form for CPU tensors (it was generated by an older mixc: compile it again "
                "with `mixc compile NAME -o DIR`, whose module carries one)")
        return self.ns[self.meta["kernels"][form]]

    def forward(self, b: Bound, chunked: bool, C: int, output_final_state: bool, checkpoints: bool):
        meta = self.meta
        x0 = next(iter(b.inputs.values()))
        device = x0.device
        form = "chunk_fwd" if chunked else "recurrent_fwd"
        kernel = self._kernel(form, device)
        kw, tiles, splits = self._blocks(b, chunked, C)
        if not chunked:
            kw.update(state_indices=x0, use_indices=False)
        o_shape = (b.B, b.T, b.H) + tuple(b.sizes[d] for d in meta["output"]["shape"])
        out = _empty(((splits,) if splits > 1 else ()) + o_shape, torch.float32 if splits > 1 else x0.dtype, device)
        slots = (b.B * b.T) // C + b.n + 1
        v, finals, ckpts = self._common(kw, b, device), {}, {}
        for name, shape in meta["kernel_states"].items():
            shape = tuple(b.sizes[d] for d in shape)
            init = out
            if b.init is not None:
                init = (b.init[name].to(torch.float32).contiguous() if name in b.init
                        else torch.zeros((b.n, b.H) + shape, dtype=torch.float32, device=device))
            if output_final_state:
                finals[name] = _empty((b.n, b.H) + shape, torch.float32, device)
            if checkpoints:     # launch.checkpoint_dtype's rule: the chunked form's in bf16/fp16 inputs' dtype
                half = (chunked and x0.dtype in (torch.bfloat16, torch.float16) and name != "_m"
                        and meta.get("half_states", True)
                        and os.environ.get("MIXC_FP32_CHECKPOINTS") != "1")
                ckpts[name] = _empty((slots, b.H) + shape, x0.dtype if half else torch.float32, device)
            v["init", name], v["final", name], v["ckpt", name] = init, finals.get(name, out), ckpts.get(name, out)
            v["dense", name] = out          # PHASE 3's (launch.chunk_states): not launched here
        v["intra"], v["staged_intra"] = out, False      # PHASE 4's: not launched here (PHASE 0 computes them)
        v["out"] = out
        v["cu_seqlens"] = b.cu.to(device) if b.cu is not None else out
        v.update(use_initial=b.init is not None, store_final=output_final_state, store_ckpt=checkpoints)
        self.args[form].launch(kernel, (b.n * b.H, tiles, splits), v)
        if splits > 1:
            out = out.sum(0).to(x0.dtype)
        return out, finals, ckpts

    def backward(self, b: Bound, chunked: bool, C: int, ckpts: dict, do: torch.Tensor, dfinal: dict | None):
        meta, tile, split = self.meta, self.meta["tile"], self.meta["split"]
        device = do.device
        form = "chunk_bwd" if chunked else "recurrent_bwd"
        kernel = self._kernel(form, device)
        kw, tiles, splits = self._blocks(b, chunked, C)
        n, H = b.n, b.H

        def parts(dims) -> int:
            return ((tiles if tile is not None and tile not in dims else 1)
                    * (splits if split is not None and split not in dims else 1))

        v, dinit = self._common(kw, b, device), {}
        for name, shape in meta["kernel_states"].items():
            dims, shape = shape, tuple(b.sizes[d] for d in shape)
            dinit[name] = _empty((parts(dims) * n, H) + shape, torch.float32, device)
            dfin = None
            if dfinal:
                dfin = (dfinal[name].to(torch.float32).contiguous() if name in dfinal
                        else torch.zeros((n, H) + shape, dtype=torch.float32, device=device))
            if chunked:
                v["ckpt", name], v["dfinal", name] = ckpts[name], dfin if dfin is not None else dinit[name]
                v["dinit", name] = v["dh", name] = dinit[name]
            else:
                scratch = _empty((n * H * tiles * splits * C,) + shape, torch.float32, device)
                v["ckpt", name], v["scratch", name] = ckpts[name], scratch
                v["dfinal", name], v["dinit", name] = dfin if dfin is not None else scratch, dinit[name]
        # a grouped input's gradient per head (float32), its groups summed below (launch.sum_groups)
        dins = {k: (_empty(x.shape, x.dtype, device) if parts(meta["inputs"][k]) == 1 and x.shape[2] == H
                    else _empty((parts(meta["inputs"][k]),) + tuple(x.shape[:2]) + (H,) + tuple(x.shape[3:]),
                                torch.float32, device))
                for k, x in b.inputs.items()}
        dpars = {k: _empty((parts(meta["params"][k]) * n,) + tuple(x.shape), torch.float32, device)
                 for k, x in b.params.items()}
        v["do"] = do.contiguous()
        v.update({("dinput", k): x for k, x in dins.items()})
        v.update({("dparam", k): x for k, x in dpars.items()})
        v["cu_seqlens"] = b.cu.to(device) if b.cu is not None else do
        v["use_dfinal"] = dfinal is not None
        self.args[form].launch(kernel, (n * H, tiles, splits), v)
        dins = {k: v if v.shape == b.inputs[k].shape else _sum_groups(v.sum(0), b.inputs[k]) for k, v in dins.items()}
        dpars = {k: v.sum(0).to(b.params[k].dtype) for k, v in dpars.items()}
        dinit = {k: v if v.shape[0] == n else v.reshape((-1, n) + tuple(v.shape[1:])).sum(0) for k, v in dinit.items()}
        return dins, dpars, dinit

    # ---- the op ----
    def __call__(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
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
        C = (clamp_chunk(chunk, b.T, True) or self.meta["chunk_size"]) if chunked else clamp_ck(CK, b.T)
        return _run(self, b, chunked, C, output_final_state)

    def step(self, *, state, mode: str = "auto", **kwargs):
        """One token per sequence: inputs [B, H, *dims], state the dict from output_final_state.
        Returns (o [B, H, *dims], new state). Every mode runs the recurrent kernel (one token)."""
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
        b.inputs = {k: v.unsqueeze(1) for k, v in b.inputs.items()}       # T = 1
        o, st = _run(self, b, False, 32, True)
        return o[:, 0], st


def _run(op: CompiledOp, b: Bound, chunked: bool, C: int, output_final_state: bool):
    meta = op.meta
    kstates = list(meta["kernel_states"])
    init = [b.init[s] if (b.init is not None and s in b.init) else None for s in kstates]
    if b.init is not None and len(kstates) > len(meta["states"]):      # a stabilizer's m starts at 0
        x = init[0]
        init = init[:len(meta["states"])] + [x.new_zeros(x.shape[:2], dtype=torch.float32)]
    b.init = dict(zip(kstates, init)) if b.init is not None else None
    tensors = list(b.inputs.values()) + list(b.params.values()) + (list(b.init.values()) if b.init else [])
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
        ctx.init_dtypes = [x.dtype for x in b.init.values()] if b.init else []
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
        if b.init:
            grads += [dinit[s].to(dt) for s, dt in zip(kstates, ctx.init_dtypes)]
        return (None, None, None, None, None) + tuple(grads)

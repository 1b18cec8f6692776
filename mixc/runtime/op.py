"""MixerOp: what mixc.load() returns.

    o, state = op(q=..., k=..., ..., initial_state=None, output_final_state=False,
                  cu_seqlens=None, mode="auto", cp_group=None)
    o, state = op.step(q=..., ..., state=state)          # one token per sequence
    dec = op.decoder(state, <params>); o = dec.step(q, ...)   # a decode loop bound once (decoder.py)

cp_group: a torch.distributed group whose ranks each hold a contiguous shard of the sequence
(context parallelism, runtime/context_parallel.py, docs/distributed.md).

Modes: "chunk" (the fused chunked forward and backward kernels, for the linear classes),
"recurrent" (the fused recurrent forward and backward kernels, every class); the backward
starts from the states the forward keeps at chunk starts. "torch" is plain torch
with autograd in the inputs' dtype (float32 at least), the CPU backend: the chunked algorithm
of the kernels where a state is a matrix (the generated module's torch code, driven by
runtime/torch_chunk.py), and the spec's recurrence printed one token at a time
(codegen/torch_step.py, runtime/torch_step.py) for step() (in place too) and for the prefill
of the elementwise classes and short vector states (a loop over the tokens).
"reference" is the loop over t in float64 (ground truth). "conv" is the convolution form of a
time-invariant spec (runtime/conv_form.py: an FFT convolution with a kernel built from the
params, or the parallel form). "auto" takes the kernels (chunked where the spec has
that form) on CUDA tensors and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), and "torch" otherwise ("conv" where the spec has the FFT form and
T >= 64). A sequence mixer (conv, mix, attend) gets a SequenceOp (runtime/sequence.py)."""
from __future__ import annotations

from functools import lru_cache, partial

import torch

from ..derive.convform import AUTO_MIN_T, conv_form
from ..derive.plan import Plan, derive
from ..dsl import MixerIR
from . import fastpath, launch
from . import reference as _reference
from .cache import interpreting, load_module
from .conv_form import conv_forward
from .custom_op import kernel_ops
from .inputs import RANGE_CHECKED_MODES, check_ranges
from .decode import step_inplace
from .decoder import Decoder, op_step_token
from .sequence import SequenceOp
from .torch_chunk import torch_chunked
from .system_chunk import SYSTEM_CHUNK, system_chunked
from ..derive.system_chunk import kernel_unsupported as system_kernel_unsupported
from .torch_step import TORCH_INPLACE, TorchStep, run_recipe, step_recipe, torch_step, torch_tokens, use_token_loop
from .launch import chunk_size_for
from .op_doc import call_doc, call_signature
from ..standalone.binding import clamp_chunk, clamp_ck
from .signature import ArgumentError, Bound, bind, check_chunking, check_flag_argument, option_values  # noqa: F401
from ..standalone.shift import Carry, StepCarry
from .spec_held import HeldBySpec

MODES = ("auto", "recurrent", "chunk", "conv", "torch", "reference")


class MixerOp(HeldBySpec):
    is_sequence = False

    def __init__(self, mixer: MixerIR):
        self.ir = mixer
        self._plans: dict[tuple, Plan] = {}
        self._ops: dict[tuple, tuple] = {}
        self._fast: dict[tuple, fastpath.StepRecipe] = {}     # replayable launches of op(), step() by argument look
        self._tokens: dict[int, object] = {}      # op.step(inplace=True, mode="torch") bound per state, by id
        # what inspect.signature(op) and help(op) show: the spec's arguments (runtime/op_doc.py)
        self.__signature__ = call_signature(mixer)
        self.__doc__ = call_doc(mixer)

    @property
    def name(self) -> str:
        return self.ir.name

    def __repr__(self) -> str:
        return f"<mixc op '{self.name}' from {self.ir.source.filename}>"

    def plan(self, **flags) -> Plan:
        """The derivation for the given flag values (the spec's defaults otherwise)."""
        return _cached_plan(self.ir, self.ir.source, tuple(sorted(flags.items())))

    # ---- the op ----
    def __call__(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                 mode: str = "auto", CK: int = 32, chunk: int | None = None, cp_group=None, **kwargs):
        if not self.ir.shifted:
            return self._call(initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, mode=mode, CK=CK, chunk=chunk, cp_group=cp_group, **kwargs)
        # prev(x) of inputs: the derived inputs computed here, the last tokens carried in the state
        # (standalone/shift.py); with cp_group by cp_call, which brings the previous rank's last x
        if cp_group is not None:
            return self._call(initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, mode=mode, CK=CK, chunk=chunk, cp_group=cp_group, **kwargs)
        carry = Carry(self.ir, kwargs, initial_state, cu_seqlens)
        o, st = self._call(initial_state=carry.state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           mode=mode, CK=CK, chunk=chunk, **carry.kwargs)
        return o, carry.final(st)

    def _call(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
              mode: str = "auto", CK: int = 32, chunk: int | None = None, cp_group=None, **kwargs):
        if mode not in MODES:
            raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
        check_flag_argument("output_final_state", output_final_state)
        if cp_group is not None:        # this rank holds a shard of the sequence (runtime/context_parallel.py)
            from .context_parallel import cp_call
            return cp_call(self, cp_group, kwargs=kwargs, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           call=lambda **local: self._call(**kwargs, mode=mode, CK=CK, chunk=chunk, **local))
        check_chunking(mode, CK, chunk)          # as a compiled module's (standalone/binding.py)
        key = None
        if ((cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor)) and type(mode) is str and type(CK) is int
                and (chunk is None or type(chunk) is int) and not torch.compiler.is_compiling()):
            # a call like an earlier kernel call replays its launches (runtime/fastpath.py); packed
            # offsets are keyed by their look, their values checked per call
            packed = None if cu_seqlens is None else fastpath._meta(cu_seqlens)
            key = fastpath.step_key(("call", mode, output_final_state, CK, chunk, packed), kwargs, initial_state)
            recipe = self._fast.get(key) if key is not None else None
            if recipe is not None:
                return fastpath.run_step(recipe, kwargs, initial_state, cu_seqlens=cu_seqlens)
        _refuse_option_gradients(self.ir, kwargs)
        bound = bind(self.ir, dict(kwargs, initial_state=initial_state, cu_seqlens=cu_seqlens))
        device = next(iter(bound.inputs.values())).device
        asked, mode = mode, self._resolve(mode, device)
        _refuse_meta(bound, mode)
        if mode in RANGE_CHECKED_MODES:
            check_ranges(self.ir, bound)      # the values the spec declares (`input beta[] in (0, 2)`)
        if cu_seqlens is not None and mode in ("torch", "reference", "conv") and torch.compiler.is_compiling():
            raise ArgumentError(f"cu_seqlens: mode {mode!r} splits the packed sequences by their offsets on the "
                                "host, which torch.compile cannot trace; inside a compiled region use a kernel mode "
                                "('chunk', 'recurrent': their custom op checks the offsets), or call the op outside it")
        plan = self._plan_for(bound.flags)
        # no sequence or no head (B = 0, H = 0): the token loop returns the empty outputs the
        # kernels do; the chunked and convolution forms' reshapes could not infer a size of 0
        empty = bound.B == 0 or bound.H == 0
        if empty and mode in ("conv", "torch"):
            mode = "torch"
        elif mode == "conv" or (asked == "auto" and mode == "torch" and use_conv_form(plan, bound)):
            # grouped inputs repeated per head here (the kernels alone read a shared head in place)
            o, st = conv_forward(plan, bound.expanded(), output_final_state=output_final_state,
                                 dtype=_compute_dtype(bound))
            return o.to(next(iter(bound.inputs.values())).dtype), _state_dtype(st, bound)
        if mode == "torch" and not empty and use_token_loop(plan, bound):
            # the generated step in a loop over the tokens (runtime/torch_step.py: where it is faster)
            o, st = torch_tokens(plan, bound.expanded(), output_final_state=output_final_state,
                                 dtype=_compute_dtype(bound))
            return o.to(next(iter(bound.inputs.values())).dtype), _state_dtype(st, bound)
        if mode == "torch" and plan.layout.torch_chunked and not empty:
            o, st = torch_chunked(plan, bound.expanded(), output_final_state=output_final_state,
                                  dtype=_compute_dtype(bound), C=clamp_chunk(chunk, bound.T, False))
            # chunk None: the torch backend's own C
            return o.to(next(iter(bound.inputs.values())).dtype), _state_dtype(st, bound)
        if mode in ("torch", "reference"):
            dtype = torch.float64 if mode == "reference" else _compute_dtype(bound)
            o, st = _reference.run_reference(self.ir, **kwargs, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         dtype=dtype)
            if mode == "torch":
                return o.to(next(iter(bound.inputs.values())).dtype), _state_dtype(st, bound)
            return o, st
        if mode == "chunk" and plan.systems and not empty:
            # a 2x2 block-affine system: its own chunked kernels over the torch pieces (runtime/system_chunk.py)
            why = system_kernel_unsupported(plan)
            if why is not None:
                raise ArgumentError(f"mode='chunk': mixer '{self.name}' has no chunked kernel ({why}); "
                                    "use mode='recurrent'")
            o, st = system_chunked(plan, bound.expanded(), output_final_state=output_final_state,
                                   C=clamp_chunk(chunk, bound.T, True) if chunk is not None else SYSTEM_CHUNK)
            return o.to(next(iter(bound.inputs.values())).dtype), st
        if mode == "chunk" or (mode == "auto" and "chunk" in plan.forms):
            why = plan.layout.chunk_unsupported
            if why is not None:
                # (an empty call of a system with its own chunked kernels: the recurrent kernels' empty outputs)
                if mode == "chunk" and not (empty and plan.systems and "chunk" in plan.forms):
                    raise ArgumentError(f"mode='chunk': mixer '{self.name}' has no chunked kernel ({why}); "
                                        "use mode='recurrent'")
            else:
                C = chunk_size_for(plan, bound) if chunk is None else clamp_chunk(chunk, bound.T, True)
                return self._kernels_recorded(key, kwargs, bound, output_final_state, C, True)
        return self._kernels_recorded(key, kwargs, bound, output_final_state, clamp_ck(CK, bound.T), False)

    def _kernels_recorded(self, key, kwargs, bound, output_final_state: bool, CK: int, chunked: bool,
                          one_token: bool = False):
        """_kernels, its launches kept for replay under key where the call wants no gradients
        (runtime/fastpath.py: one launch, or the chunked forward's walk and output kernels)."""
        with launch.recording() as log:
            o, st = self._kernels(bound, output_final_state, CK, chunked)
        if key is not None and not (torch.is_grad_enabled() and _needs_grad(bound)):
            recipe = fastpath.recipe_from(log, self.ir, kwargs, partial(_unstabilize, self._plan_for(bound.flags)),
                                          one_token=one_token)
            if recipe is not None:
                if len(self._fast) >= fastpath.MAX_RECIPES:
                    self._fast.clear()
                self._fast[key] = recipe
        return o, st

    def _kernels(self, bound, output_final_state: bool, CK: int, chunked: bool):
        """The kernels through the registered custom op (autograd included): the chunked or the
        recurrent forward and backward."""
        m = self.ir
        plan = self._plan_for(bound.flags)
        inputs = [bound.inputs[d.name] for d in m.inputs]
        params = [bound.params[d.name] for d in m.params]
        init = [bound.initial_state[s.name] for s in m.states] if bound.initial_state is not None else []
        opts = option_values(m, bound)
        save = torch.is_grad_enabled() and any(t.requires_grad for t in inputs + params + init)
        kstates = plan.kernel_ir.states
        if init and len(kstates) > len(m.states):       # a stabilizer's m starts at 0 with a given state
            init = init + [init[0].new_zeros(init[0].shape[:2], dtype=torch.float32)]
        fwd = self.prepare(**bound.flags).call        # eager: no custom-op dispatch (custom_op.py)
        outs = fwd(inputs, params, init, [opts[o.name] for o in m.options if o.kind == "float"],
                   bound.cu_seqlens, output_final_state, save, chunked, CK)
        if not output_final_state:
            return outs[0], None
        return outs[0], _unstabilize(plan, {s.name: f for s, f in zip(kstates, outs[1:1 + len(kstates)])})

    def prepare(self, **flags):
        """Derive and register the kernels' custom ops for these flags (the defaults otherwise).
        Calls look them up in a plain dict, so torch.compile traces no derivation: call
        prepare() (or the op once) eagerly before compiling a model with other flag values.
        The generated module is imported here too: torch.compile cannot trace the cache's file
        work, and every mode but "reference" reads the module (the kernels, the torch backend's
        chunked form, the convolution form)."""
        key = tuple(sorted(({o.name: o.default for o in self.ir.flags} | flags).items()))
        if key not in self._ops:
            plan = self._plan_for(dict(key))
            load_module(plan)
            conv_form(plan)                 # remembered per plan: a dict lookup when traced
            self._ops[key] = kernel_ops(plan)
        return self._ops[key]

    def _plan_for(self, flags: dict) -> Plan:
        key = tuple(sorted(({o.name: o.default for o in self.ir.flags} | flags).items()))
        if key not in self._plans:            # a plain dict: cheap, and traceable by torch.compile
            self._plans[key] = _cached_plan(self.ir, self.ir.source, key)
        return self._plans[key]

    def step(self, *, state, mode: str = "auto", inplace: bool = False, state_indices=None, **kwargs):
        if (inplace is True and mode == "torch" and state_indices is None and not self.ir.shifted
                and not torch.compiler.is_compiling()):
            # a decode loop's hot path, the torch backend's in-place step replayed: first the step
            # bound to this state (runtime/decoder.py's op_step_token: the call's look compared,
            # no key built), then the key (runtime/decode.py keeps the recipe under it), tested
            # here, not after another call with **kwargs (~3 us of a ~70 us step at B = 1, where
            # issue 33 allows 1.25x a hand-written update)
            token = self._tokens.get(id(state))
            if token is not None and (done := token(kwargs, state)) is not None:
                return done
            recipe = self._fast.get(fastpath.step_key(TORCH_INPLACE, kwargs, state, launches=False))
            if recipe is not None:
                if recipe.replay is not None:
                    if len(self._tokens) >= fastpath.MAX_RECIPES:
                        self._tokens.clear()
                    self._tokens[id(state)] = op_step_token(recipe, kwargs, state)
                return run_recipe(recipe, kwargs, state)
        if not self.ir.shifted:
            return self._step(state=state, mode=mode, inplace=inplace, state_indices=state_indices, **kwargs)
        # prev(x) of inputs: the state's prev_x is this token's derived input; the new state
        # carries this token's x (standalone/shift.py)
        if not isinstance(inplace, bool):
            raise ArgumentError(f"inplace: expected True or False, got {inplace!r}")
        carry = StepCarry(self.ir, kwargs, state, inplace, state_indices)
        o, st = self._step(state=carry.state, mode=mode, inplace=inplace, state_indices=state_indices, **carry.kwargs)
        return o, carry.new_state(st)

    def decoder(self, state, *, mode: str = "auto", state_indices=None, check_ranges: bool = True, **bound):
        """A decode loop bound once (runtime/decoder.py): dec = op.decoder(state, <params>,
        <options>, mode=...); o = dec.step(<one token of each input>) updates the state buffers
        in place as op.step(..., inplace=True) does, binding the token's look once."""
        if type(mode) is not str or mode not in MODES:
            raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
        return Decoder(self, state, mode=mode, state_indices=state_indices, check_ranges=check_ranges, **bound)

    def _step(self, *, state, mode: str = "auto", inplace: bool = False, state_indices=None, **kwargs):
        """One token per sequence: inputs [B, H, *dims] (a scalar per head [B, H]), params as
        usual, state the dict from output_final_state (or a previous step). Returns (o [B, H,
        *dims], new state). inplace=True updates the given state buffers instead (float32,
        contiguous) and returns them; state_indices [B] int: the state is a cache [N_slots, H,
        ...] and sequence i uses slot state_indices[i] (runtime/decode.py: decode for serving).
        A step whose arguments look like an earlier kernel step's (shapes, dtypes, devices, flags
        and numbers: runtime/fastpath.py) replays that step's launch without binding again."""
        key = None
        if mode not in MODES:       # before the fast path's key: a list there was a TypeError (unhashable)
            raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if inplace is True and mode == "torch" and state_indices is None and not torch.compiler.is_compiling():
            # the torch backend's in-place step replayed (runtime/decode.py keeps it under this key)
            recipe = self._fast.get(fastpath.step_key(TORCH_INPLACE, kwargs, state, launches=False))
            if recipe is not None:
                return run_recipe(recipe, kwargs, state)
        if inplace is False and state_indices is None and not torch.compiler.is_compiling():
            key = fastpath.step_key(mode, kwargs, state)
            recipe = self._fast.get(key) if key is not None else None
            if isinstance(recipe, TorchStep):
                return run_recipe(recipe, kwargs, state)
            if recipe is not None:
                return fastpath.run_step(recipe, kwargs, state)
        if "initial_state" in kwargs:
            raise ArgumentError("initial_state: step() takes the state as state=..., not initial_state=")
        if not isinstance(inplace, bool):
            raise ArgumentError(f"inplace: expected True or False, got {inplace!r}")
        if state_indices is not None and not inplace:
            raise ArgumentError("state_indices: a cache of slots is updated in place; pass inplace=True too")
        _refuse_option_gradients(self.ir, kwargs)
        if inplace:
            return step_inplace(self, state=state, state_indices=state_indices, mode=mode, kwargs=kwargs)
        if not isinstance(state, (dict, torch.Tensor)):
            raise ArgumentError("state: step() needs the state dict that output_final_state=True returns")
        bound = bind(self.ir, dict(kwargs, initial_state=state), step=True)
        device = next(iter(bound.inputs.values())).device
        mode = self._resolve(mode, device)
        _refuse_meta(bound, mode)
        if mode in RANGE_CHECKED_MODES:
            check_ranges(self.ir, bound)
        if mode == "conv":            # one token: the convolution form has nothing to gain; the torch step
            mode = "torch"
        if mode == "torch":
            # the spec's recurrence for one token, printed by codegen (codegen/torch_step.py)
            plan = self._plan_for(bound.flags)
            if key is not None and (recipe := step_recipe(plan, bound, False, kwargs)) is not None:
                self._keep(key, recipe)
            return torch_step(plan, bound, _compute_dtype(bound))
        if mode == "reference":
            return _reference.run_reference_step(self.ir, state=state, dtype=torch.float64, **kwargs)
        # the recurrent kernels on the arguments bound above (bound once, not again by __call__)
        o, st = self._kernels_recorded(key, kwargs, _as_sequence(bound), True, 32, False, one_token=True)
        return o[:, 0], st

    def _keep(self, key, recipe) -> None:
        """A replayable call under its key (a bounded dict: runtime/fastpath.py)."""
        if len(self._fast) >= fastpath.MAX_RECIPES:
            self._fast.clear()
        self._fast[key] = recipe

    def reference(self, **kwargs):
        """The spec as a float64 loop over t with autograd: (o float64, state dict or None)."""
        return _reference.reference(self.ir, **kwargs)

    def reference_step(self, *, state, **kwargs):
        """One token per sequence through the float64 reference: (o, new state dict)."""
        return _reference.reference_step(self.ir, state=state, **kwargs)

    @staticmethod
    def _resolve(mode: str, device: torch.device) -> str:
        if mode != "auto":
            return mode
        if device.type == "cuda" or (device.type == "cpu" and interpreting()):
            return "auto"           # the kernels: chunked where the spec has that form
        return "torch"


def _unstabilize(plan: Plan, st: dict) -> dict:
    """The kernels' final states as the spec's. With a stabilizer the kernels keep S~ = S exp(-m);
    the spec's state is S (inf where it exceeds fp32). Autograd carries dS~ = dS exp(m) into the
    kernels' backward, which holds m constant."""
    if plan.stabilizer is None:
        return st
    mf = st.pop("_m")
    for name in plan.stabilizer.states:
        x = st[name]
        st[name] = x * torch.exp(mf).reshape(mf.shape + (1,) * (x.dim() - 2))
    return st


def _refuse_option_gradients(mixer, kwargs: dict) -> None:
    """A number option is a constant of the call (read as a float, a kernel scalar): given as a
    tensor that requires grad, its gradient would silently be lost (issue 30)."""
    if not torch.is_grad_enabled():
        return
    for opt in mixer.options:
        v = kwargs.get(opt.name)
        if isinstance(v, torch.Tensor) and v.requires_grad:
            raise ArgumentError(f"{opt.name}: a tensor that requires grad, but number options are constants of "
                                "the call (read as a float), so no gradient would reach it; pass a float (or "
                                ".detach() it), or make it a `param` of the spec to learn it")


def _needs_grad(bound: Bound) -> bool:
    return any(t.requires_grad for t in (*bound.inputs.values(), *bound.params.values(),
                                         *(bound.initial_state or {}).values()))


def _as_sequence(bound: Bound) -> Bound:
    """A step's bound arguments as a sequence of one token (inputs [B, 1, H, *dims])."""
    return Bound(bound.B, 1, bound.H, bound.sizes, {k: v.unsqueeze(1) for k, v in bound.inputs.items()},
                 bound.params, bound.options, bound.flags, bound.initial_state, None, bound.groups)


def _state_dtype(st, bound):
    """States leave the torch backend in float32, or in float64 when the inputs are float64 (a
    float32 state would cut the precision of what a float64 caller carries on, and of the
    gradients that flow through it)."""
    dtype = _compute_dtype(bound)
    return {k: v.to(dtype) for k, v in st.items()} if st is not None else None


def _compute_dtype(bound) -> torch.dtype:
    """The torch backend computes in float32 at least (bf16/fp16 inputs are upcast), in float64
    where any input or param is float64: torch's type promotion (float64 q, k, v with a float32
    gate, as Kimi-Linear's layer passes them, were computed in float32, issue 30). The output
    keeps the first input's dtype, as fla's ops return q's."""
    dtypes = {x.dtype for x in (*bound.inputs.values(), *bound.params.values())}
    return torch.float64 if torch.float64 in dtypes else torch.float32


@lru_cache(maxsize=256)
def _cached_plan(mixer: MixerIR, source, flags: tuple) -> Plan:
    # keyed by the source too: MixerIR's equality ignores it, and the generated module embeds
    # the spec's text and file name
    return derive(mixer, dict(flags))


def make_op(mixer: MixerIR):
    """The op of a checked spec: a MixerOp for a recurrence, a SequenceOp for conv, mix, attend."""
    if mixer.is_sequence:
        return SequenceOp(mixer)
    return MixerOp(mixer)


def use_conv_form(plan: Plan, bound) -> bool:
    """mode="auto" on the torch backend takes the FFT convolution form of a time-invariant spec
    whose kernel comes from the params alone, from AUTO_MIN_T tokens on (derive/convform.py)."""
    cf = conv_form(plan)
    return cf is not None and cf.fft and bound.T >= AUTO_MIN_T


def _refuse_meta(bound, mode: str) -> None:
    """Tensors on the meta device hold no values: the float64 reference propagates their shapes
    (a loop of torch ops), every other mode reads values (the torch backend's host checks, the
    kernels) and raised torch's own errors from inside mixc."""
    name, x = next(iter(bound.inputs.items()))
    if x.device.type == "meta" and mode != "reference":
        raise ArgumentError(f"{name}: on device meta, which holds no values; mode {mode!r} computes on cpu or "
                            "cuda (mode='reference' propagates meta shapes)")

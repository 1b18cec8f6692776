"""A decode loop bound once: op.decoder(state, <params>, <options>) (issue 33).

    dec = op.decoder(state, u=u, mode="torch")      # state: the buffers, updated in place
    for token in ...:
        o = dec.step(r, k, v, w)                    # the spec's inputs, in order or by name

As FlashInfer's decode wrappers plan once and then run per token, a Decoder binds what stays
fixed over a decode loop (the state buffers, the params, options and flags, the mode) and the
first step binds the token's look (shapes, dtypes, devices) through op.step(..., inplace=True)
with every check op.step makes. Each later token whose inputs look the same runs the generated
in-place step directly (mode "torch": runtime/torch_step.py's torch_step_): per token only the
look of its inputs is compared with the first's, and the declared ranges of its inputs are
checked (`input w[K] in [-inf, 0]`: the same check and the same ArgumentError as op.step's;
check_ranges=False skips it, for a loop whose gates come from the model's own logsigmoid).
op.step(inplace=True) pays besides the look of every argument (params, numbers, the state's
buffers) and its own dispatch per token (op_step_token below; before it is bound, a key of
every argument and its hash): ~5-10 us of a ~80 us step at B = 1, H = 16, K = V = 128
(bench/decode_cpu).

Anything else takes op.step as it is (its errors name the argument): a token that looks
different (it is bound again), the kernel modes (op.step replays their launch), cache slots
(state_indices), prev(x) inputs, inputs that are not float32, gradients wanted (op.step refuses
them by name: the state is written outside autograd), torch.compile tracing."""
from __future__ import annotations

import weakref

import torch

from ..standalone.errors import ArgumentError
from . import fastpath
from .torch_step import TorchStep

_Tensor, _strided = torch.Tensor, torch.strided


class Decoder:
    """op.decoder(state, ...): dec.step(<one token of each input>) -> o [B, H, *out dims],
    the state buffers (dec.state) updated in place. See the module docstring."""

    def __init__(self, op, state, *, mode: str = "auto", state_indices=None, check_ranges: bool = True,
                 **bound):
        m = op.ir               # (mode: checked by op.decoder, op.py's MODES)
        if not isinstance(check_ranges, bool):
            raise ArgumentError(f"check_ranges: expected True or False, got {check_ranges!r}")
        if not isinstance(state, (dict, torch.Tensor)):
            raise ArgumentError(f"state: expected the state buffers (a dict keyed by state name, or a tensor for a "
                                f"single state) that op.decoder updates in place, got {type(state).__name__}")
        inputs = [d.name for d in m.given_inputs]
        fixed = {d.name for d in (*m.params, *m.options, *m.flags)}
        for name in bound:
            if name in inputs:
                raise ArgumentError(f"{name}: an input of '{m.name}' (one token per step): pass it to dec.step(), "
                                    f"not op.decoder(); op.decoder() binds the params, options and flags")
            if name in ("initial_state", "inplace"):
                raise ArgumentError(f"{name}: op.decoder() takes the state buffers as its first argument and always "
                                    "updates them in place")
            if name not in fixed:
                known = ", ".join(sorted(fixed)) or "none"
                raise ArgumentError(f"{name}: not a param, option or flag of '{m.name}' (it has: {known})")
        self.op, self.mode, self.check_ranges = op, mode, check_ranges
        self.inputs = tuple(inputs)
        self._state, self._indices, self._bound = state, state_indices, dict(bound)
        self._run = None            # the bound token (_bind_tokens), once a step has run
        self._tried = False         # whether a token was bound (op.step for every token where none can be)

    @property
    def state(self):
        """The state buffers, as given (updated in place by each step)."""
        return self._state

    def __repr__(self) -> str:
        how = "bound" if self._run is not None else "through op.step"
        return f"<mixc decoder of '{self.op.name}', mode {self.mode!r}, {how}>"

    def step(self, *args, **inputs):
        """One token of each input ([B, H, *dims]; a scalar per head [B, H]), by position in
        the spec's order or by name: returns o [B, H, *out dims]; dec.state is updated. Once a
        token is bound, the instance's step is the bound one (bound_token), which comes back
        here through _through_op_step for a token it cannot run."""
        if args:
            inputs = self._by_name(args, inputs)
        return self._through_op_step(inputs)

    def _through_op_step(self, inputs: dict):
        o, _ = self.op.step(**inputs, **self._bound, state=self._state, mode=self.mode, inplace=True,
                            state_indices=self._indices)
        if self._run is not None or not self._tried:     # the first token, or one that looks new: bound now
            self._tried = True
            self._run = self._bind_tokens(inputs)
            if self._run is not None:
                self.step = self._run           # (one Python frame less per token than a method)
            else:
                self.__dict__.pop("step", None)
        return o

    def _by_name(self, args: tuple, inputs: dict) -> dict:
        if len(args) > len(self.inputs):
            raise ArgumentError(f"dec.step(): '{self.op.name}' takes {len(self.inputs)} inputs "
                                f"({', '.join(self.inputs)}), got {len(args)} positional arguments")
        named = dict(zip(self.inputs, args))
        for k in inputs:
            if k in named:
                raise ArgumentError(f"{k}: given by position and by name")
        return named | inputs

    def _bind_tokens(self, inputs: dict):
        """After a step through op.step: the direct in-place step for tokens that look like this
        one, or None (op.step for every token: the module docstring's cases)."""
        if self._indices is not None or self.op.ir.shifted or torch.compiler.is_compiling():
            return None
        kwargs = {**inputs, **self._bound}
        key = fastpath.step_key(("inplace", self.mode), kwargs, self._state)
        recipe = self.op._fast.get(key) if key is not None else None
        if not isinstance(recipe, TorchStep) or recipe.replay is None:
            return None         # a kernel launch (op.step replays it), or no direct in-place step
        params = {k: self._bound[k] for k in recipe.params if k in self._bound}
        if len(params) != len(recipe.params):
            return None         # a param bind filled in (not the decoder's to hold)
        return bound_token(recipe, inputs, params, self._state, self.check_ranges, self._by_name,
                           self._through_op_step)


def bound_token(r: TorchStep, first: dict, params: dict, state, check_ranges: bool, by_name, fallback):
    """dec.step for tokens that look like `first` (its inputs' names, shapes, dtypes, devices):
    the generated in-place step on the decoder's buffers and params, or fallback(inputs)
    (op.step, which binds again or names what is wrong) for a token that looks otherwise. The
    buffers are checked to be the ones bound (a dict entry replaced is bound again) with their
    shapes, and the params' shapes (resize_ between steps would change them)."""
    step_, guard = r.mod.torch_step_, (r.guard if check_ranges else None)
    opt, sizes, B, H, out = r.opt, r.sizes, r.B, r.H, r.out_dtype
    buffers = {r.first_state: state} if isinstance(state, torch.Tensor) else state
    looks = tuple((k, t.shape, t.dtype, t.device) for k, t in first.items())
    held = tuple((buffers, k, t, t.shape) for k, t in buffers.items()) + tuple(
        (params, k, t, t.shape) for k, t in params.items())
    n, grads = len(looks), (*params.values(), *buffers.values())

    def step(*args, **x):
        if args:
            x = by_name(args, x)
        if len(x) != n:
            return fallback(x)
        for name, shape, dtype, device in looks:
            t = x.get(name)
            if (type(t) is not _Tensor or t.shape != shape or t.dtype is not dtype or t.device != device
                    or t.layout is not _strided):
                return fallback(x)
        for where, name, t, shape in held:
            if where.get(name) is not t or t.shape != shape or not t.is_contiguous():
                return fallback(x)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*x.values(), *grads)):
            return fallback(x)          # op.step names what requires grad
        if torch.compiler.is_compiling():
            return fallback(x)
        if guard is not None:
            guard(x)
        o = step_(x, params, opt, sizes, B, H, buffers)
        return o if o.dtype is out else o.to(out)
    return step


_MISSING = object()


def op_step_token(r: TorchStep, first: dict, state):
    """op.step(..., mode="torch", inplace=True) bound for one state (op.py keeps one per state
    it has stepped, by id): (kwargs, state) -> (o, state), or None where a call looks otherwise
    than `first` and `state` did (its arguments' names, shapes, dtypes, devices, numbers; the
    same buffers, by identity), and op.step then takes its key. What it saves against the key:
    building and hashing a tuple of every argument's look per token. The buffers are held by
    weak references: a state its caller drops is not kept alive here."""
    step_, guard = r.mod.torch_step_, r.guard
    opt, sizes, B, H, out, name0 = r.opt, r.sizes, r.B, r.H, r.out_dtype, r.first_state
    tensors = tuple((k, t.shape, t.dtype, t.device) for k, t in first.items() if isinstance(t, _Tensor))
    numbers = tuple((k, type(v), v) for k, v in first.items() if not isinstance(v, _Tensor))
    n, single = len(first), isinstance(state, _Tensor)
    entries = ((name0, weakref.ref(state), state.shape),) if single else tuple(
        (k, weakref.ref(t), t.shape) for k, t in state.items())

    def token(kw: dict, st):
        if len(kw) != n or torch.compiler.is_compiling():
            return None
        for name, shape, dtype, device in tensors:
            t = kw.get(name)
            if (not isinstance(t, _Tensor) or t.shape != shape or t.dtype is not dtype or t.device != device
                    or t.layout is not _strided):
                return None
        for name, kind, value in numbers:
            v = kw.get(name, _MISSING)
            if type(v) is not kind or v != value:
                return None
        if single:
            name, ref, shape = entries[0]
            if st is not ref() or st.shape != shape or not st.is_contiguous():
                return None
            buffers = {name: st}
        else:
            if type(st) is not dict or len(st) != len(entries):
                return None
            for name, ref, shape in entries:
                t = st.get(name)
                if t is None or t is not ref() or t.shape != shape or not t.is_contiguous():
                    return None
            buffers = st
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*kw.values(), *buffers.values())
                                           if isinstance(t, _Tensor)):
            return None             # op.step names what requires grad
        if guard is not None:
            guard(kw)
        o = step_(kw, kw, opt, sizes, B, H, buffers)
        return (o if o.dtype is out else o.to(out)), st
    return token

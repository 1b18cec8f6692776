"""SequenceOp: what mixc.load() returns for a sequence mixer (conv, mix, attend), with the
call convention of the recurrent ops:

    o, state = op(<inputs>, <params>, <options>, initial_state=None, output_final_state=False,
                  cu_seqlens=None, mode="auto")
    o, state = op.step(<one token of each input>, <params>, state=state)

The state is a cache of the past, {"pos": [N] tokens seen per sequence, "<op><i>_<arg>":
[N, H, length, *dims]} (derive/sequence.py names the entries per op): a window's worth for
a convolution with a tap dim and for sliding-window attention, every past token for full
attention, token mixing and filters as long as the sequence, a running sum for a constant
filter. A step is the call with one token and the cache, so prefill then steps equals the
whole sequence. Non-causal ops read the future: their mixers refuse states and step().

Modes: "auto" and "torch" run the fast ops in the inputs' dtype (float32 at least): FFT for
long filters, scaled_dot_product_attention (flex_attention with a block mask on CUDA);
"reference" runs direct sums and the written-out masked softmax in float64 without the
exponential scales. Gradients are torch autograd's."""
from __future__ import annotations

from functools import lru_cache

import torch

from ..derive.plan import Plan, derive
from ..dsl import MixerIR, ir
from .op_doc import call_doc, call_signature
from .sequence_eval import Run, evaluate, leaves
from .signature import ArgumentError, _scalar, bind, option_values
from .spec_held import HeldBySpec

MODES = ("auto", "torch", "reference")


class SequenceOp(HeldBySpec):
    is_sequence = True

    def __init__(self, mixer: MixerIR):
        self.ir = mixer
        self._plans: dict[tuple, Plan] = {}
        # what inspect.signature(op) and help(op) show: the spec's arguments (runtime/op_doc.py)
        self.__signature__ = call_signature(mixer)
        self.__doc__ = call_doc(mixer)

    @property
    def name(self) -> str:
        return self.ir.name

    def __repr__(self) -> str:
        return f"<mixc sequence op '{self.name}' from {self.ir.source.filename}>"

    def plan(self, **flags) -> Plan:
        return self._plan_for(flags)

    def prepare(self, **flags) -> Plan:
        """Derive the plan for these flags (no kernels to register: torch computes it)."""
        return self._plan_for(flags)

    def can_step(self, **flags) -> bool:
        return self._plan_for(flags).sequence.no_step is None

    def _plan_for(self, flags: dict) -> Plan:
        key = tuple(sorted(({o.name: o.default for o in self.ir.flags} | flags).items()))
        if key not in self._plans:
            self._plans[key] = _cached_plan(self.ir, self.ir.source, key)
        return self._plans[key]

    # ---- the op ----
    def __call__(self, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                 mode: str = "auto", **kwargs):
        _check_mode(self.name, mode)
        if not isinstance(output_final_state, bool):       # "no" would be taken as true
            raise ArgumentError(f"output_final_state: expected True or False, got {output_final_state!r} "
                                f"({type(output_final_state).__name__})")
        # grouped inputs (GQA's k, v) repeated per head: the sequence runtime reads every head's
        bound = bind(self.ir, dict(kwargs, initial_state=initial_state, cu_seqlens=cu_seqlens)).expanded()
        plan = self._plan_for(bound.flags)
        seq = plan.sequence
        if seq.no_step is not None and (initial_state is not None or output_final_state):
            what = "initial_state" if initial_state is not None else "output_final_state=True"
            raise ArgumentError(f"{what}: mixer '{self.name}' has no state to continue from: {seq.no_step}")
        ref = mode == "reference"
        x0 = next(iter(bound.inputs.values()))
        dtype = torch.float64 if ref or {x.dtype for x in bound.inputs.values()} == {torch.float64} else torch.float32
        opts = option_values(self.ir, bound)
        windows = _windows(self.ir, plan, bound, opts)
        cache = _check_cache(self.ir, plan, bound, initial_state, windows) if initial_state is not None else None
        o, st = _run(self.ir, plan, bound, opts, windows, cache, dtype, "reference" if ref else "torch",
                     stabilize=not ref, x0=x0)
        if not ref:
            o = o.to(x0.dtype)
        return o, (st if output_final_state else None)

    def step(self, *, state, mode: str = "auto", **kwargs):
        """One token per sequence: inputs [B, H, *dims] (a scalar per head [B, H]), params as usual,
        state the cache from output_final_state (or a previous step). Returns (o [B, H, *dims],
        new state)."""
        _check_mode(self.name, mode)
        if "initial_state" in kwargs:
            raise ArgumentError("initial_state: step() takes the state as state=..., not initial_state=")
        if not isinstance(state, dict):
            raise ArgumentError("state: step() needs the cache dict that output_final_state=True returns")
        bind(self.ir, dict(kwargs, initial_state=state), step=True)        # one token's shapes, in step()'s words
        names = {d.name for d in self.ir.inputs}
        seq = {k: (v.unsqueeze(1) if k in names else v) for k, v in kwargs.items()}
        o, st = self(**seq, initial_state=state, output_final_state=True, mode=mode)
        return o[:, 0], st

    def reference(self, **kwargs):
        """Direct sums and the written-out masked softmax in float64, with autograd: (o, state)."""
        return self(**kwargs, mode="reference")

    def reference_step(self, *, state, **kwargs):
        return self.step(state=state, mode="reference", **kwargs)


def _check_mode(name: str, mode) -> None:
    if mode in MODES:
        return
    if mode in ("chunk", "recurrent", "conv"):
        raise ArgumentError(f"mode={mode!r}: mixer '{name}' is a sequence mixer (conv, mix, attend), not a "
                            f"recurrence, so it has no {mode} form; modes: 'auto', 'torch', 'reference'")
    raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")


@lru_cache(maxsize=256)
def _cached_plan(mixer: MixerIR, source, flags: tuple) -> Plan:
    return derive(mixer, dict(flags))


def _windows(mixer, plan: Plan, bound, opts) -> dict[int, int]:
    """The window of every attend() that has one, as a whole number of tokens >= 1."""
    out = {}
    for op, spec_op in zip(plan.sequence.ops, mixer.sequence_ops):
        if spec_op.window is None:
            continue
        w = _scalar(spec_op.window, bound.sizes, opts)
        if not (w >= 1 and float(w).is_integer()):
            who = spec_op.window.name if isinstance(spec_op.window, ir.Ref) else "window"
            raise ArgumentError(f"{who}: the window of {op.text} (in {op.where}) must be a whole number of tokens "
                                f">= 1, got {w:g}")
        out[op.index] = int(w)
    return out


def _cache_dims(mixer, plan: Plan, bound, windows) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """Each cache entry: (its dims, its length or None for every past token)."""
    order = tuple(mixer.dim_names)
    out = {}
    for op, spec_op in zip(plan.sequence.ops, mixer.sequence_ops):
        def dims(e):
            return tuple(d for d in order if d in e.shape)
        for key, _ in op.cache:
            arg = key[len(op.name) + 1:]
            if op.kind == "attend":
                e = spec_op.args[0] if arg == "k" else spec_op.args[2]
                length = windows[op.index] - 1 if op.index in windows else None
            elif arg == "h":
                e, length = spec_op.args[0], None
            else:
                e = spec_op.args[1]
                length = (bound.sizes[op.tap] - 1 if op.filter == "taps" else 1 if op.filter == "constant" else None)
            out[key] = (dims(e), length)
    return out


def _windowed(plan: Plan, windows) -> set[str]:
    """The cache entries of attend() with a window: min(window - 1, tokens seen) long, so that
    a huge window over a short sequence allocates by the sequence."""
    return {key for op in plan.sequence.ops if op.kind == "attend" and op.index in windows for key, _ in op.cache}


def _check_cache(mixer, plan: Plan, bound, state, windows) -> dict[str, torch.Tensor]:
    """The cache given as initial_state (or step()'s state): its entries, shapes and positions."""
    arg = "initial_state"
    if not isinstance(state, dict):
        raise ArgumentError(f"{arg}: expected the cache dict that output_final_state=True returns, got "
                            f"{type(state).__name__}")
    spec = _cache_dims(mixer, plan, bound, windows)
    windowed = _windowed(plan, windows)
    keys = ("pos",) + tuple(spec)
    allowed = set(keys) | {k + "_scale" for k in spec}
    for k in state:
        if k not in allowed:
            raise ArgumentError(f"{arg}: unknown cache entry '{k}'; mixer '{mixer.name}' keeps {', '.join(keys)}")
    for k in keys:
        if k not in state:
            raise ArgumentError(f"{arg}: missing cache entry '{k}' (mixer '{mixer.name}' keeps {', '.join(keys)})")
    n, H = bound.n_seqs, bound.H
    device = next(iter(bound.inputs.values())).device
    pos = state["pos"]
    if not isinstance(pos, torch.Tensor) or pos.dtype not in (torch.int32, torch.int64) or tuple(pos.shape) != (n,):
        got = f"dtype {pos.dtype}, shape {list(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ArgumentError(f"{arg}['pos']: expected {n} token counts (int64, shape [{n}]), got {got}")
    if bool((pos < 0).any()):
        raise ArgumentError(f"{arg}['pos']: token counts must be >= 0, got {pos.tolist()}")
    most = int(pos.max()) if n else 0
    for key, (dims, length) in spec.items():
        x = state[key]
        sizes = tuple(bound.sizes[d] for d in dims)
        # a window's cache holds the last min(window - 1, tokens seen) tokens: it grows up to the window
        fewest = min(length, most) if key in windowed else length
        held = x.shape[2] if isinstance(x, torch.Tensor) and x.dim() == 3 + len(dims) else None
        label = "[N, H, " + ("length" if length is None else str(length)) + "".join(", " + d for d in dims) + "]"
        if not isinstance(x, torch.Tensor) or x.dim() != 3 + len(dims) or tuple(x.shape[:2]) != (n, H) \
                or tuple(x.shape[3:]) != sizes or (length is not None and not fewest <= held <= length) \
                or (length is None and x.shape[2] < most):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            why = ""
            if held is not None and length is not None and held > length:
                why = f"; it holds {held} past tokens where this call keeps {length} (was it made with another window or filter?)"
            elif held is not None and length is not None and held < fewest:
                why = f"; it holds {held} past tokens where this call needs the last {fewest} of {most}"
            raise ArgumentError(f"{arg}['{key}']: expected shape {label} with N={n}, H={H}"
                                + "".join(f", {d}={s}" for d, s in zip(dims, sizes)) + f", got {got}{why}")
        if x.device != device:
            raise ArgumentError(f"{arg}['{key}']: on device {x.device}, but the inputs are on {device}")
        sc = state.get(key + "_scale")
        if sc is not None and (not isinstance(sc, torch.Tensor) or tuple(sc.shape) != (n, H) + sizes):
            raise ArgumentError(f"{arg}['{key}_scale']: expected shape {[n, H, *sizes]}")
    return dict(state)


def _run(mixer, plan: Plan, bound, opts, windows, cache, dtype, method, stabilize, x0):
    """Split the call into evaluations whose rows share a history length, run them, join."""
    seq = plan.sequence
    full = {k for k, (_, length) in _cache_dims(mixer, plan, bound, windows).items() if length is None}
    groups = []            # (input rows or None, time slice, cache row, history length)
    if bound.cu_seqlens is None:
        pos = cache["pos"].tolist() if cache is not None else [0] * bound.B
        if len(set(pos)) <= 1:
            groups.append((slice(None), slice(None), slice(None), pos[0] if pos else 0))
        else:                  # histories of different lengths: one row at a time
            groups += [(slice(b, b + 1), slice(None), slice(b, b + 1), p) for b, p in enumerate(pos)]
    else:
        offs = bound.cu_seqlens.tolist()
        pos = cache["pos"].tolist() if cache is not None else [0] * (len(offs) - 1)
        groups += [(slice(0, 1), slice(a, b), slice(i, i + 1), pos[i]) for i, (a, b) in enumerate(zip(offs, offs[1:]))]
    outs, caches, new_pos = [], [], []
    for rows, times, crow, p in groups:
        inputs = {k: v[rows, times] for k, v in bound.inputs.items()}
        B, Tn = next(iter(inputs.values())).shape[:2]
        cin = None
        if cache is not None:
            cin = {k: v[crow] for k, v in cache.items() if k != "pos"}
            for k in full:                  # every past token: this group's first p of them
                cin[k] = cin[k][:, :, :p]
        run = Run(mixer, seq, {o.name: o.default for o in mixer.flags} | bound.flags, bound.sizes, B, Tn, bound.H, p,
                  dtype, x0.device, method, stabilize, cin, windows)
        outs.append(evaluate(run, leaves(run, inputs, bound.params, opts)))
        caches.append(run.cache_out)
        new_pos += [p + Tn] * B
    o = torch.cat(outs, 1 if bound.cu_seqlens is not None else 0)
    st = {"pos": torch.tensor(new_pos, dtype=torch.int64, device=x0.device)}
    for key in caches[0] if caches else ():
        parts = [c[key] for c in caches]
        most = max(t.shape[2] for t in parts)
        if key in full:                    # every past token: pad the shorter histories at the end
            parts = [torch.nn.functional.pad(t.movedim(2, -1), (0, most - t.shape[2])).movedim(-1, 2)
                     if t.shape[2] < most else t for t in parts]
        elif any(t.shape[2] < most for t in parts):   # a window's last tokens: zeros in front (negative positions)
            parts = [torch.nn.functional.pad(t.movedim(2, -1), (most - t.shape[2], 0)).movedim(-1, 2) for t in parts]
        st[key] = torch.cat(parts, 0)
    return o, st

"""The float64 reference: the spec interpreted over its IR as a plain loop over t, with
autograd. It is the ground truth every kernel is diffed against, so it is kept as direct
as possible: no chunking, no log-space tricks, one token at a time."""
from __future__ import annotations

import string

import torch

from ..dsl import ir
from ..dsl.functions import FUNCTIONS, torch_callable
from ..standalone.shift import Carry, StepCarry
from .signature import Bound, bind, option_values

# A value is (tensor, dims): tensor shape = lead + sizes of dims, lead = (B, H) or
# (B, T, H), broadcast where a size is 1 (params have lead (1, H) / (1, 1, H)).
Value = tuple[torch.Tensor, ir.Shape]

_FNS = {name: torch_callable(name) for name in FUNCTIONS} | {      # the registry, dsl/functions.py
    "detach": torch.Tensor.detach,        # generated only (the stabilizer's m): held constant
}


def _align(v: Value, out: ir.Shape, lead: int) -> torch.Tensor:
    """Permute v's dims into the order of `out` and insert size-1 axes for the ones it lacks."""
    t, dims = v
    order = [dims.index(d) for d in out if d in dims]
    t = t.permute(tuple(range(lead)) + tuple(lead + i for i in order))
    present = [d for d in out if d in dims]
    shape = list(t.shape[:lead])
    it = iter(t.shape[lead:])
    for d in out:
        shape.append(next(it) if d in present else 1)
    return t.reshape(shape)


class Evaluator:
    def __init__(self, mixer: ir.MixerIR, bound: Bound, env: dict[str, Value], lead: int,
                 dtype=torch.float64):
        self.m = mixer
        self.b = bound
        self.env = env
        self.lead = lead
        self.dtype = dtype
        self.device = next(iter(env.values()))[0].device if env else torch.device("cpu")
        self.flags = {o.name: o.default for o in mixer.flags} | bound.flags

    def scalar(self, x: float) -> Value:
        return torch.tensor(x, dtype=self.dtype, device=self.device).reshape((1,) * self.lead), ()

    def __call__(self, e: ir.Expr) -> Value:
        return getattr(self, "e_" + type(e).__name__)(e)

    def e_Num(self, e):
        return self.scalar(e.value)

    def e_Ref(self, e: ir.Ref):
        if e.kind == "dim":
            return self.scalar(float(self.b.sizes[e.name]))
        if e.kind == "head":
            h = torch.arange(self.b.H, dtype=self.dtype, device=self.device)
            return h.reshape((1,) * (self.lead - 1) + (self.b.H,)), ()
        return self.env[e.name]

    def e_Prev(self, e: ir.Prev):
        return self.env["prev " + e.state]

    def e_Neg(self, e):
        t, d = self(e.x)
        return -t, d

    def e_BinOp(self, e: ir.BinOp):
        a, b = self(e.left), self(e.right)
        ta, tb = _align(a, e.shape, self.lead), _align(b, e.shape, self.lead)
        if e.op == "**" and isinstance(e.right, ir.Num):
            return ta ** e.right.value, e.shape         # a python exponent keeps x**2 smooth at 0
        return {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div, "**": torch.pow}[e.op](ta, tb), e.shape

    def e_Contract(self, e: ir.Contract):
        (ta, da), (tb, db) = self(e.left), self(e.right)
        letters = {d: string.ascii_letters[i] for i, d in enumerate(self.m.dim_names)}
        spec = (f"...{''.join(letters[d] for d in da)},...{''.join(letters[d] for d in db)}"
                f"->...{''.join(letters[d] for d in e.shape)}")
        return torch.einsum(spec, ta, tb), e.shape

    def e_Call(self, e: ir.Call):
        if e.fn in ("max", "min"):
            a, b = (_align(self(x), e.shape, self.lead) for x in e.args)
            return (torch.maximum if e.fn == "max" else torch.minimum)(a, b), e.shape
        t, d = self(e.args[0])
        return _FNS[e.fn](t), d

    def e_Reduce(self, e: ir.Reduce):
        t, d = self(e.x)
        axes = [self.lead + d.index(x) for x in e.over]
        if e.fn == "sum":
            r = t.sum(dim=axes)
        elif e.fn == "norm":
            r = torch.linalg.vector_norm(t, dim=axes)
        elif e.fn == "max":
            r = t.amax(dim=axes)
        else:
            r = t.amin(dim=axes)
        return r, tuple(x for x in d if x not in e.over)

    def e_Rename(self, e: ir.Rename):
        t, d = self(e.x)
        m = dict(e.mapping)
        return _align((t, tuple(m.get(x, x) for x in d)), e.shape, self.lead), e.shape

    def e_Cond(self, e: ir.Cond):
        return self(e.then if self.flags[e.flag] else e.otherwise)


def _options(mixer: ir.MixerIR, bound: Bound) -> dict[str, float]:
    return option_values(mixer, bound)


def reference(mixer: ir.MixerIR, *, output_final_state: bool = False, dtype=torch.float64, **kwargs):
    """Run the spec as a loop over t in `dtype` (float64 by default): returns (o, state).

    o is [B, T, H, *output dims]; state is None or a dict {name: [B, H, *state dims]} (with
    prev_x, x's last token, for each prev(x) of an input: standalone/shift.py)."""
    if not mixer.shifted:
        return run_reference(mixer, output_final_state=output_final_state, dtype=dtype, **kwargs)
    carry = Carry(mixer, {k: v for k, v in kwargs.items() if k not in ("initial_state", "cu_seqlens")},
                  kwargs.get("initial_state"), kwargs.get("cu_seqlens"))
    o, st = run_reference(mixer, output_final_state=output_final_state, dtype=dtype, **carry.kwargs,
                          initial_state=carry.state, cu_seqlens=kwargs.get("cu_seqlens"))
    return o, carry.final(st)


def run_reference(mixer: ir.MixerIR, *, output_final_state: bool = False, dtype=torch.float64, **kwargs):
    """reference() with every input given, the derived prev(x) ones included."""
    bound = bind(mixer, kwargs).expanded()         # grouped inputs repeated per head
    B, T, H = bound.B, bound.T, bound.H
    opts = _options(mixer, bound)
    env: dict[str, Value] = {}
    for name, x in bound.inputs.items():
        env[name] = (x.to(dtype), mixer.input(name).shape)
    for name, x in bound.params.items():
        env[name] = (x.to(dtype).reshape((1, 1) + tuple(x.shape)), mixer.param(name).shape)
    device = next(iter(bound.inputs.values())).device
    for name, v in opts.items():
        env[name] = (torch.tensor(v, dtype=dtype, device=device).reshape(1, 1, 1), ())

    # Lets do not read states: evaluate them over the whole sequence at once.
    seq = Evaluator(mixer, bound, env, lead=3, dtype=dtype)
    for let in mixer.lets:
        t, d = seq(let.expr)
        env[let.name] = (t.expand((B, T, H) + t.shape[3:]), d)

    per_token = set(bound.inputs) | {let.name for let in mixer.lets}
    segments = [(0, T)] if bound.cu_seqlens is None else list(zip(bound.cu_seqlens.tolist()[:-1],
                                                                     bound.cu_seqlens.tolist()[1:]))
    outs, finals = [], {s.name: [] for s in mixer.states}
    for i, (start, end) in enumerate(segments):
        rows = slice(None) if bound.cu_seqlens is None else slice(0, 1)
        states = {}
        for decl in mixer.states:
            size = tuple(bound.sizes[d] for d in decl.shape)
            if bound.initial_state is not None:
                s0 = bound.initial_state[decl.name].to(dtype)
                s0 = s0 if bound.cu_seqlens is None else s0[i:i + 1]
            else:
                s0 = torch.zeros((B if bound.cu_seqlens is None else 1, H) + size, dtype=dtype, device=device)
            states[decl.name] = s0
        for t in range(start, end):
            step_env = {name: ((x[rows, t] if name in per_token else x[:, 0]), d)
                        for name, (x, d) in env.items()}
            o, states = _token(mixer, bound, step_env, states, dtype)
            outs.append(o)
        for decl in mixer.states:
            finals[decl.name].append(states[decl.name])
    o = torch.stack(outs, dim=1) if outs else torch.zeros(
        (B, 0, H) + tuple(bound.sizes[d] for d in mixer.output.expr.shape), dtype=dtype, device=device)
    final = {k: torch.cat(v, dim=0) for k, v in finals.items()} if output_final_state else None
    return o, final


def _token(mixer: ir.MixerIR, bound: Bound, env: dict[str, Value], states: dict[str, torch.Tensor], dtype):
    """One token: every state's update from the previous states, then the output."""
    prev_env = dict(env)
    for decl in mixer.states:
        prev_env[decl.name] = (states[decl.name], decl.shape)
        prev_env["prev " + decl.name] = (states[decl.name], decl.shape)
    ev = Evaluator(mixer, bound, prev_env, lead=2, dtype=dtype)
    new = {}
    for upd in mixer.updates:
        decl = mixer.state(upd.state)
        v = ev(upd.expr)
        new[upd.state] = _align(v, decl.shape, 2).expand(states[upd.state].shape)
    out_env = dict(env)
    for decl in mixer.states:
        out_env[decl.name] = (new[decl.name], decl.shape)
        out_env["prev " + decl.name] = (states[decl.name], decl.shape)
    ev = Evaluator(mixer, bound, out_env, lead=2, dtype=dtype)
    shape = mixer.output.expr.shape
    return _align(ev(mixer.output.expr), shape, 2), new


def reference_step(mixer: ir.MixerIR, *, state, dtype=torch.float64, **kwargs):
    """One token per sequence: inputs [B, H, *dims]; returns (o [B, H, *dims], new state)."""
    if not mixer.shifted:
        return run_reference_step(mixer, state=state, dtype=dtype, **kwargs)
    carry = StepCarry(mixer, kwargs, state, False, None)
    o, st = run_reference_step(mixer, state=carry.state, dtype=dtype, **carry.kwargs)
    return o, carry.new_state(st)


def run_reference_step(mixer: ir.MixerIR, *, state, dtype=torch.float64, **kwargs):
    """reference_step() with every input given, the derived prev(x) ones included."""
    bound = bind(mixer, dict(kwargs, initial_state=state), step=True).expanded(axis=1)
    if bound.initial_state is None:
        raise ValueError("state: step() needs the state (a dict keyed by state name)")
    opts = _options(mixer, bound)
    env: dict[str, Value] = {}
    for name, x in bound.inputs.items():
        env[name] = (x.to(dtype), mixer.input(name).shape)
    for name, x in bound.params.items():
        env[name] = (x.to(dtype).reshape((1,) + tuple(x.shape)), mixer.param(name).shape)
    device = next(iter(bound.inputs.values())).device
    for name, v in opts.items():
        env[name] = (torch.tensor(v, dtype=dtype, device=device).reshape(1, 1), ())
    ev = Evaluator(mixer, bound, env, lead=2, dtype=dtype)
    for let in mixer.lets:
        env[let.name] = ev(let.expr)
    states = {k: v.to(dtype) for k, v in bound.initial_state.items()}
    return _token(mixer, bound, env, states, dtype)

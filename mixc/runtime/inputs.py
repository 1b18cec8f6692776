"""The values of a call's inputs: random arguments for a spec, drawn so that its recurrence is
well-behaved (log-space gates negative, beta in (0, 1), dt positive, A negative, and inside
every declared range), and the check of a call's values against the ranges its spec declares
(check_ranges). Random arguments serve `mixc run`, the tests and the benchmarks; their roles
follow flash-linear-attention's and mamba_ssm's argument names."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..dsl import ir
from ..dsl.unparse import decl_text
from ..standalone.errors import ArgumentError

# The modes that check declared ranges: they run in torch, where a look at the values costs
# little; the kernel modes take the caller's promise (a check there would wait for the device).
RANGE_CHECKED_MODES = ("torch", "reference", "conv")


def check_ranges(mixer: ir.MixerIR, bound) -> None:
    """Every value of an input or param with a declared range (`input beta[] in (0, 2)`) lies
    in it; else an ArgumentError naming the argument, the range and the first value outside it
    by its index in the tensor as passed. Skipped while torch.compile traces (a data-dependent
    branch) and for tensors without data (the meta device)."""
    if torch.compiler.is_compiling():
        return
    for kind, decls, given in (("input", mixer.inputs, bound.inputs), ("param", mixer.params, bound.params)):
        for decl in decls:
            r, x = decl.range, given.get(decl.name)
            if r is None or x is None or x.device.type == "meta" or mixer.const(decl.name) is not None:
                continue
            x = x.detach()
            if _all_inside(r, x):
                continue
            inside = _inside(r, x)
            outside = ~inside
            index = tuple(int(i) for i in outside.nonzero()[0])
            value = float(x[index])
            count = int(outside.sum())
            where = f"{decl.name}[{', '.join(map(str, index))}]" if index else decl.name
            more = f" (and {count - 1} more outside it)" if count > 1 else ""
            raise ArgumentError(f"{decl.name}: expected values in {r.text()}, as the spec declares "
                                f"(`{kind} {decl_text(decl)}`), got {where} = {value:g}{more}")


def range_guard(mixer: ir.MixerIR, names) -> Callable[[dict], None] | None:
    """check_ranges of the inputs and params called `names`, made once for a replayed decode step
    (runtime/torch_step.py): the declared ends to compare are found here, so a token pays one
    reduction per finite end and nothing else (a step is ~60 us at B = 1; the general check's
    loops over every declaration cost ~4 us of it). None where none of them declares a range.
    A failing value raises check_ranges' own error."""
    ends = tuple((decl.name, decl.range, _finite_ends(decl.range))
                 for decl in (*mixer.inputs, *mixer.given_params) if decl.range is not None and decl.name in names)
    if not ends:
        return None

    def guard(values: dict) -> None:    # (run by replays, which torch.compile never traces: op.py)
        for name, r, (upper, lower, nan) in ends:
            x = values[name]
            if x.requires_grad:
                x = x.detach()
            try:                # an empty or a meta tensor has no extremes: the general check says
                ok = True
                if upper:
                    hi = x.max().item()
                    ok = hi <= r.upper if r.upper_closed else hi < r.upper
                if ok and lower:
                    lo = x.min().item()
                    ok = lo >= r.lower if r.lower_closed else lo > r.lower
                if ok and nan:
                    ok = not bool(torch.isnan(x).any())
            except RuntimeError:
                ok = False
            if not ok:          # the general check passes what it skips, and names a failure
                kind = "input" if any(d.name == name for d in mixer.inputs) else "param"
                check_ranges(mixer, _Values(values if kind == "input" else {}, values if kind == "param" else {}))
    return guard


class _Values(NamedTuple):
    """What check_ranges reads of a call: its inputs and params by name."""
    inputs: dict
    params: dict


def _finite_ends(r: ir.ValueRange) -> tuple[bool, bool, bool]:
    """Which extremes a check of r compares (upper, lower) and whether it looks for NaN only
    (a range with no end, closed: [-inf, inf]); as _all_inside decides."""
    upper = math.isfinite(r.upper) or not r.upper_closed
    lower = math.isfinite(r.lower) or not r.lower_closed
    return upper, lower, not upper and not lower


def _logdecay(shape, gen, dtype):
    return F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype) + 2.0)


def _unit(shape, gen, dtype):
    return torch.rand(shape, generator=gen, dtype=dtype) * 0.8 + 0.1


def _positive(shape, gen, dtype):
    return torch.rand(shape, generator=gen, dtype=dtype) * 0.9 + 0.1


def _negative(shape, gen, dtype):
    return -_positive(shape, gen, dtype)


def _normal(shape, gen, dtype):
    return torch.randn(shape, generator=gen, dtype=dtype)


def _unit_vector(shape, gen, dtype):
    """Unit vectors over the last dim: a delta rule's write I - beta k k^T then stays a
    contraction for beta in (0, 2) (fla normalizes its keys the same way)."""
    return F.normalize(torch.randn(shape, generator=gen, dtype=dtype), dim=-1)


class Tied:
    """A role drawn from arguments drawn before it (`drawn`), as MixerLayer's roles tie RWKV-7's
    b to a: fn(drawn, shape, gen, dtype)."""

    def __init__(self, fn):
        self.fn = fn


def _all_inside(r: ir.ValueRange, x: torch.Tensor) -> bool:
    """Whether every value of x lies in r, by its extremes (a decode step checks every token:
    one reduction per finite end, where the element-wise mask cost ~20 us a call). NaN
    propagates through max and min and fails every comparison; a range with no finite end
    asks only that there be no NaN."""
    if x.numel() == 0:
        return True
    ok = True
    if math.isfinite(r.upper) or not r.upper_closed:
        hi = float(x.max())
        ok = hi <= r.upper if r.upper_closed else hi < r.upper
    if ok and (math.isfinite(r.lower) or not r.lower_closed):
        lo = float(x.min())
        ok = lo >= r.lower if r.lower_closed else lo > r.lower
    if ok and not math.isfinite(r.upper) and r.upper_closed and not math.isfinite(r.lower) and r.lower_closed:
        ok = not bool(torch.isnan(x).any())
    return ok


def _inside(r: ir.ValueRange, x: torch.Tensor) -> torch.Tensor:
    """Where x lies in r (NaN nowhere)."""
    return (x >= r.lower if r.lower_closed else x > r.lower) & (x <= r.upper if r.upper_closed else x < r.upper)


def _within(r: ir.ValueRange, role):
    """A draw inside a declared range: the role's own where it stays inside (g's log decays in
    (-inf, 0]), else uniform over the middle 80% of a bounded range, or a distance of 0.1 to 1
    from the one finite end."""
    def draw(shape, gen, dtype):
        x = role(shape, gen, dtype)
        if bool(_inside(r, x).all()):
            return x
        u = torch.rand(shape, generator=gen, dtype=dtype)
        if math.isfinite(r.lower) and math.isfinite(r.upper):
            return r.lower + (r.upper - r.lower) * (0.1 + 0.8 * u)
        if math.isfinite(r.lower):
            return r.lower + 0.1 + 0.9 * u
        if math.isfinite(r.upper):
            return r.upper - 0.1 - 0.9 * u
        return x
    return draw


def _rwkv7_b(drawn, shape, gen, dtype):
    # b = kk * sigmoid(x) with a = -kk: diag(exp(w)) + b a^T = diag(exp(w)) - s kk kk^T, whose
    # eigenvalues stay in [-1, 1] (fla's RWKV7 parametrization)
    return -drawn["a"] * torch.sigmoid(torch.randn(shape, generator=gen, dtype=dtype))


# Argument name -> role; (spec, name) entries override for one library spec.
ROLES = {
    "g": _logdecay, "gk": _logdecay, "gv": _logdecay, "w": _logdecay,
    "beta": _unit, "dt": _positive, "A": _negative,
    ("mamba2", "dt"): _normal,          # mamba2 applies softplus(dt + dt_bias) itself
    ("mamba3", "dt"): _normal,          # as mamba2
    ("s4d", "log_dt"): _negative,
}

# With bounded=True (mixc run, the benchmarks): what keeps every library recurrence bounded over
# any length, the papers' parametrizations (mixc/nn/roles.py): unit keys for the delta rules,
# RWKV-7's a = -kk and b = kk * sigmoid(x) (independent normal a, b grow the state as 2^T).
BOUNDED_ROLES = {
    ("delta_rule", "k"): _unit_vector, ("gated_delta_rule", "k"): _unit_vector,
    ("kda", "k"): _unit_vector, ("comba", "k"): _unit_vector, ("comba", "p"): _unit_vector,
    ("gated_delta_product", "k1"): _unit_vector, ("gated_delta_product", "k2"): _unit_vector,
    ("rwkv7", "a"): lambda shape, gen, dtype: -_unit_vector(shape, gen, dtype),
    ("rwkv7", "b"): Tied(_rwkv7_b),
}


def random_args(mixer: ir.MixerIR, *, B=2, T=8, H=2, sizes=None, seed=0, dtype=torch.float64,
                requires_grad=False, roles=None, device="cpu", bounded=False):
    """Random inputs [B, T, H, *dims] and params [H, *dims] (fresh values: never zeros or
    ones). sizes: dim sizes (default 4; aliases follow their dim). bounded: the roles of
    BOUNDED_ROLES too (states that stay bounded at any T). Returns (kwargs, sizes)."""
    sizes = dict(sizes or {})
    for d in mixer.dims:
        fixed = mixer.fixed_size(d.name)        # `dims E = 2`: the spec's own size
        sizes[d.name] = fixed if fixed is not None else sizes.get(d.name, sizes.get(mixer.root_dim(d.name), 4))
    gen = torch.Generator().manual_seed(seed)
    table = dict(ROLES) | (BOUNDED_ROLES if bounded else {})
    table.update(roles or {})
    out, drawn = {}, {}
    for decl, lead in [(d, (B, T, H)) for d in mixer.given_inputs] + [(d, (H,)) for d in mixer.given_params]:
        shape = lead + tuple(T if d == "T" else sizes[d] for d in decl.shape)    # [T, ...]: per position
        fn = table.get((mixer.name, decl.name)) or table.get(decl.name) or _normal
        if decl.range is not None and not isinstance(fn, Tied) and decl.name not in (roles or {}):
            fn = _within(decl.range, fn)
        x = fn.fn(drawn, shape, gen, torch.float64) if isinstance(fn, Tied) else fn(shape, gen, torch.float64)
        drawn[decl.name] = x
        x = x.to(device=device, dtype=dtype)
        out[decl.name] = x.requires_grad_(True) if requires_grad else x
    return out, sizes


def random_state(mixer: ir.MixerIR, n, H, sizes, seed=1, dtype=torch.float64, requires_grad=False,
                 device="cpu"):
    """A random initial state {name: [n, H, *state dims]}, with prev_x [n, H, *x's dims] for each
    prev(x) of an input (the token before the first: standalone/shift.py)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    carried = [(s.name, mixer.input(s.source).shape) for s in mixer.shifted]
    for name, shape in [(d.name, d.shape) for d in mixer.states] + carried:
        x = 0.5 * torch.randn((n, H) + tuple(sizes[d] for d in shape), generator=gen, dtype=torch.float64)
        x = x.to(device=device, dtype=dtype)
        out[name] = x.requires_grad_(True) if requires_grad else x
    return out

"""Random arguments for a spec, drawn so that its recurrence is well-behaved: log-space
gates negative, beta in (0, 1), dt positive, A negative. Used by `mixc run`, the tests and
the benchmarks. Roles follow flash-linear-attention's and mamba_ssm's argument names."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dsl import ir


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


# Argument name -> role; (spec, name) entries override for one library spec.
ROLES = {
    "g": _logdecay, "gk": _logdecay, "gv": _logdecay, "w": _logdecay,
    "beta": _unit, "dt": _positive, "A": _negative,
    ("mamba2", "dt"): _normal,          # mamba2 applies softplus(dt + dt_bias) itself
    ("s4d", "log_dt"): _negative,
}


def random_args(mixer: ir.MixerIR, *, B=2, T=8, H=2, sizes=None, seed=0, dtype=torch.float64,
                requires_grad=False, roles=None, device="cpu"):
    """Random inputs [B, T, H, *dims] and params [H, *dims] (fresh values: never zeros or
    ones). sizes: dim sizes (default 4; aliases follow their dim). Returns (kwargs, sizes)."""
    sizes = dict(sizes or {})
    for d in mixer.dims:
        sizes.setdefault(d.name, sizes.get(mixer.root_dim(d.name), 4))
    gen = torch.Generator().manual_seed(seed)
    table = dict(ROLES)
    table.update(roles or {})
    out = {}
    for decl, lead in [(d, (B, T, H)) for d in mixer.inputs] + [(d, (H,)) for d in mixer.params]:
        shape = lead + tuple(T if d == "T" else sizes[d] for d in decl.shape)    # [T, ...]: per position
        fn = table.get((mixer.name, decl.name)) or table.get(decl.name) or _normal
        x = fn(shape, gen, torch.float64).to(device=device, dtype=dtype)
        out[decl.name] = x.requires_grad_(True) if requires_grad else x
    return out, sizes


def random_state(mixer: ir.MixerIR, n, H, sizes, seed=1, dtype=torch.float64, requires_grad=False,
                 device="cpu"):
    """A random initial state {name: [n, H, *state dims]}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for decl in mixer.states:
        x = 0.5 * torch.randn((n, H) + tuple(sizes[d] for d in decl.shape), generator=gen, dtype=torch.float64)
        x = x.to(device=device, dtype=dtype)
        out[decl.name] = x.requires_grad_(True) if requires_grad else x
    return out

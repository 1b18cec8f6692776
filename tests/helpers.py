"""Shared test helpers: fresh random inputs for a spec, shaped from its IR."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mixc.dsl import ir as mir


def case_id(**dims) -> str:
    """Parametrize ids like B2-T100-H3-K16."""
    return "-".join(f"{k}{v}" for k, v in dims.items())


# How to draw an argument so that the recurrence is well-behaved: (spec, name) -> fn(shape, gen).
def _logdecay(shape, gen):
    return F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2.0)


def _unit(shape, gen):
    return torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8 + 0.1


def _negative(shape, gen):
    return -torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 - 0.1


DRAW = {
    ("gla", "g"): _logdecay, ("simple_gla", "g"): _logdecay, ("hgrn", "g"): _logdecay,
    ("rwkv6", "w"): _logdecay, ("rwkv7", "w"): _logdecay, ("gated_delta_rule", "g"): _logdecay,
    ("delta_rule", "beta"): _unit, ("gated_delta_rule", "beta"): _unit,
    ("mamba", "dt"): _unit, ("mamba", "A"): _negative, ("mamba2", "A"): _negative,
    ("s4d", "A"): _negative,
}


def random_args(mixer: mir.MixerIR, *, B=2, T=8, H=2, sizes=None, seed=0, dtype=torch.float64,
                requires_grad=False, draw=None):
    """Random inputs [B, T, H, *dims] and params [H, *dims] for a spec (never zeros or ones)."""
    sizes = dict(sizes or {})
    for d in mixer.dims:
        sizes.setdefault(d.name, sizes.get(mixer.root_dim(d.name), 4))
    gen = torch.Generator().manual_seed(seed)
    table = dict(DRAW)
    table.update({(mixer.name, k): v for k, v in (draw or {}).items()})
    out = {}
    for decl, lead in [(d, (B, T, H)) for d in mixer.inputs] + [(d, (H,)) for d in mixer.params]:
        shape = lead + tuple(sizes[d] for d in decl.shape)
        fn = table.get((mixer.name, decl.name))
        x = fn(shape, gen) if fn else torch.randn(shape, generator=gen, dtype=torch.float64)
        x = x.to(dtype)
        if requires_grad:
            x.requires_grad_(True)
        out[decl.name] = x
    return out, sizes


def random_state(mixer: mir.MixerIR, n, H, sizes, seed=1, dtype=torch.float64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    st = {}
    for decl in mixer.states:
        x = 0.5 * torch.randn((n, H) + tuple(sizes[d] for d in decl.shape), generator=gen, dtype=torch.float64)
        x = x.to(dtype)
        if requires_grad:
            x.requires_grad_(True)
        st[decl.name] = x
    return st

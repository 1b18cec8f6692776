"""Shared test helpers."""
from __future__ import annotations

import torch

from mixc.runtime import inputs as _inputs
from mixc.runtime.inputs import random_state  # noqa: F401  (re-exported for tests)


def case_id(**dims) -> str:
    """Parametrize ids like B2-T100-H3-K16."""
    return "-".join(f"{k}{v}" for k, v in dims.items())


def random_args(mixer, *, draw=None, **kwargs):
    """mixc.runtime.inputs.random_args, with `draw`: {arg name: fn(shape, generator)} in float64."""
    roles = {}
    for name, fn in (draw or {}).items():
        roles[name] = (lambda f: lambda shape, gen, dtype: f(shape, gen).to(torch.float64))(fn)
    return _inputs.random_args(mixer, roles=roles, **kwargs)


def record_phases(monkeypatch, method: str = "forward") -> list:
    """The stage (the kernel: "walk", "output" ...) of every launch mixc.standalone.launcher.
    Launcher.<method> ("forward" or "backward") makes from here on, in order (the launch still runs)."""
    from mixc.standalone.launcher import Launcher
    seen, real = [], getattr(Launcher, method)

    def spy(self, *a, **kw):
        seen.append(kw["launch"]["stage"])
        return real(self, *a, **kw)
    monkeypatch.setattr(Launcher, method, spy)
    return seen

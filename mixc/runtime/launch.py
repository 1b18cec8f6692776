"""Launching generated kernels: argument order, block sizes, outputs and states."""
from __future__ import annotations

import torch
import triton

from ..derive.plan import Plan
from .cache import interpreting, load_module
from .reference import _options
from .signature import Bound


def block(size: int) -> int:
    return max(triton.next_power_of_2(size), 1)


def dim_kwargs(plan: Plan, bound: Bound) -> dict:
    kw = {}
    for d in plan.ir.dim_names:
        kw[f"_size_{d}"] = bound.sizes[d]
        kw[f"_BLOCK_{d}"] = block(bound.sizes[d])
    return kw


class KernelUnavailable(RuntimeError):
    """The generated kernels cannot run on these tensors here."""


def module_for(plan: Plan, device: torch.device):
    if device.type == "cpu" and not interpreting():
        raise KernelUnavailable(
            "Triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before Python starts (before triton is imported), or use mode='reference'")
    if device.type not in ("cpu", "cuda"):
        raise KernelUnavailable(f"no Triton kernels for device type '{device.type}'")
    return load_module(plan)


def recurrent_forward(plan: Plan, bound: Bound, *, output_final_state: bool, out_dtype=None):
    """Run the fused recurrent forward kernel: returns (o, final states or None)."""
    m = plan.ir
    x0 = next(iter(bound.inputs.values()))
    device = x0.device
    out_dtype = out_dtype or x0.dtype
    mod = module_for(plan, device)
    kernel = getattr(mod, mod.METADATA["kernels"]["recurrent_fwd"])
    n, H, T = bound.n_seqs, bound.H, bound.T
    inputs = [bound.inputs[d.name].contiguous() for d in m.inputs]
    params = [bound.params[d.name].contiguous() for d in m.params]
    opts = _options(m, bound)
    out = torch.empty((bound.B, T, H) + tuple(bound.sizes[d] for d in m.output.expr.shape),
                      dtype=out_dtype, device=device)
    state_args, finals = [], {}
    for s in m.states:
        shape = (n, H) + tuple(bound.sizes[d] for d in s.shape)
        init = (bound.initial_state[s.name].to(torch.float32).contiguous()
                if bound.initial_state is not None else out)
        final = torch.empty(shape, dtype=torch.float32, device=device) if output_final_state else out
        if output_final_state:
            finals[s.name] = final
        state_args += [init, final]
    cu = bound.cu_seqlens.to(device) if bound.cu_seqlens is not None else out
    fsizes = [float(bound.sizes[d]) for d in m.dim_names]
    kernel[(n * H,)](*inputs, *params, *[opts[o.name] for o in m.options if o.kind == "float"], *state_args,
                     out, cu, T, H, *fsizes, **dim_kwargs(plan, bound),
                     USE_INITIAL_STATE=bound.initial_state is not None, STORE_FINAL_STATE=output_final_state,
                     IS_VARLEN=bound.cu_seqlens is not None)
    return out, (finals if output_final_state else None)

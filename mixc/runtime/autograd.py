"""torch.autograd.Function around the generated kernels."""
from __future__ import annotations

import torch

from ..derive.plan import Plan
from .launch import recurrent_backward, recurrent_forward
from .signature import Bound


class RecurrentFunction(torch.autograd.Function):
    """Tensors in: inputs, params, initial states (in the spec's order; states may be None).
    Tensors out: o, then the final states (in the spec's order) when asked for."""

    @staticmethod
    def forward(ctx, plan: Plan, bound: Bound, output_final_state: bool, CK: int, *tensors):
        m = plan.ir
        needs_grad = any(ctx.needs_input_grad[4:])
        o, finals, ckpts = recurrent_forward(plan, bound, output_final_state=output_final_state,
                                             checkpoints=needs_grad, CK=CK)
        ctx.plan, ctx.bound, ctx.CK, ctx.ckpts = plan, bound, CK, ckpts
        ctx.output_final_state = output_final_state
        outs = (o,) + (tuple(finals[s.name] for s in m.states) if output_final_state else ())
        return outs

    @staticmethod
    def backward(ctx, do, *dfinals):
        m, bound = ctx.plan.ir, ctx.bound
        dfinal = None
        if ctx.output_final_state and any(g is not None for g in dfinals):
            dfinal = {s.name: (g if g is not None else torch.zeros_like(f))
                      for s, g, f in zip(m.states, dfinals, dfinals)}
            dfinal = {k: (v if v is not None else None) for k, v in dfinal.items()}
        if do is None:
            do = torch.zeros((bound.B, bound.T, bound.H) + tuple(bound.sizes[d] for d in m.output.expr.shape),
                             device=next(iter(bound.inputs.values())).device)
        dinputs, dparams, dinit = recurrent_backward(ctx.plan, bound, ctx.ckpts, do, dfinal, CK=ctx.CK)
        grads = [dinputs[d.name] for d in m.inputs] + [dparams[d.name] for d in m.params]
        if bound.initial_state is not None:
            grads += [dinit[s.name].to(bound.initial_state[s.name].dtype) for s in m.states]
        ctx.ckpts = None
        return (None, None, None, None, *grads)

"""The generated kernels as torch.library custom ops (with fake implementations and autograd),
so that torch.compile(fullgraph=True) traces a model that calls a mixc op with no graph break.

Per spec (and flag assignment) two ops: mixc::<name>_<hash>_fwd and ..._bwd. Tensors travel
as lists in the spec's order; number options as a float list.

Eager calls do not go through the registered ops (kernel_ops(plan).call): torch's dispatch of a
Python custom op costs ~60 us a call and imports torch._dynamo (2-3 s) on its first call, so
outside torch.compile the same forward runs directly (no gradient needed) or under a plain
autograd.Function with the same backward. While torch.compile traces, the registered op."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..derive.plan import Plan
from .launch import checkpoint_dtype, checkpoint_slots, launcher, rules, with_options
from ..standalone.errors import ArgumentError
from ..standalone.binding import cu_seqlens_values
from .signature import Bound, head_groups

_OPS: dict[tuple, object] = {}
_KERNEL_OPS: dict[tuple, "KernelOps"] = {}


class KernelOps(NamedTuple):
    fwd: object          # the registered custom ops (torch.compile traces these)
    bwd: object
    call: Callable       # the forward as op._kernels calls it: fwd's signature, dispatched as above

FWD_SCHEMA = ("(Tensor[] inputs, Tensor[] params, Tensor[] initial_state, float[] options, Tensor? cu_seqlens, "
              "bool output_final_state, bool save_for_backward, bool chunked, int CK) -> Tensor[]")
BWD_SCHEMA = ("(Tensor[] inputs, Tensor[] params, Tensor[] checkpoints, Tensor[] dfinal, Tensor do, "
              "float[] options, Tensor? cu_seqlens, bool chunked, int CK) -> Tensor[]")


def _bound(plan: Plan, inputs, params, initial_state, options, cu_seqlens) -> Bound:
    """A Bound from tensors already checked by signature.bind (shapes only: no data read).
    States are the kernels' (plan.kernel_ir: a stabilizer's m after the spec's)."""
    m = plan.ir
    sizes = {}
    for d, x in zip(m.inputs, inputs):
        sizes.update({n: int(s) for n, s in zip(d.shape, x.shape[3:])})
    for d, x in zip(m.params, params):
        sizes.update({n: int(s) for n, s in zip(d.shape, x.shape[1:])})
    for d in m.dims:
        fixed = m.fixed_size(d.name)        # `dims E = 2`: the spec's size, perhaps on no tensor
        sizes.setdefault(d.name, fixed if fixed is not None else sizes.get(m.root_dim(d.name)))
    B, T = (int(s) for s in inputs[0].shape[:2])
    H = max(int(x.shape[2]) for x in inputs)       # grouped inputs have fewer heads (signature.bind)
    named = {d.name: x for d, x in zip(m.inputs, inputs)}
    opt_names = [o.name for o in m.options if o.kind == "float"]
    bound = Bound(B, T, H, sizes, named,
                  {d.name: x for d, x in zip(m.params, params)}, dict(zip(opt_names, options)), dict(plan.flags),
                  {s.name: x for s, x in zip(plan.kernel_ir.states, initial_state)} if initial_state else None,
                  cu_seqlens, head_groups(H, named))
    return with_options(plan, bound)        # options not passed: their defaults


def ops_for(plan: Plan):
    """(forward op, backward op) of a plan, registered once per process."""
    return tuple(kernel_ops(plan)[:2])


def kernel_ops(plan: Plan) -> KernelOps:
    """The registered ops of a plan and its eager call, made once per process."""
    key = (plan.name, plan.ir.spec_hash, plan.flags)
    if key in _KERNEL_OPS:
        return _KERNEL_OPS[key]
    flag_part = "".join(f"_{k}{int(v)}" for k, v in plan.flags)
    base = f"mixc::{plan.name}_{plan.ir.spec_hash[:10]}{flag_part}"
    m = plan.kernel_ir        # its states: the spec's, and a stabilizer's m

    def state_shape(bound: Bound, s) -> tuple:
        return tuple(bound.sizes[d] for d in s.shape)

    def fwd_impl(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward,
                 chunked, CK):
        """The chunked (C = CK) or recurrent forward; either keeps the states at chunk starts
        for the recurrent backward."""
        bound = _bound(plan, inputs, params, initial_state, options, cu_seqlens)
        kernels = launcher(plan, bound)         # the one launcher (standalone/launcher.py)
        run, size = (kernels.chunk_forward, {"C": CK}) if chunked else (kernels.recurrent_forward, {"CK": CK})
        o, finals, ckpts = run(bound, output_final_state=output_final_state, checkpoints=save_for_backward, **size)
        def empty():        # a fresh one each time: outputs of a custom op may not alias
            return o.new_empty(0, dtype=torch.float32)
        return ([o] + [finals[s.name] if finals else empty() for s in m.states]
                + [ckpts[s.name] if ckpts else empty() for s in m.states])

    def fwd_checked(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward,
                    chunked, CK):
        """The registered op (torch.compile's graphs call it): the packed offsets' values are checked
        here, where they exist (bind checked only their kind while tracing: binding.py)."""
        if cu_seqlens is not None:
            x = inputs[0]
            cu_seqlens_values(cu_seqlens, int(x.shape[0]), int(x.shape[1]), (x.device, plan.ir.inputs[0].name))
        return fwd_impl(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward,
                        chunked, CK)

    fwd = torch.library.custom_op(base + "_fwd", fwd_checked, mutates_args=(), schema=FWD_SCHEMA)

    @fwd.register_fake
    def _(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward, chunked, CK):
        bound = _bound(plan, inputs, params, initial_state, options, cu_seqlens)
        x = inputs[0]
        o = x.new_empty((bound.B, bound.T, bound.H) + tuple(bound.sizes[d] for d in m.output.expr.shape))
        n = bound.n_seqs
        finals = [x.new_empty(((n, bound.H) + state_shape(bound, s)) if output_final_state else (0,),
                              dtype=torch.float32) for s in m.states]
        # the chunked forward keeps every checkpoint_every-th chunk start (launch.chunk_forward)
        slots = rules(plan).checkpoint_count(bound, CK) if chunked else checkpoint_slots(bound, CK)
        ckpts = [x.new_empty(((slots, bound.H) + state_shape(bound, s)) if save_for_backward else (0,),
                             dtype=checkpoint_dtype(chunked, x.dtype, s.name, plan.layout.half_states)
                             if save_for_backward else torch.float32)
                 for s in m.states]
        return [o] + finals + ckpts

    def bwd_impl(inputs, params, checkpoints, dfinal, do, options, cu_seqlens, chunked, CK):
        """The chunked backward (chunks of CK tokens) or the recurrent one."""
        bound = _bound(plan, inputs, params, [], options, cu_seqlens)
        ckpts = {s.name: c for s, c in zip(m.states, checkpoints)}
        dfin = {s.name: g for s, g in zip(m.states, dfinal)} if dfinal else None
        kernels = launcher(plan, bound)
        if chunked:
            dinputs, dparams, dinit = kernels.chunk_backward(bound, ckpts, do, dfin, C=CK)
        else:
            dinputs, dparams, dinit = kernels.recurrent_backward(bound, ckpts, do, dfin, CK=CK)
        return ([dinputs[d.name] for d in m.inputs] + [dparams[d.name] for d in m.params]
                + [dinit[s.name] for s in m.states])

    bwd = torch.library.custom_op(base + "_bwd", bwd_impl, mutates_args=(), schema=BWD_SCHEMA)

    @bwd.register_fake
    def _(inputs, params, checkpoints, dfinal, do, options, cu_seqlens, chunked, CK):
        bound = _bound(plan, inputs, params, [], options, cu_seqlens)
        n = bound.n_seqs
        return ([torch.empty_like(x) for x in inputs] + [torch.empty_like(x) for x in params]
                + [do.new_empty((n, bound.H) + state_shape(bound, s), dtype=torch.float32) for s in m.states])

    def setup_context(ctx, inputs, output):
        ins, params, init, options, cu, output_final_state, save, chunked, CK = inputs
        n_states = len(m.states)
        ckpts = output[1 + n_states:]
        ctx.save_for_backward(*ins, *params, *ckpts, *([cu] if cu is not None else []))
        # no gradient flows into the checkpoints, and an unused output's gradient stays None:
        # otherwise autograd fills a zero tensor of each checkpoint's size on every backward
        ctx.mark_non_differentiable(*ckpts)
        ctx.set_materialize_grads(False)
        ctx.meta = (len(ins), len(params), n_states, list(options), cu is not None, output_final_state,
                    [x.dtype for x in init], bool(init), chunked, CK, tuple(output[0].shape),
                    cu.shape[0] - 1 if cu is not None else ins[0].shape[0])

    def backward(ctx, grads, bwd=bwd):
        (n_in, n_par, n_states, options, has_cu, output_final_state, init_dtypes, has_init, chunked, CK, o_shape,
         n_seqs) = ctx.meta
        saved = ctx.saved_tensors
        ins, params = list(saved[:n_in]), list(saved[n_in:n_in + n_par])
        ckpts = list(saved[n_in + n_par:n_in + n_par + n_states])
        cu = saved[-1] if has_cu else None
        do = grads[0] if grads[0] is not None else ins[0].new_zeros(o_shape)
        dfinal = list(grads[1:1 + n_states]) if output_final_state else []
        if all(g is None for g in dfinal):
            dfinal = []
        else:           # a final state whose gradient is None gets zeros
            dfinal = [g if g is not None else c.new_zeros((n_seqs,) + tuple(c.shape[1:]))
                      for g, c in zip(dfinal, ckpts)]
        out = bwd(ins, params, ckpts, dfinal, do.contiguous(), options, cu, chunked, CK)
        dins, dpars = out[:n_in], out[n_in:n_in + n_par]
        dinit = [g.to(dt) for g, dt in zip(out[n_in + n_par:], init_dtypes)] if has_init else []
        # torch.library treats a non-empty list of floats as one leaf (an empty one as a list)
        return list(dins), list(dpars), dinit, (None if options else []), None, None, None, None, None

    torch.library.register_autograd(base + "_fwd", backward, setup_context=setup_context)

    def call(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward, chunked,
             CK):
        if torch.compiler.is_compiling():
            return fwd(inputs, params, initial_state, options, cu_seqlens, output_final_state, save_for_backward,
                       chunked, CK)
        if not save_for_backward:           # no gradient wanted: the kernels directly
            return fwd_impl(inputs, params, initial_state, options, cu_seqlens, output_final_state, False,
                            chunked, CK)
        rest = (options, cu_seqlens, output_final_state, save_for_backward, chunked, CK)
        return list(_EagerKernels.apply(fwd_impl, setup_context, lambda ctx, g: backward(ctx, g, bwd_impl),
                                        (len(inputs), len(params), len(initial_state)), rest,
                                        *inputs, *params, *initial_state))

    _KERNEL_OPS[key] = KernelOps(fwd, bwd, call)
    return _KERNEL_OPS[key]


class _EagerKernels(torch.autograd.Function):
    """The registered op's forward and backward as a plain autograd.Function (eager calls):
    tensors flat in the spec's order (inputs, params, initial states), the rest as is."""

    @staticmethod
    def forward(ctx, fwd_impl, setup_context, backward, counts, rest, *tensors):
        n_in, n_par, _ = counts
        args = (list(tensors[:n_in]), list(tensors[n_in:n_in + n_par]), list(tensors[n_in + n_par:])) + rest
        out = fwd_impl(*args)
        setup_context(ctx, args, out)
        ctx.backward_impl, ctx.counts = backward, counts
        return tuple(out)           # setup_context marked the checkpoints non-differentiable

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            # create_graph=True: the kernels' backward records no graph, so a second derivative
            # (a gradient penalty) would silently lose this op's term (issue 30)
            raise ArgumentError(
                "create_graph: a second derivative through mixc's kernels (modes 'chunk', 'recurrent', 'auto' "
                "on a GPU) is not supported: their backward records no graph. Call the op with mode='torch' "
                "(or 'reference'), which supports create_graph=True")
        dins, dpars, dinit, *_ = ctx.backward_impl(ctx, list(grads))
        n_init = ctx.counts[2]
        dinit = list(dinit) if dinit else [None] * n_init
        return (None, None, None, None, None, *dins, *dpars, *dinit)

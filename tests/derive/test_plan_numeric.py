"""The Plan, run as a recurrence, must reproduce the reference: this checks the affine
decomposition, the classification pieces (decay, rank-1 terms, input term, key (x) value),
the readout split and the combine expression numerically, for every library spec."""
import pytest
import sympy as sp
import torch

import mixc
from mixc.standalone.shift import Carry
from mixc.dsl import library_names
from mixc.runtime.reference import _align, _options
from mixc.runtime.signature import bind

from .torch_eval import NamedEval
from .torch_printer import torch_callable

from helpers import case_id, random_args

CASES = [(name, {}) for name in library_names("recurrent")] + [
    ("linear_attn", {"normalize": True}), ("based", {"use_norm": False}),
    ("delta_rule", {"use_qk_l2norm_in_kernel": True}), ("gated_delta_rule", {"use_qk_l2norm_in_kernel": True}),
]


def _apply_terms(ev, terms, S: tuple, lead=2):
    """sum of scale * (proj @ S) (or scale * S) for (scale, proj, over) terms."""
    total = None
    for scale, proj, over in terms:
        t, d = S
        if proj is not None:
            (p, dp) = ev(proj)
            dims = tuple(x for x in ev.order if x in d or x in dp)
            prod = _align((p, dp), dims, lead) * _align((t, d), dims, lead)
            t, d = ev._reduce(prod, dims, over, torch.sum)
        (c, dc) = ev(scale)
        dims = tuple(x for x in ev.order if x in d or x in dc)
        term = _align((c, dc), dims, lead) * _align((t, d), dims, lead)
        if total is None:
            total = (term, dims)
        else:
            dd = tuple(x for x in ev.order if x in total[1] or x in dims)
            total = (_align(total, dd, lead) + _align((term, dims), dd, lead), dd)
    return total


def _assert_same(x, y, order):
    """Two named values are equal once broadcast to their common dims."""
    dims = tuple(d for d in order if d in x[1] or d in y[1])
    a, b = torch.broadcast_tensors(_align(x, dims, 2), _align(y, dims, 2))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,flags", CASES, ids=[n + "".join(f"-{k}" for k in f) for n, f in CASES])
def test_plan_reproduces_reference(name, flags):
    op = mixc.load(name)
    plan = op.plan(**flags)
    B, T, H = 2, 5, 3
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={d.name: 3 + i for i, d in enumerate(op.ir.dims)
                                                               if not d.alias_of}, seed=7)
    o_ref, st_ref = op.reference(**args, **flags, output_final_state=True)
    args = Carry(op.ir, args, None, None).kwargs         # with prev(x) of inputs: the derived prev_x
    bound = bind(op.ir, dict(args, **flags))
    opts = _options(op.ir, bound)
    order = op.ir.dim_names
    states = {s.name: (torch.zeros((B, H) + tuple(sizes[d] for d in s.shape), dtype=torch.float64), s.shape)
              for s in op.ir.states}
    outs = []
    for t in range(T):
        values = {n: (x[:, t], op.ir.input(n).shape) for n, x in args.items() if n in {i.name for i in op.ir.inputs}}
        values.update({n: (x.reshape((1,) + tuple(x.shape)), op.ir.param(n).shape)
                       for n, x in args.items() if n in {p.name for p in op.ir.params}})
        values.update({n: (torch.tensor(v, dtype=torch.float64).reshape(1, 1), ()) for n, v in opts.items()})
        values["head"] = (torch.arange(H, dtype=torch.float64).reshape(1, H), ())
        ev = NamedEval(plan.table, values, 2, sizes, order)
        new = {}
        for st in plan.states:
            S = states[st.name]
            a = ev(st.decay)
            # the log-space decay is the log of the decay
            if st.decay != 0:
                la = ev(st.log_decay)
                _assert_same((la[0].exp(), la[1]), a, order)
            dims = tuple(x for x in order if x in S[1] or x in a[1])
            acc = _align(a, dims, 2) * _align(S, dims, 2)
            for r in st.rank1:
                term = _apply_terms(ev, [(r.left, r.right, r.over)], S)
                acc = acc + _align(term, dims, 2)
            # a state of a coupled system also reads the others' previous values (its blocks
            # beside its own: derive/coupled.py)
            sy = next((sy for sy in plan.systems if st.name in sy.states), None)
            for blk in (sy.blocks if sy is not None else ()):
                if blk.of != st.name or blk.wrt == st.name:
                    continue
                X = states[blk.wrt]
                if blk.diagonal_sym != 0:
                    d = ev(blk.diagonal_sym)
                    xd = tuple(x for x in order if x in X[1] or x in d[1])
                    acc = acc + _align((_align(d, xd, 2) * _align(X, xd, 2), xd), dims, 2)
                if blk.projections_sym:
                    acc = acc + _align(_apply_terms(ev, list(blk.projections_sym), X), dims, 2)
            b = ev(st.input_term)
            acc = acc + _align(b, dims, 2)
            if st.key is not None:           # B_t = key (x) value
                _assert_same(ev(st.key * st.value), b, order)
            new[st.name] = (_align((acc, dims), st.shape, 2).expand((B, H) + tuple(sizes[d] for d in st.shape)),
                            st.shape)
        for r in plan.output.readouts:
            src = states[r.state] if r.prev else new[r.state]
            values[r.name] = _apply_terms(ev, r.terms, src)
        ev = NamedEval(plan.table, values, 2, sizes, order)
        o = ev(plan.output.combine)
        outs.append(_align(o, op.ir.output.expr.shape, 2).expand(o_ref[:, t].shape))
        states = new
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, rtol=1e-10, atol=1e-10)
    for name_, (S, _) in states.items():
        torch.testing.assert_close(S, st_ref[name_], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", library_names())
def test_let_partials_match_autograd(name):
    """Each let's sympy partials (nodes held fixed) equal torch autograd of the same expression."""
    plan = mixc.load(name).plan()
    gen = torch.Generator().manual_seed(3)
    for let in plan.lets + tuple(plan.states) + (plan.output,):
        exprs = ([(let.expr, let.partials)] if hasattr(let, "expr") else
                 [(let.log_decay, let.log_decay_partials)] if hasattr(let, "log_decay") else
                 [(let.combine, let.partials)])
        for expr, partials in exprs:
            syms = sorted(expr.free_symbols, key=str)
            if not syms:
                continue
            vals = [(torch.rand(17, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True) for _ in syms]
            f = torch_callable(expr, syms)
            y = f(*vals)
            if not isinstance(y, torch.Tensor) or not y.requires_grad:
                continue
            grads = torch.autograd.grad(y.sum(), vals, allow_unused=True)
            by_name = {str(s): g for s, g in zip(syms, grads)}
            for p in partials:
                dp = torch_callable(p.expr, syms)(*vals)
                want = by_name[p.wrt]
                want = torch.zeros_like(vals[0]) if want is None else want
                torch.testing.assert_close(torch.as_tensor(dp, dtype=torch.float64).expand_as(want), want,
                                           rtol=1e-10, atol=1e-12, msg=f"{name}: d{p.of}/d{p.wrt}")

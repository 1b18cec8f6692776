"""Context parallelism: `op(..., cp_group=group)` with each rank holding a contiguous shard of
the sequence (along T; with cu_seqlens, of the packed token stream).

A linear recurrence maps the state at a shard's start affinely to the state at its end:
S_end = Phi S_start + Z, with Z the shard's final state from a zero start and Phi the
transition (docs/distributed.md):

    prefix sum                   Phi = 1
    scalar / key / value /       Phi = exp(sum of the log decay over the shard), per head,
      elementwise decay                per key, per value or per state element
    rank-1 (delta rules, RWKV-7) Phi = the product of the tokens' (D_t + l_t r_t^T), a [K, K]
                                       matrix per head, from the WY form run on S0 = I, v = 0
    rank-r (DeltaProduct)        Phi = the product of the tokens' (D_t + sum_i l_t,i r_t,i^T),
                                       from the generalized UT form run on S0 = I, v = 0

each computed and applied by the class's unit (mixc/classes/<class>.py: cp_transition, cp_apply):

1. every rank runs its shard from a zero start (or the given initial states of the
   sequences that start in it): its output is final where no sequence enters the shard, and
   its last sequence's final state is Z;
2. the ranks all-gather (Phi, Z): one collective of a few states per rank (_AllGather, whose
   backward all-reduces the gathered gradients: gloo has no reduce-scatter, and the
   summaries are small);
3. a rank whose first sequence started on an earlier rank folds the summaries of the ranks
   in between into its true initial state and runs its shard again from it.

The backward runs through the same graph: the gradient of each rank's initial state reaches
the ranks whose (Phi, Z) built it through the all-gather's backward.
"""
from __future__ import annotations

import hashlib
import json

import torch

from .. import classes
from .cache import load_module
from ..standalone.binding import _check_state
from ..standalone.shift import _check_carried, last, shift, split_state
from .signature import ArgumentError, Bound, bind, option_values


def cp_call(op, group, *, kwargs: dict, initial_state, output_final_state: bool, cu_seqlens, call):
    """The op on this rank's shard, its true initial state brought in from the earlier ranks.
    `call(initial_state=..., cu_seqlens=..., output_final_state=...)` runs the op locally."""
    import torch.distributed as dist      # lazy: only where a process group is used

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # Every rank checks its own arguments, then the ranks compare what they must agree on in one
    # small all_gather, before any other collective: a rank that raised alone would leave the
    # others waiting in a collective, and shapes that differ abort gloo's all_gather.
    # Everything a rank can refuse is checked here, inside the agreement: the initial states too
    # (a bad one raised on its rank alone and left the others in the all-gather until the
    # group's timeout), a bare tensor for a one-state spec taken as the op takes it.
    try:
        # prev(x) of inputs: x stands in for prev_x while binding (the shift comes after the agreement)
        initial_state, carried = split_state(op.ir, initial_state)
        bound = bind(op.ir, dict(kwargs, initial_state=None, cu_seqlens=None,
                                 **{s.name: kwargs.get(s.source) for s in op.ir.shifted})).expanded()
        fields, refused = describe(op, bound, cu_seqlens), None
        initial_state = _check_initial_state(op, bound, initial_state, cu_seqlens)
        _check_carried_entries(op, kwargs, carried, bound, cu_seqlens)
    except ArgumentError as err:
        bound, fields, refused = None, (), str(err)
    lengths = torch.tensor([t for t, _ in agree(group, rank, world, fields, refused, bound.T if bound else 0)],
                           dtype=torch.int64)
    if (lengths == 0).any():            # every rank sees the same lengths: the same error everywhere
        empty = [r for r, t in enumerate(lengths.tolist()) if t == 0]
        raise ArgumentError(f"cp_group: rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
                            f"hold{'' if len(empty) > 1 else 's'} no tokens (T = 0): give every rank a shard of "
                            "at least one token, or leave the empty ranks out of the group")
    plan = op.plan(**bound.flags)
    if not plan.layout.torch_chunked:     # Phi comes from the torch form's pieces (its unit's cp_transition)
        raise ArgumentError(f"cp_group: mixer '{op.name}' has no chunked form (its transition is "
                            f"{plan.transition}: {plan.layout.torch_chunk_unsupported}): context parallelism "
                            "needs the shard's transition")
    if plan.systems:                      # Phi would map the stacked states together: not done
        raise ArgumentError(f"cp_group: mixer '{op.name}' has a block-affine system of coupled states "
                            f"({plan.systems[0].describe()}): its shard's transition maps the states together, "
                            "which context parallelism does not do yet; call it without cp_group")
    x0 = next(iter(bound.inputs.values()))
    T = bound.T

    # where this shard starts in the whole sequence
    offset = int(lengths[:rank].sum())
    total = int(lengths.sum())

    # local segments: one per batch row, or the packed sequences cut at the shard's ends
    if cu_seqlens is not None:
        if bound.B != 1:
            raise ArgumentError(f"cu_seqlens: packed sequences need a batch of 1 per shard, got B={bound.B}")
        cu = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise ArgumentError(f"cu_seqlens: with cp_group, the offsets of the whole packed stream (0 ... "
                                f"{total}, the sum of the shards' lengths), non-decreasing; got {cu}")
        cuts = sorted({0, T} | {c - offset for c in cu if offset < c < offset + T})
        seq_ids = [max(i for i, c in enumerate(cu[:-1]) if c <= offset + a and (cu[i + 1] > offset + a))
                   for a in cuts[:-1]]
        enters = offset not in cu
        local_cu = torch.tensor(cuts, dtype=torch.int64, device=x0.device)
    else:
        cuts, seq_ids, enters, local_cu = [0, T], None, rank > 0, None
    n_local = len(cuts) - 1

    # the states' dtype as a call without cp_group keeps it: float64 for float64 inputs (a
    # float32 cast here cost float64 callers 1e-8 against 1e-16, issue 30), float32 otherwise
    state_dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32

    def local_init(entering):
        """Initial states of the local sequences: `entering` for one that entered from the previous
        shard, the given initial state for one that starts here, zeros where none is given."""
        if initial_state is None and entering is None:
            return None
        out = {}
        for s in op.ir.states:
            shape = tuple(bound.sizes[d] for d in s.shape)
            rows = []
            for i in range(n_local if seq_ids is not None else 1):
                if i == 0 and enters and entering is not None:
                    rows.append(entering[s.name])
                elif initial_state is not None and not (i == 0 and enters):
                    given = initial_state[s.name]
                    rows.append(given if seq_ids is None else given[seq_ids[i]:seq_ids[i] + 1])
                else:
                    n = bound.B if seq_ids is None else 1
                    rows.append(torch.zeros((n, bound.H) + shape, dtype=state_dtype, device=x0.device))
            out[s.name] = torch.cat([r.to(state_dtype) for r in rows], 0)
        return out

    # 0. prev(x) of inputs: every rank's last x in one all-gather, this shard's prev_x from it
    derived, last_x, lasts = _shift_shard(op, group, rank, kwargs, carried, seq_ids, enters, local_cu, n_local)

    # 1. this shard from what it knows
    o, finals = call(initial_state=local_init(None), cu_seqlens=local_cu, output_final_state=True, **derived)
    last = slice(n_local - 1, n_local) if seq_ids is not None else slice(None)
    Z = {s.name: finals[s.name][last] for s in op.ir.states}
    Phi = _transition(plan, bound, cuts[-2], T, x0)

    # 2. one all-gather of every rank's summary and its shape of segments
    flat = [Z[s.name] for s in op.ir.states] + [Phi[s.name] for s in op.ir.states]
    sizes = [t.numel() for t in flat]
    packed = torch.cat([t.reshape(-1).to(state_dtype) for t in flat])
    everyone = _AllGather.apply(packed, group)
    meta = torch.tensor([n_local, int(enters)], dtype=torch.int64)
    metas = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)

    def unpack(r):
        parts = torch.split(everyone[r], sizes)
        names = [s.name for s in op.ir.states]
        z = {n: p.reshape(Z[n].shape) for n, p in zip(names, parts[:len(names)])}
        phi = {n: p.reshape(Phi[n].shape) for n, p in zip(names, parts[len(names):])}
        return z, phi

    # every rank's backward must run the all-gathers' backward (collectives): tie them to o. The
    # last x's all-reduce runs after the summaries' on every rank (Z reads prev_x)
    tied = (everyone,) + ((lasts,) if lasts is not None else ())
    o = _Tie.apply(o, *tied)
    if not enters:
        return o, (_with_last_x(finals, last_x) if output_final_state else None)

    # 3. fold the ranks the entering sequence crossed, then run this shard again
    chain = [rank - 1]
    while metas[chain[-1]][0] == 1 and metas[chain[-1]][1] == 1:
        chain.append(chain[-1] - 1)
    state, _ = unpack(chain[-1])
    for r in reversed(chain[:-1]):
        z, phi = unpack(r)
        state = {n: _apply(plan, n, phi[n], state[n]) + z[n] for n in state}
    o2, finals = call(initial_state=local_init(state), cu_seqlens=local_cu, output_final_state=True, **derived)
    return _Tie.apply(o2, *tied), (_with_last_x(finals, last_x) if output_final_state else None)


def _check_carried_entries(op, kwargs: dict, carried: dict, bound: Bound, cu_seqlens) -> None:
    """initial_state's prev_x entries: [B or N, H_x, *x's dims], as the op without cp_group takes them."""
    n = bound.B if cu_seqlens is None else len(cu_seqlens) - 1
    for s in op.ir.shifted:
        if s.name in carried:
            x = kwargs[s.source]
            _check_carried("initial_state", s.name, carried[s.name], (n,) + tuple(x.shape[2:]), x,
                           "B" if cu_seqlens is None else "N")


def _shift_shard(op, group, rank: int, kwargs: dict, carried: dict, seq_ids, enters: bool, local_cu, n_local: int):
    """This shard's prev_x inputs: x shifted within the local segments, a segment's first row the
    previous rank's last x where the sequence entered from it, else initial_state's prev_x (of the
    sequence that starts here) or 0. Returns (the derived inputs, each x's last token per local
    segment, the all-gathered last tokens or None)."""
    if not op.ir.shifted:
        return {}, {}, None
    xs = [kwargs[s.source] for s in op.ir.shifted]
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    tails = [x[:, -1] for x in xs]                          # [B, H_x, ...] each (T >= 1 on every rank)
    lasts = _AllGather.apply(torch.cat([t.reshape(-1).to(dtype) for t in tails]), group)
    before = torch.split(lasts[rank - 1], [t.numel() for t in tails]) if rank > 0 else None
    derived, last_x = {}, {}
    for j, (s, x) in enumerate(zip(op.ir.shifted, xs)):
        prev_rank = before[j].reshape(tails[j].shape).to(x.dtype) if before is not None else None
        given = carried.get(s.name)
        if seq_ids is None:                                 # one segment per batch row
            first = prev_rank if rank > 0 else given
        else:
            rows = []
            for i in range(n_local):
                if i == 0 and enters:
                    rows.append(prev_rank[0])
                elif given is not None:
                    rows.append(given[seq_ids[i]].to(x.dtype))
                else:
                    rows.append(x.new_zeros(tails[j].shape[1:]))
            first = torch.stack(rows)
        derived[s.name] = shift(x, local_cu, first)
        last_x[s.name] = last(x, local_cu, first)
    return derived, last_x, lasts


def _with_last_x(finals: dict, last_x: dict) -> dict:
    """The local segments' final states with each prev_x entry (x's last token), in their dtype."""
    if not last_x:
        return finals
    dtype = next(iter(finals.values())).dtype
    return {**finals, **{k: v.to(dtype) for k, v in last_x.items()}}


DESCRIPTOR_BYTES = 4096


def _check_initial_state(op, bound: Bound, initial_state, cu_seqlens):
    """The initial states as the op checks them: [B, H, *dims], or [N, H, *dims] for the N
    sequences of the whole packed stream (every rank passes the same)."""
    if initial_state is None:
        return None
    n = bound.B if cu_seqlens is None else len(cu_seqlens) - 1
    x0 = next(iter(bound.inputs.values()))
    return _check_state(op.ir, initial_state, n, bound.H, dict(bound.sizes), packed=cu_seqlens is not None,
                        devices={"device": (x0.device, next(iter(bound.inputs)))})


def describe(op, bound: Bound, cu_seqlens) -> tuple[tuple[str, str], ...]:
    """What every rank must agree on, as (what, value) pairs: the spec, B and H, the dims, each
    tensor's dtype, the options and flags, and the packed stream's offsets. T may differ."""
    out = [("spec", f"{op.name} ({hashlib.sha1(op.ir.source.text.encode()).hexdigest()[:12]})"),
           ("B", str(bound.B)), ("H", str(bound.H))]
    out += [(f"dim {d}", str(n)) for d, n in bound.sizes.items() if d != "T"]
    out += [(f"the dtype of {n}", str(t.dtype).replace("torch.", ""))
            for n, t in list(bound.inputs.items()) + list(bound.params.items())]
    out += [(f"option {k}", repr(v)) for k, v in option_values(op.ir, bound).items()]
    out += [(f"flag {o.name}", repr(bound.flags.get(o.name, o.default))) for o in op.ir.flags]
    if cu_seqlens is None:
        out.append(("cu_seqlens", "None"))
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
                or cu_seqlens.dim() != 1 or cu_seqlens.device.type == "meta":
            got = (f"dtype {cu_seqlens.dtype}, shape {list(cu_seqlens.shape)}, device {cu_seqlens.device}"
                   if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
            raise ArgumentError(f"cu_seqlens: expected a 1-D int32 or int64 tensor of the whole packed stream's "
                                f"offsets, got {got}")
        cu = cu_seqlens.tolist()
        text = repr(cu) if len(cu) <= 8 else hashlib.sha1(repr(cu).encode()).hexdigest()[:12] + f" ({len(cu)} offsets)"
        out.append(("cu_seqlens", text))
    return tuple(out)


def agree(group, rank: int, world: int, fields, refused: str | None, T: int) -> list[tuple[int, dict]]:
    """All-gather every rank's (T, fields, error) as a fixed-size byte buffer; raise the same
    ArgumentError on every rank when one refused its arguments or two disagree. Returns each
    rank's (T, fields)."""

    import torch.distributed as dist      # lazy: only where a process group is used
    text = json.dumps({"T": T, "fields": list(fields), "refused": refused}).encode()
    if len(text) > DESCRIPTOR_BYTES:         # a spec with very many tensors: compare a digest of the rest
            text = json.dumps({"T": T, "fields": [["arguments", hashlib.sha1(text).hexdigest()]],
                           "refused": refused and refused[:1000]}).encode()
    buf = torch.zeros(DESCRIPTOR_BYTES + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor(list(len(text).to_bytes(8, "little")), dtype=torch.uint8)
    buf[8:8 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    parts = [torch.empty_like(buf, device=device) for _ in range(world)]
    dist.all_gather(parts, buf.to(device), group=group)
    descs = []
    for p in parts:
        p = p.cpu()
        n = int.from_bytes(bytes(p[:8].tolist()), "little")
        descs.append(json.loads(bytes(p[8:8 + n].tolist()).decode()))
    for r, d in enumerate(descs):
        if d["refused"] is not None:
            raise ArgumentError(f"cp_group: rank {r} refused its arguments: {d['refused']}")
    first = dict(map(tuple, descs[0]["fields"]))
    for r, d in enumerate(descs[1:], 1):
        mine = dict(map(tuple, d["fields"]))
        for what in list(first) + [w for w in mine if w not in first]:
            if first.get(what) != mine.get(what):
                raise ArgumentError(f"cp_group: the ranks disagree on {what}: rank 0 has {first.get(what, 'none')}, "
                                    f"rank {r} has {mine.get(what, 'none')}; every rank must pass the same B, H, "
                                    "dims, dtypes, options and cu_seqlens (only the shard's length T may differ)")
    return [(d["T"], dict(map(tuple, d["fields"]))) for d in descs]


class _AllGather(torch.autograd.Function):
    """[W, n]: every rank's x; the backward sums the gradients of the gathered copies over the
    ranks (one all-reduce) and keeps this rank's row."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist      # lazy: only where a process group is used
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist      # lazy: only where a process group is used
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _Tie(torch.autograd.Function):
    """o, unchanged; its backward also sends zeros to `tied`, so that every rank runs the
    backward of the collective that made `tied`, whether or not its output used it."""

    @staticmethod
    def forward(ctx, o, *tied):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tied]
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes)


def _layout(st: dict):
    """(permutation from the declared layout to key dims then value dims, and back)."""
    order = st["kd"] + st["vd"]
    to = [st["decl"].index(d) for d in order]
    back = [order.index(d) for d in st["decl"]]
    return to, back


def _transition(plan, bound: Bound, start: int, end: int, x0: torch.Tensor) -> dict:
    """Phi of every state over tokens [start, end) of this shard, shaped to act on a state in
    its declared layout [n, H, *dims] (see _apply)."""
    mod = load_module(plan)
    dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
    x = {n: t[:, start:end].to(dtype) for n, t in bound.inputs.items()}
    p = {n: t.to(dtype) for n, t in bound.params.items()}
    opt = {k: torch.tensor(v, dtype=dtype, device=x0.device) for k, v in option_values(plan.ir, bound).items()}
    n = bound.B if bound.cu_seqlens is None else 1
    pc = mod.torch_pieces(x, p, opt, dict(bound.sizes), x0.shape[0], end - start, bound.H)
    # each class's Phi is its unit's (mixc/classes/<class>.py, cp_transition)
    return {name: classes.unit(st["class"]).cp_transition(st, pc, name, n, bound.H)
            for name, st in mod.TORCH_STATES.items()}


def _apply(plan, name: str, phi: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Phi S for a state in its declared layout [n, H, *dims]."""
    mod = load_module(plan)
    st = mod.TORCH_STATES[name]
    to, back = _layout(st)
    n, H = state.shape[:2]
    flat = state.permute(0, 1, *[2 + i for i in to])
    shape = flat.shape
    kf = int(torch.tensor(shape[2:2 + len(st["kd"])]).prod()) if st["kd"] else 1
    flat = flat.reshape(n, H, kf, -1).to(phi.dtype)
    new = classes.unit(st["class"]).cp_apply(st, phi, flat)
    return new.reshape(shape).permute(0, 1, *[2 + i for i in back]).to(state.dtype)

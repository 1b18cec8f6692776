"""A sequence mixer evaluated over its IR with torch: per-token values are [B, T, H, *dims]
tensors (size 1 where they do not vary: params are [1, 1, H, ...]), and each sequence op
(conv, mix, attend) reads the new tokens together with a cache of the past.

One evaluation handles rows that share their history length p (0 for a fresh call): the new
tokens sit at positions p .. p + Tn - 1, per-position params are sliced to those rows (and a
[T, T] param's columns to positions 0 .. p + Tn - 1), and every op returns its outputs for the
new tokens and its updated cache. runtime/sequence.py splits a call into such evaluations.

Exponentials are carried with a scale (when `stabilize`): a value is t * exp(c) with c held
constant in the backward and constant along time and the positional dims (T, conv taps), so
that products, quotients, sums and the linear sequence ops pass it through exactly and a
ratio of two exponential sums (AFT) never forms exp(k) itself."""
from __future__ import annotations

import math
import string

import torch

from ..derive.sequence import SequencePlan
from ..dsl import ir
from . import seqops
from .reference import _FNS, _align
from .signature import ArgumentError

LEAD = 3


class Val:
    """t * exp(c): t [B|1, Tn|1, H|1, *dims sizes|1] over `dims`; c None or the same layout with
    size 1 along time and the positional dims."""

    __slots__ = ("t", "dims", "c")

    def __init__(self, t: torch.Tensor, dims: tuple[str, ...], c: torch.Tensor | None = None):
        self.t, self.dims, self.c = t, tuple(dims), c

    def plain(self) -> torch.Tensor:
        return self.t if self.c is None else self.t * torch.exp(self.c)


def _to(v: Val, dims, lead=LEAD) -> tuple[torch.Tensor, torch.Tensor | None]:
    """t and c aligned to `dims` (a superset of v's)."""
    t = _align((v.t, v.dims), dims, lead)
    c = _align((v.c, v.dims), dims, lead) if v.c is not None else None
    return t, c


class Run:
    """What one evaluation knows: sizes, the new tokens' count and offset, the caches."""

    def __init__(self, mixer, plan: SequencePlan, flags, sizes, B, Tn, H, p, dtype, device, method, stabilize,
                 cache_in: dict | None, windows: dict[int, int]):
        self.m, self.plan, self.flags = mixer, plan, flags
        self.sizes = dict(sizes)
        self.sizes[ir.POSITIONS] = p + Tn
        self.B, self.Tn, self.H, self.p = B, Tn, H, p
        self.dtype, self.device, self.method, self.stabilize = dtype, device, method, stabilize
        self.cache_in = cache_in or {}
        self.cache_out: dict[str, torch.Tensor] = {}
        self.windows = windows
        self.order = tuple(mixer.dim_names) + (ir.POSITIONS,)
        # dims a scale must not vary along: positions and conv taps (the ops sum over them)
        self.positional = {ir.POSITIONS} | {op.tap for op in mixer.sequence_ops if op.tap is not None}
        self.ops = {op.index: op for op in plan.ops}

    def canon(self, dims) -> tuple[str, ...]:
        return tuple(d for d in self.order if d in set(dims))

    def full(self, t: torch.Tensor, dims) -> torch.Tensor:
        """t expanded to [B, Tn, H, *sizes]."""
        return t.expand((self.B, t.shape[1], self.H) + tuple(self.sizes[d] for d in dims))


class Evaluator:
    def __init__(self, run: Run, env: dict[str, Val]):
        self.r = run
        self.env = env

    def __call__(self, e: ir.Expr) -> Val:
        return getattr(self, "e_" + type(e).__name__)(e)

    def scalar(self, x: float) -> Val:
        return Val(torch.tensor(x, dtype=self.r.dtype, device=self.r.device).reshape(1, 1, 1), ())

    # ---- leaves and elementwise algebra ----
    def e_Num(self, e):
        return self.scalar(e.value)

    def e_Ref(self, e: ir.Ref):
        if e.kind == "dim":
            return self.scalar(float(self.r.sizes[e.name]))
        if e.kind == "head":
            return Val(torch.arange(self.r.H, dtype=self.r.dtype, device=self.r.device).reshape(1, 1, -1), ())
        return self.env[e.name]

    def e_Neg(self, e):
        v = self(e.x)
        return Val(-v.t, v.dims, v.c)

    def e_BinOp(self, e: ir.BinOp):
        a, b = self(e.left), self(e.right)
        out = self.r.canon(e.shape)
        if e.op == "**":
            if isinstance(e.right, ir.Num):
                ta, ca = _to(a, out)
                return Val(ta ** e.right.value, out, ca * e.right.value if ca is not None else None)
            return Val(_align((a.plain(), a.dims), out, LEAD) ** _align((b.plain(), b.dims), out, LEAD), out)
        (ta, ca), (tb, cb) = _to(a, out), _to(b, out)
        if e.op in ("*", "/"):
            t = ta * tb if e.op == "*" else ta / tb
            if ca is None and cb is None:
                return Val(t, out)
            ca = ca if ca is not None else torch.zeros_like(cb)
            cb = cb if cb is not None else torch.zeros_like(ca)
            return Val(t, out, ca + cb if e.op == "*" else ca - cb)
        if ca is None and cb is None:
            return Val(ta + tb if e.op == "+" else ta - tb, out)
        # a sum of scaled values: both to the larger scale, exactly
        za = ca if ca is not None else torch.zeros_like(cb)
        zb = cb if cb is not None else torch.zeros_like(ca)
        c = torch.maximum(za, zb)
        ta, tb = ta * torch.exp(za - c), tb * torch.exp(zb - c)
        return Val(ta + tb if e.op == "+" else ta - tb, out, c)

    def e_Call(self, e: ir.Call):
        if e.fn in ("max", "min"):
            a, b = (self(x) for x in e.args)
            out = self.r.canon(e.shape)
            a, b = _align((a.plain(), a.dims), out, LEAD), _align((b.plain(), b.dims), out, LEAD)
            return Val((torch.maximum if e.fn == "max" else torch.minimum)(a, b), out)
        v = self(e.args[0])
        if e.fn == "exp" and self.r.stabilize:
            x = v.plain()
            axes = [1] + [LEAD + i for i, d in enumerate(v.dims) if d in self.r.positional]
            c = x.detach().amax(dim=axes, keepdim=True) if x.numel() else \
                x.new_zeros([1 if i in axes else n for i, n in enumerate(x.shape)])
            c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
            return Val(torch.exp(x - c), v.dims, c)
        if e.fn == "log" and v.c is not None:            # log(t exp(c)) = log t + c: no overflow
            return Val(torch.log(v.t) + v.c, v.dims)
        return Val(_FNS[e.fn](v.plain()), v.dims)

    def e_Contract(self, e: ir.Contract):
        a, b = self(e.left), self(e.right)
        letters = {d: string.ascii_letters[i] for i, d in enumerate(self.r.order)}
        spec = (f"...{''.join(letters[d] for d in a.dims)},...{''.join(letters[d] for d in b.dims)}"
                f"->...{''.join(letters[d] for d in self.r.canon(e.shape))}")
        return Val(torch.einsum(spec, a.plain(), b.plain()), self.r.canon(e.shape))

    def e_Reduce(self, e: ir.Reduce):
        v = self(e.x)
        t = v.plain()
        axes = [LEAD + v.dims.index(x) for x in e.over]
        t = t.expand(t.shape[:LEAD] + tuple(self.r.sizes[d] if s == 1 else s for d, s in zip(v.dims, t.shape[LEAD:])))
        r = {"sum": lambda: t.sum(dim=axes), "norm": lambda: torch.linalg.vector_norm(t, dim=axes),
             "max": lambda: t.amax(dim=axes), "min": lambda: t.amin(dim=axes)}[e.fn]()
        return Val(r, tuple(x for x in v.dims if x not in e.over))

    def e_Rename(self, e: ir.Rename):
        v = self(e.x)
        m = dict(e.mapping)
        out = self.r.canon(e.shape)
        return Val(_align((v.plain(), tuple(m.get(x, x) for x in v.dims)), out, LEAD), out)

    def e_Cond(self, e: ir.Cond):
        return self(e.then if self.r.flags[e.flag] else e.otherwise)

    def e_Prev(self, e):
        raise AssertionError("a sequence mixer has no state")

    # ---- sequence ops ----
    def e_SeqOp(self, e: ir.SeqOp) -> Val:
        key = ("op", e.index)
        if key not in self.env:          # an op inside a let is evaluated once
            self.env[key] = getattr(self, "op_" + e.kind)(e, self.r.ops[e.index])
        return self.env[key]

    def _history(self, key: str, new: Val, dims) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(cached [B, len, H, *dims] or None, new tokens [B, Tn, H, *dims], their common scale)."""
        t, c = _to(new, dims)
        t = self.r.full(t, dims)
        old = self.r.cache_in.get(key)
        oc = self.r.cache_in.get(key + "_scale")
        old = old.to(self.r.dtype).movedim(2, 1) if old is not None else None     # [B, H, len, ...] -> [B, len, H, ...]
        if c is None and oc is None:
            return old, t, None
        c = self.r.full(c, dims)[:, :1] if c is not None else None
        oc = oc.to(self.r.dtype).unsqueeze(1) if oc is not None else None
        if old is None:
            return None, t, c
        zc = c if c is not None else torch.zeros_like(oc)
        zo = oc if oc is not None else torch.zeros_like(zc)
        s = torch.maximum(zc, zo)
        return old * torch.exp(zo - s), t * torch.exp(zc - s), s

    def _keep(self, key: str, t: torch.Tensor, c: torch.Tensor | None) -> None:
        self.r.cache_out[key] = t.movedim(1, 2)                          # [B, H, len, *dims]
        if c is not None:
            self.r.cache_out[key + "_scale"] = c[:, 0]

    def op_conv(self, e: ir.SeqOp, op) -> Val:
        r = self.r
        h, x = self(e.args[0]), self(e.args[1])
        out, xd, name = r.canon(e.shape), r.canon(x.dims), op.name

        def scale_of(c, dims):
            return _align((c, dims), out, LEAD) if c is not None else None

        if op.filter == "constant" and op.causal:
            # the same tap at every lag: h times the running sum of x (cached as one row)
            th, ch = _to(h, out)
            old, t, c = self._history(f"{name}_sum", x, xd)
            before = old if old is not None else t.new_zeros(t.shape[:1] + (1,) + t.shape[2:])
            csum = torch.cumsum(t, 1) + before
            self._keep(f"{name}_sum", csum[:, -1:] if r.Tn else before, c)
            return Val(th * _align((csum, xd), out, LEAD), out, _sum_scales(ch, scale_of(c, xd)))
        if op.tap is not None:
            th, ch = _to(h, (op.tap,) + out)                          # [1, 1, H, L, *out]: no time axis
            L = th.shape[LEAD]
            if not r.cache_in and L > r.Tn > 0:       # a fresh call (a cache, even empty, streams on)
                raise ArgumentError(f"{op.text} (in {op.where}): the filter has {op.tap} = {L} taps but the "
                                    f"sequence has T = {r.Tn} tokens; a filter may not be longer than the sequence")
            taps = th[:, 0].movedim(LEAD - 1, 1)                            # [1, L, H, *out]
            ch = ch[:, 0].movedim(LEAD - 1, 1) if ch is not None else None  # size 1 along the taps
            if not op.causal:
                return Val(seqops.centred_conv(taps, _align((x.plain(), x.dims), out, LEAD), method=r.method), out)
            old, t, c = self._history(f"{name}_x", x, xd)
            if old is None:                                                 # nothing before the sequence
                old = t.new_zeros((t.shape[0], L - 1) + t.shape[2:])
            xs = torch.cat([old, t], 1)
            self._keep(f"{name}_x", xs[:, xs.shape[1] - (L - 1):], c)
            y = _causal_conv(taps, _align((xs, xd), out, LEAD), r.Tn, r.method)
            return Val(y, out, _sum_scales(ch, scale_of(c, xd)))
        # no tap dim: the taps run along time, h at token j is tap j
        hd = r.canon(h.dims)
        if not op.causal:
            th = _align((h.plain(), h.dims), out, LEAD)
            th = th.expand((th.shape[0], r.Tn) + th.shape[2:])
            return Val(seqops.centred_conv(th, _align((x.plain(), x.dims), out, LEAD), method=r.method), out)
        hv = Val(h.t.expand((h.t.shape[0], r.Tn) + h.t.shape[2:]), h.dims, h.c)
        oldh, th, chh = self._history(f"{name}_h", hv, hd)
        oldx, tx, cx = self._history(f"{name}_x", x, xd)
        hs = torch.cat([oldh, th], 1) if oldh is not None else th
        xs = torch.cat([oldx, tx], 1) if oldx is not None else tx
        self._keep(f"{name}_h", hs, chh)
        self._keep(f"{name}_x", xs, cx)
        y = _causal_conv(_align((hs, hd), out, LEAD), _align((xs, xd), out, LEAD), r.Tn, r.method)
        return Val(y, out, _sum_scales(scale_of(chh, hd), scale_of(cx, xd)))

    def op_mix(self, e: ir.SeqOp, op) -> Val:
        r = self.r
        W, x = self(e.args[0]), self(e.args[1])
        out = r.canon(e.shape)
        xd = r.canon(x.dims)
        tw, cw = _to(W, out + (ir.POSITIONS,))
        if op.causal:
            old, t, c = self._history(f"{op.name}_x", x, xd)
            xs = torch.cat([old, t], 1) if old is not None else t
            self._keep(f"{op.name}_x", xs, c)
        else:
            t, c = _to(x, xd)
            xs = r.full(t, xd)
            c = c[:, :1] if c is not None else None
        y = seqops.token_mix(tw, _align((xs, xd), out, LEAD), op.causal, r.p)
        cw = cw.squeeze(-1) if cw is not None else None
        return Val(y, out, _sum_scales(cw, _align((c, xd), out, LEAD) if c is not None else None))

    def op_attend(self, e: ir.SeqOp, op) -> Val:
        r = self.r
        q, k, v = (self(a) for a in e.args)
        qd, vd = r.canon(e.args[0].shape), r.canon(e.args[2].shape)
        window = r.windows.get(e.index)

        def flat(val: Val, dims) -> torch.Tensor:
            t = r.full(_align((val.plain(), val.dims), dims, LEAD), dims)
            return t.reshape(t.shape[:LEAD] + (math.prod(t.shape[LEAD:]),))

        def cached(key: str) -> torch.Tensor:          # [B, H, len, *dims] -> [B, len, H, E]
            t = r.cache_in[key].to(r.dtype).movedim(2, 1)
            return t.reshape(t.shape[:LEAD] + (math.prod(t.shape[LEAD:]),))

        def keep(key: str, t: torch.Tensor, dims, n: int) -> None:
            t = _last(t, n)
            self._keep(key, t.reshape(t.shape[:LEAD] + tuple(r.sizes[d] for d in dims)), None)

        qf = flat(q, qd)
        kf, vf = flat(k, qd), flat(v, vd)
        k0 = 0
        if op.causal:
            if f"{op.name}_k" in r.cache_in:
                old = cached(f"{op.name}_k")
                kf = torch.cat([old, kf], 1)
                vf = torch.cat([cached(f"{op.name}_v"), vf], 1)
                k0 = r.p - old.shape[1]                 # a window cache's padding sits at negative positions
            n = kf.shape[1] if window is None else min(window - 1, kf.shape[1])   # not more than was seen
            keep(f"{op.name}_k", kf, qd, n)
            keep(f"{op.name}_v", vf, vd, n)
        # a key or value holding inf or NaN is zeroed before the attention (0 * inf would be NaN
        # in every query row, the ones that may not read it included) and the rows that read it
        # are NaN, as the masked softmax written out gives
        bad = ~(torch.isfinite(kf).all(-1) & torch.isfinite(vf).all(-1))           # [B, Tk, H]
        kf, vf = kf.masked_fill(bad.unsqueeze(-1), 0.0), vf.masked_fill(bad.unsqueeze(-1), 0.0)
        o = seqops.attention(qf, kf, vf, causal=op.causal, window=window, q0=r.p, k0=k0, method=r.method)
        allowed = seqops.attention_mask(qf.shape[1], kf.shape[1], r.p, k0, op.causal, window, qf.device)
        if allowed is None:
            reads_bad = bad.any(1, keepdim=True)
        else:
            reads_bad = torch.einsum("bjh,ij->bih", bad.to(o.dtype), allowed.to(o.dtype)) > 0
        o = o.masked_fill(reads_bad.unsqueeze(-1), float("nan"))
        o = o.reshape(o.shape[:LEAD] + tuple(r.sizes[d] for d in vd))
        return Val(o, vd)


def _causal_conv(h: torch.Tensor, x: torch.Tensor, rows: int, method: str) -> torch.Tensor:
    """seqops.causal_conv with causality kept under non-finite input: the FFT mixes every input
    into every output (an inf at a late token made all of them NaN), so the entries of x that
    are not finite are zeroed before it and the outputs they reach (the L rows from theirs on,
    per channel) are NaN, as the direct sum gives. A non-finite filter tap is the filter's
    problem, not causality's: it is left as it is."""
    bad = ~torch.isfinite(x)
    y = seqops.causal_conv(h, x.masked_fill(bad, 0.0), rows=rows, method=method)
    N, L = x.shape[1], h.shape[1]
    seen = torch.cumsum(bad.to(torch.int32), 1)
    out_of_reach = torch.cat([torch.zeros_like(seen[:, :L]), seen], 1)[:, :N]     # up to token i - L
    reached = (seen - out_of_reach > 0)[:, N - rows:]
    return y.masked_fill(reached, float("nan"))


def _last(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last n rows along time, zero-padded in front when there are fewer."""
    if t.shape[1] >= n:
        return t[:, t.shape[1] - n:]
    return torch.cat([t.new_zeros((t.shape[0], n - t.shape[1]) + t.shape[2:]), t], 1)


def _sum_scales(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def evaluate(run: Run, env: dict[str, Val]) -> torch.Tensor:
    """Every let, then the output [B, Tn, H, *output dims] (plain, in run.dtype)."""
    ev = Evaluator(run, env)
    for let in run.m.lets:
        env[let.name] = ev(let.expr)
    v = ev(run.m.output.expr)
    out = run.canon(run.m.output.expr.shape)
    t = _align((v.plain(), v.dims), out, LEAD)
    return t.expand((run.B, run.Tn, run.H) + tuple(run.sizes[d] for d in out))


def leaves(run: Run, inputs: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
           options: dict[str, float]) -> dict[str, Val]:
    """The env of one evaluation: inputs [B, Tn, H, ...] as given, params [1, 1, H, ...],
    per-position params sliced to rows p .. p + Tn - 1 (and columns 0 .. p + Tn - 1)."""
    m, p, Tn = run.m, run.p, run.Tn
    env: dict[str, Val] = {}
    for name, x in inputs.items():
        env[name] = Val(x.to(run.dtype), m.input(name).shape)
    for name, x in params.items():
        decl = m.param(name)
        x = x.to(run.dtype)
        if decl.shape[:1] == (ir.POSITIONS,):
            need = p + Tn
            for axis in range(1, 1 + decl.shape.count(ir.POSITIONS)):
                if x.shape[axis] < need:
                    what = "rows" if axis == 1 else "columns"
                    raise ArgumentError(f"{name}: a per-position param must cover the positions of the call: it has "
                                        f"{x.shape[axis]} {what} (axis {axis}), the call reaches position {need - 1} "
                                        f"(T = {need} tokens); expected shape [H, {', '.join(decl.shape)}] with T >= "
                                        f"{need}")
            x = x.narrow(1, p, Tn)
            if decl.shape[1:2] == (ir.POSITIONS,):
                x = x.narrow(2, 0, need)
            env[name] = Val(x.movedim(0, 1).unsqueeze(0), decl.shape[1:])     # [1, Tn, H, ...]
        else:
            env[name] = Val(x.reshape((1, 1) + tuple(x.shape)), decl.shape)
    for name, v in options.items():
        env[name] = Val(torch.tensor(v, dtype=run.dtype, device=run.device).reshape(1, 1, 1), ())
    return env



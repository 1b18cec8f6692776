"""MixerLayer: a token-mixing layer around any spec's op.

    x [B, T, d_model] -> one input projection -> (short causal conv + SiLU on q/k/v-like
    inputs) -> each input's role (roles.py) -> op -> per-head RMSNorm -> SiLU output gate
    -> output projection -> y [B, T, d_model]

Everything about the spec is read off its IR: the inputs it declares and their shapes by
dim name, its params, its options and its output's shape. So a library spec, a user's .mix
file and the non-recurrent specs (attention, whose state is a KV cache) go through the same
code. The layer's state for decoding is a dict: {"mixer": the op's state dict, "conv": the
last kernel - 1 projected tokens of the short convolution (absent without one)}.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..pipeline import load_op as load
from ..runtime.context_parallel import _AllGather, _Tie
from ..runtime.signature import ArgumentError
from .roles import DIM_DEFAULTS, OPTION_DEFAULTS, input_role, param_role


class MixerLayer(nn.Module):
    """A mixer layer over a spec.

    spec: a library name ('gla'), a .mix path or a loaded op (mixc.load). head_dims: sizes of
    the spec's dims by name (e.g. {"K": 16, "V": 32}); unset dims take the paper's default
    (roles.DIM_DEFAULTS: Mamba's N = 16, Based's K = 16, ...) or d_model // n_heads.
    max_len: the longest sequence, for specs with params over the tokens (Hyena's filters
    h[T, D], AFT-full's w[T, T], token-mixing W[T, T]); required by those only.
    options: the op's options (scale, flags), on top of roles.OPTION_DEFAULTS.
    conv_size: kernel of the short causal depthwise conv on q/k/v-like inputs (0: none).
    output_gate: multiply the normalized output by silu(W_g x) (GLA, Mamba-2).
    norm: RMSNorm over each head's output (over all heads where a head's output is a scalar).
    mode: the op's mode ("auto": kernels on CUDA or under TRITON_INTERPRET=1, torch otherwise).
    op_kwargs: extra arguments of the op's sequence calls (not of step()), e.g. {"chunk": 8}
    for the torch backend's chunk size.
    """

    def __init__(self, spec, d_model: int, n_heads: int = 4, *, head_dims: dict | None = None,
                 options: dict | None = None, conv_size: int = 4, output_gate: bool = True,
                 norm: bool = True, mode: str = "auto", max_len: int | None = None,
                 op_kwargs: dict | None = None):
        super().__init__()
        self.op = spec if hasattr(spec, "ir") and callable(spec) else load(spec)
        ir = self.op.ir
        self.spec = ir.name
        self.d_model, self.n_heads, self.mode = d_model, n_heads, mode
        self.op_kwargs = dict(op_kwargs or {})
        self.options = dict(OPTION_DEFAULTS.get(self.spec, {})) | dict(options or {})
        unknown = set(self.options) - {o.name for o in ir.options}
        if unknown:
            raise ValueError(f"options {sorted(unknown)}: spec '{self.spec}' has "
                             f"{', '.join(o.name for o in ir.options) or 'no options'}")
        self.sizes = self._dim_sizes(d_model // n_heads, head_dims or {})
        over_t = [f"{d.name}[{', '.join(d.shape)}]" for d in ir.params if "T" in d.shape]
        if over_t and max_len is None:
            raise ValueError(f"spec '{self.spec}' has params over the tokens ({', '.join(over_t)}): "
                             "give max_len, the longest sequence the layer will see")
        self.max_len = max_len
        if max_len is not None:
            self.sizes["T"] = max_len
        H = n_heads

        # One fused input projection: the conv'ed inputs first (one conv over their channels),
        # then the rest, then the output gate.
        self.roles = {d.name: input_role(self.spec, d.name) for d in ir.given_inputs}
        shapes = {d.name: tuple(self.sizes[n] for n in d.shape) for d in ir.given_inputs}
        self.conv_size = conv_size
        conv_names = [n for n in shapes if self.roles[n].conv] if conv_size > 1 else []
        order = conv_names + [n for n in shapes if n not in conv_names]
        self.shapes = shapes
        self.widths = {n: H * math.prod(shapes[n]) for n in order}
        self.conv_width = sum(self.widths[n] for n in conv_names)
        self.out_shape = tuple(self.sizes[n] for n in ir.output.expr.shape)
        self.out_per_head = math.prod(self.out_shape)
        self.output_gate = output_gate
        gate_width = H * self.out_per_head if output_gate else 0
        self.order = order
        self.in_proj = nn.Linear(d_model, sum(self.widths.values()) + gate_width)
        self._init_in_proj(order)
        for n in order:
            self.roles[n].setup(self, n, H, shapes[n])
        if self.conv_width:
            # the depthwise causal conv's weights (weight [C, 1, kernel]); _conv applies them
            self.conv = nn.Conv1d(self.conv_width, self.conv_width, conv_size, groups=self.conv_width, bias=True)
        else:
            self.conv = None
        # the roles in an order where each comes after the inputs it reads (RWKV-7's b after a)
        self.apply_order = _needs_order(order, self.roles)

        self.param_roles = {}
        for d in ir.given_params:       # a const's values are the spec's: no parameter
            role = param_role(self.spec, d.name)
            shape = tuple(self.sizes[n] for n in d.shape)
            self.param_roles[d.name] = role
            self.register_parameter(self._pname(d.name), nn.Parameter(role.init(H, shape),
                                                                      requires_grad=not role.frozen))
        if norm:
            self.norm = nn.RMSNorm(self.out_per_head if self.out_per_head > 1 else H, eps=1e-5)
        else:
            self.norm = None
        self.out_proj = nn.Linear(H * self.out_per_head, d_model, bias=False)

    # ---------------------------------------------------------------- construction
    def _dim_sizes(self, head_dim: int, given: dict) -> dict[str, int]:
        ir = self.op.ir
        unknown = set(given) - set(ir.dim_names)
        if unknown:
            raise ValueError(f"head_dims {sorted(unknown)}: spec '{self.spec}' has dims {', '.join(ir.dim_names)}")
        sizes = {}
        for d in ir.dims:
            root = ir.root_dim(d.name)
            sizes[d.name] = ir.fixed_size(d.name) or given.get(root) or DIM_DEFAULTS.get((self.spec, root)) or head_dim
            if d.alias_of is not None and d.name in given and given[d.name] != sizes[d.name]:
                raise ValueError(f"head_dims: {d.name} = {d.alias_of} in spec '{self.spec}'; give {root} only")
        return sizes

    def _init_in_proj(self, order) -> None:
        nn.init.normal_(self.in_proj.weight, std=self.d_model ** -0.5)
        nn.init.zeros_(self.in_proj.bias)
        start = 0
        for n in order:
            w = self.widths[n]
            self.roles[n].init_bias(self.in_proj.bias.data[start:start + w], self.n_heads, self.shapes[n])
            start += w

    @staticmethod
    def _pname(name: str) -> str:
        return f"param_{name}"

    def spec_params(self) -> dict[str, torch.Tensor]:
        """The spec's params as the op takes them ([H, *dims], reparametrizations applied)."""
        return {n: r.value(getattr(self, self._pname(n))) for n, r in self.param_roles.items()}

    # ---------------------------------------------------------------- shared pieces
    def _project(self, x: torch.Tensor, conv_cache, cp_group=None):
        """x [*lead, d_model] with lead (B, T) or (B,) -> (the op's inputs, the gate or None,
        the new conv cache, the gathered conv tails or None). conv_cache: [B, C, kernel - 1] or
        None (zeros: a fresh sequence). cp_group: x is this rank's shard; the conv continues
        from the previous rank's last kernel - 1 tokens (rank 0: from conv_cache)."""
        z = self.in_proj(x)
        step = x.dim() == 2
        new_cache, tails = None, None
        if self.conv is not None:
            c, rest = z[..., :self.conv_width], z[..., self.conv_width:]
            if cp_group is not None:
                conv_cache, tails = self._conv_halo(c, conv_cache, cp_group)
            c, new_cache = self._conv(c.unsqueeze(1) if step else c, conv_cache)
            z = torch.cat([F.silu(c.squeeze(1) if step else c), rest], -1)
        lead = z.shape[:-1]
        raw, start = {}, 0
        for n in self.order:
            w = self.widths[n]
            raw[n] = z[..., start:start + w].reshape(lead + (self.n_heads,) + self.shapes[n])
            start += w
        gate = z[..., start:].reshape(lead + (self.n_heads, self.out_per_head)) if self.output_gate else None
        done = {}
        for n in self.apply_order:
            done[n] = self.roles[n](raw[n], self, n, done)
        return {n: done[n] for n in self.order}, gate, new_cache, tails

    def _conv_halo(self, c: torch.Tensor, cache, group):
        """(this rank's conv cache: the previous rank's last kernel - 1 conv inputs, rank 0's
        own cache; every rank's tail [W, B, C, kernel - 1], gathered differentiably so that the
        gradient reaches the rank that computed it). Every shard must hold kernel - 1 tokens:
        checked on every rank from the gathered lengths, so all raise alike."""
        import torch.distributed as dist      # lazy: torch.distributed only with a cp_group
        k = self.conv_size
        rank = dist.get_rank(group)
        # each rank's (T, B, dtype): the tails gathered below must agree in shape and dtype
        dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        mine = torch.tensor([c.shape[1], c.shape[0], dtypes.index(c.dtype) if c.dtype in dtypes else -1],
                            device=c.device)
        descs = [torch.zeros(3, dtype=torch.int64, device=c.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(descs, mine, group=group)
        lengths = [int(d[0]) for d in descs]
        for what, i, name in (("batch size B", 1, str), ("dtype", 2, lambda j: str(dtypes[j]) if j >= 0 else "?")):
            bad = [r for r, d in enumerate(descs) if int(d[i]) != int(descs[0][i])]
            if bad:
                raise ArgumentError(f"cp_group: the ranks disagree on the {what} of x: rank 0 has "
                                    f"{name(int(descs[0][i]))}, rank {bad[0]} has {name(int(descs[bad[0]][i]))}")
        short = [(r, int(n)) for r, n in enumerate(lengths) if int(n) < k - 1]
        if short:
            raise ValueError(f"cp_group: rank {short[0][0]}'s shard has {short[0][1]} tokens; the short conv "
                             f"(conv_size={k}) reads the previous {k - 1} tokens, so every shard needs at least {k - 1}")
        tails = _AllGather.apply(c[:, c.shape[1] - (k - 1):].transpose(1, 2), group)       # [W, B, C, k - 1]
        return (tails[rank - 1] if rank > 0 else cache), tails

    def _conv(self, c: torch.Tensor, cache):
        """Causal depthwise conv over [B, T, C], continuing from cache [B, C, kernel - 1]: a sum
        of kernel shifted products (torch's conv1d compiles a kernel per new shape on the CPU,
        seconds for float64, and a decoder meets a new shape at every prompt length)."""
        B, T, C = c.shape
        k = self.conv_size
        if cache is None:
            cache = c.new_zeros(B, C, k - 1)
        full = torch.cat([cache.to(c.dtype).transpose(1, 2), c], 1)           # [B, k - 1 + T, C]
        w = self.conv.weight[:, 0, :]                                           # [C, k]
        out = self.conv.bias + sum(full[:, j:j + T] * w[:, j] for j in range(k))
        return out, full[:, full.shape[1] - (k - 1):].transpose(1, 2)

    def _finish(self, o: torch.Tensor, gate, dtype: torch.dtype) -> torch.Tensor:
        """o [*lead, H, *out dims] -> norm, gate, output projection -> [*lead, d_model], in the
        layer input's dtype (mode="reference" computes and returns float64: the layer around it
        keeps the model's dtype; other dtypes, autocast's bf16 among them, pass as they are)."""
        if o.dtype == torch.float64 and dtype != torch.float64:
            o = o.to(dtype)
        lead = o.shape[:o.dim() - 1 - len(self.out_shape)]
        o = o.reshape(lead + (self.n_heads, self.out_per_head))
        if self.norm is not None:
            o = self.norm(o) if self.out_per_head > 1 else self.norm(o.squeeze(-1)).unsqueeze(-1)
        if gate is not None:
            o = o * F.silu(gate)
        return self.out_proj(o.reshape(lead + (self.n_heads * self.out_per_head,)))

    # ---------------------------------------------------------------- the two entry points
    def forward(self, x: torch.Tensor, state: dict | None = None, use_cache: bool = False, cp_group=None):
        """x [B, T, d_model] -> (y [B, T, d_model], state): training and prefill. state continues
        a sequence (from a previous forward or step); with use_cache=True the returned state
        continues it further, else it is None.

        cp_group (context parallelism, docs/distributed.md): x is this rank's contiguous shard
        of the sequence; state is the whole sequence's, read on rank 0; the returned state is
        the one at the end of this rank's shard. The short conv takes the previous rank's last
        conv_size - 1 tokens, the op its true initial state (op(..., cp_group=))."""
        extra = {"cp_group": cp_group} if cp_group is not None else {}
        inputs, gate, conv_cache, tails = self._project(x, (state or {}).get("conv"), cp_group)
        mixer_state = (state or {}).get("mixer")
        o, st = self.op(**inputs, **self.spec_params(), **self.options, initial_state=mixer_state,
                        output_final_state=use_cache, mode=self.mode, **self.op_kwargs, **extra)
        y = self._finish(o, gate, x.dtype)
        if tails is not None:       # the last rank uses no tail, rank 0 none: all join the backward's all-reduce
            y = _Tie.apply(y, tails)
        if not use_cache:
            return y, None
        return y, _state(st, conv_cache)

    def step(self, x: torch.Tensor, state: dict | None = None):
        """One token per sequence: x [B, d_model] and the state of the tokens before it (None: a
        fresh sequence) -> (y [B, d_model], the state after it)."""
        if state is None:
            state = self.init_state(x.shape[0], x)
        inputs, gate, conv_cache, _ = self._project(x, state.get("conv"))
        o, st = self.op.step(**inputs, **self.spec_params(), **self.options, state=state["mixer"], mode=self.mode)
        return self._finish(o, gate, x.dtype), _state(st, conv_cache)

    def init_state(self, batch: int, like: torch.Tensor | None = None) -> dict:
        """The state of an empty prefix: a forward over zero tokens, so the op decides its own
        state's form (zeros for a recurrence, an empty cache for attention)."""
        dev = like.device if like is not None else self.in_proj.weight.device
        dtype = like.dtype if like is not None else self.in_proj.weight.dtype
        _, st = self.forward(torch.zeros(batch, 0, self.d_model, device=dev, dtype=dtype), use_cache=True)
        return st

    def state_size(self, state: dict) -> int:
        """Floats per sequence that the mixer's state holds (the conv cache not counted; nor a
        KV cache's position counter, which is [N])."""
        return sum(v[0].numel() for v in state["mixer"].values() if torch.is_tensor(v) and v.dim() >= 2)

    def extra_repr(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        conv = self.conv_size if self.conv is not None else 0
        return (f"spec={self.spec}, d_model={self.d_model}, n_heads={self.n_heads}, {dims}, conv={conv}, "
                f"gate={self.output_gate}, mode={self.mode!r}")


def _state(mixer_state, conv_cache) -> dict:
    st = {"mixer": mixer_state}
    if conv_cache is not None:
        st["conv"] = conv_cache
    return st


def _needs_order(names: list[str], roles: dict) -> list[str]:
    """names with every role after the inputs it needs (a role needing an input the spec lacks
    is an error: the table pairs it with its spec)."""
    out, seen = [], set()

    def visit(n, path=()):
        if n in seen:
            return
        if n in path:
            raise ValueError(f"input roles need each other in a cycle: {' -> '.join(path + (n,))}")
        for m in roles[n].needs:
            if m not in roles:
                raise ValueError(f"the role of input '{n}' needs input '{m}', which the spec does not declare")
            visit(m, path + (n,))
        seen.add(n)
        out.append(n)
    for n in names:
        visit(n)
    return out

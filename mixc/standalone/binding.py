"""Binding a call's arguments: -> bound sizes and checked tensors, with errors that name the
argument. The one binder of mixc.load's op (runtime/signature.py re-exports it) and of the
modules `mixc compile -o DIR` writes (support.py, from their copy of this package): it imports
torch and errors.py only, so a compiled module binds its calls with this same code without the
compiler (no mixc.dsl, which loads lark). `bind` reads the spec's signature by duck typing: a
MixerIR, or a Signature that support.py builds from a compiled module's METADATA.

Layout (fla's): inputs [B, T, H, *dims] (a scalar per head is [B, T, H]), params [H, *dims],
states [B, H, *state dims] (N sequences instead of B with cu_seqlens). Grouped heads: an input
may have H_x heads, H_x dividing H (the most of any input's), head h reading its head
h // (H / H_x) (fla's GVA, Mamba-2's ngroups); Bound.groups says which.

Dtypes: every tensor is floating point (float16, bfloat16, float32 or float64); inputs and
params may mix them. Each is read in its own dtype, the output takes the first input's dtype
and every gradient its tensor's dtype; the kernels compute in float32, the torch backend in
float32 (float64 when every input is float64), the reference in float64.
Devices: inputs, params and states on one device; cu_seqlens on that device or the CPU (its
offsets are read on the host to check them, on every call: runtime/fastpath.py). Strides are
free: the kernels read contiguous copies."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from .errors import ArgumentError


def _fmt(names, sizes=None) -> str:
    if sizes is None:
        return "[" + ", ".join(names) + "]"
    return "[" + ", ".join(f"{n}={s}" if not n.isdigit() else str(s) for n, s in zip(names, sizes)) + "]"


@dataclass(frozen=True)
class Bound:
    B: int
    T: int
    H: int
    sizes: dict[str, int]
    inputs: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    options: dict[str, float]
    flags: dict[str, bool]
    initial_state: dict[str, torch.Tensor] | None
    cu_seqlens: torch.Tensor | None
    # grouped heads: input -> heads sharing each of its heads (H / its heads), for the inputs
    # given with fewer than H heads; head h reads its head h // groups[x]
    groups: dict[str, int] = field(default_factory=dict)

    @property
    def n_seqs(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    def expanded(self, axis: int = 2) -> "Bound":
        """The same call with every grouped input repeated to H heads (an index: autograd sums
        each group's gradient into its shared head). The torch backend, the reference, the
        convolution form take this; the kernels read the shared head in place. axis: the heads'
        axis (1 for a step's inputs [B, H, *dims])."""
        if not self.groups:
            return self
        inputs = {k: expand_heads(x, self.groups[k], axis) if k in self.groups else x
                  for k, x in self.inputs.items()}
        return replace(self, inputs=inputs, groups={})


def expand_heads(x: torch.Tensor, group: int, axis: int = 2) -> torch.Tensor:
    """x with each head repeated `group` times along `axis` (head h of the result is head
    h // group of x: fla's GVA order, transformers' repeat_interleave, Mamba-2's ngroups)."""
    if group == 1:
        return x
    index = torch.arange(x.shape[axis] * group, device=x.device) // group
    return x.index_select(axis, index)


def head_groups(H: int, inputs: dict, axis: int = 2) -> dict[str, int]:
    """input -> H / its heads, for the inputs with fewer than H heads (shapes already checked)."""
    return {k: H // x.shape[axis] for k, x in inputs.items() if x.shape[axis] != H}


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(names, sizes) -> str:
    """An expected shape with the sizes bound so far: [B=2, T=5, H=3, K]."""
    return "[" + ", ".join(f"{n}={sizes[n][0]}" if n in sizes else n for n in names) + "]"


def _check_tensor(name: str, x, expected_names, sizes, what: str, devices: dict, hint: str = "",
                  free: tuple[str, ...] = ()) -> None:
    """dtype, rank, dim sizes against those bound so far (sizes: dim -> (size, source)), and
    the device against the first tensor's (devices: {"device": (device, source)}). free: dims
    not checked here (an input's heads: _bind_heads)."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{name}: expected a tensor of shape {_fmt(expected_names)}, got {type(x).__name__}")
    if x.is_nested or x.layout != torch.strided:
        kind, fix = (("a nested tensor", "pack sequences of different lengths along T and pass cu_seqlens")
                     if x.is_nested else (f"layout {x.layout}", "call .to_dense() first"))
        raise ArgumentError(f"{name}: expected a dense (strided) tensor of shape {_fmt(expected_names)}, got {kind}; "
                            f"{fix}")
    if x.dtype not in FLOAT_DTYPES:
        raise ArgumentError(f"{name}: expected a floating-point tensor (float16, bfloat16, float32 or "
                            f"float64), got dtype {x.dtype}")
    if x.dim() != len(expected_names):
        raise ArgumentError(f"{name}: {what} of shape {_fmt(expected_names)} (rank {len(expected_names)}), "
                            f"got shape {list(x.shape)} (rank {x.dim()}){hint}")
    for axis, (dim, size) in enumerate(zip(expected_names, x.shape)):
        if dim in sizes and sizes[dim][0] != size and dim not in free:
            have, src = sizes[dim]
            raise ArgumentError(f"{name}: dim {dim} (axis {axis}) is {size}, but {src} gives {dim} = {have}; "
                                f"expected shape {_shape(expected_names, sizes)}, got {list(x.shape)}")
        sizes.setdefault(dim, (size, name))
    _check_device(name, x, devices)


def _check_device(name: str, x: torch.Tensor, devices: dict) -> None:
    have, src = devices.setdefault("device", (x.device, name))
    if x.device != have:
        raise ArgumentError(f"{name}: on device {x.device}, but {src} is on {have}; "
                            "inputs, params and states must be on one device")


def bind(mixer, kwargs: dict, *, step: bool = False) -> Bound:
    """Check a call's keyword arguments against the spec and bind every size.

    step=True: per-token inputs have no T axis ([B, H, *dims])."""
    kwargs = dict(kwargs)
    initial_state = kwargs.pop("initial_state", None)
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    sizes: dict[str, tuple[int, str]] = {}
    devices: dict[str, tuple[torch.device, str]] = {}
    inputs, params, options, flags = {}, {}, {}, {}
    lead = ("B", "H") if step else ("B", "T", "H")
    # an input of the sequence's rank given to step(): say what step() wants
    hint = "; step() takes one token per sequence, without the T axis" if step else ""
    # each input's heads bind its own name (grouped heads): H is the most of any input, and
    # every input's heads must divide it
    head = len(lead) - 1
    for d in mixer.dims:        # `dims E = 2`: the spec fixes the size, every tensor must agree
        fixed = fixed_size(mixer, d.name)
        if fixed is not None:
            sizes[d.name] = (fixed, f"the spec (dims {mixer.root_dim(d.name)} = {fixed})")
    for decl in mixer.inputs:
        if decl.name not in kwargs:
            raise ArgumentError(f"missing input '{decl.name}' of shape {_fmt(lead + decl.shape)}")
        x = kwargs.pop(decl.name)
        _check_tensor(decl.name, x, lead + decl.shape, sizes, "expected an input", devices,
                      hint if isinstance(x, torch.Tensor) and x.dim() == len(lead) + len(decl.shape) + 1 else "",
                      free=("H",))
        inputs[decl.name] = x
    _bind_heads(inputs, head, sizes)
    consts = {c.name: c for c in getattr(mixer, "consts", ())}     # `const W[E] = [...]`: the spec's values
    for name in consts:
        if name in kwargs:
            raise ArgumentError(f"{name}: not an argument; '{name}' is a const of mixer '{mixer.name}' (its values "
                                "are fixed by the spec); remove it from the call")
    for decl in mixer.params:
        if decl.name in consts:
            continue
        if decl.name not in kwargs:
            raise ArgumentError(f"missing param '{decl.name}' of shape {_fmt(('H',) + decl.shape)}")
        x = kwargs.pop(decl.name)
        names = ("H",) + decl.shape
        if decl.shape[:1] == ("T",):
            # one value (or row) per position: at least as long as the call's positions, which the
            # sequence runtime checks and slices (runtime/sequence.py); its T axes bind nothing here
            if isinstance(x, torch.Tensor) and x.dim() != len(names):
                raise ArgumentError(f"{decl.name}: expected a per-position param of shape {_fmt(names)} (rank "
                                    f"{len(names)}), got shape {list(x.shape)} (rank {x.dim()})")
            names = tuple(f"{decl.name}:T{i}" if d == "T" else d for i, d in enumerate(names))
        _check_tensor(decl.name, x, names, sizes, "expected a per-head param", devices)
        params[decl.name] = x
    if consts:
        params = _with_consts(mixer, params, consts, inputs, sizes, devices)
    for opt in mixer.options:
        if opt.name in kwargs:
            v = kwargs.pop(opt.name)
            if v is None:
                continue
            if opt.kind == "bool":
                if not isinstance(v, bool):
                    raise ArgumentError(f"{opt.name}: expected True or False, got {v!r}")
                flags[opt.name] = v
            else:
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    if torch.compiler.is_compiling():   # float(v) is a data-dependent guard: no graph
                        raise ArgumentError(f"{opt.name}: a tensor under torch.compile, but number options are "
                                            "constants of the call (read as a float); pass a Python float")
                    v = float(v)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ArgumentError(f"{opt.name}: expected a number, got {v!r}")
                try:
                    v = float(v)
                except OverflowError:           # an int past float64's range
                    v = math.inf
                if not math.isfinite(v):        # every use of an option would be inf or NaN
                    raise ArgumentError(f"{opt.name}: expected a finite number, got {v!r}")
                options[opt.name] = v
    if "cp_group" in kwargs:     # taken by op() of a recurrence before binding; anywhere else say why not
        why = ("step() takes one token per sequence: context parallelism shards a whole sequence, "
               "op(..., cp_group=group)" if step else
               f"mixer '{mixer.name}' mixes with conv, mix or attend, which have no summary of a shard to pass "
               "between ranks (attention over shards would need ring attention); only recurrences take it")
        raise ArgumentError(f"cp_group: not accepted here; {why}")
    if kwargs:
        extra = sorted(kwargs)
        known = [d.name for d in (*mixer.inputs, *mixer.params) if d.name not in consts] + [o.name for o in mixer.options]
        known += ["state"] if step else ["initial_state", "output_final_state", "cu_seqlens"]
        raise ArgumentError(f"unexpected argument{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} "
                            f"for {'step() of ' if step else ''}mixer '{mixer.name}'; it takes {', '.join(known)}")
    for d in mixer.dims:
        root = mixer.root_dim(d.name)
        if d.name not in sizes and root in sizes:
            sizes[d.name] = (sizes[root][0], f"dim {root}")
    for d in mixer.dims:
        if d.alias_of and sizes[d.name][0] != sizes[mixer.root_dim(d.name)][0]:
            raise ArgumentError(f"dim {d.name} = {d.alias_of}, but {sizes[d.name][1]} gives {d.name} = "
                                f"{sizes[d.name][0]} and {d.alias_of} = {sizes[mixer.root_dim(d.name)][0]}")
    B = sizes["B"][0]
    T = 1 if step else sizes["T"][0]
    H = sizes["H"][0]
    if cu_seqlens is not None:
        if step:
            raise ArgumentError("cu_seqlens: not accepted by step(); pass one token per sequence")
        cu_seqlens = _check_cu_seqlens(cu_seqlens, B, T, devices["device"])
    n = B if cu_seqlens is None else len(cu_seqlens) - 1
    if mixer.is_sequence:           # the state is a cache of the past: runtime/sequence.py checks it
        state = initial_state
    else:
        state = _check_state(mixer, initial_state, n, H, {k: v[0] for k, v in sizes.items()},
                             packed=cu_seqlens is not None, devices=devices,
                             arg="state" if step else "initial_state")
    return Bound(B, T, H, {k: v[0] for k, v in sizes.items() if k not in ("B", "T", "H") and ":" not in k},
                 inputs, params, options, flags, state, cu_seqlens, head_groups(H, inputs, head))


def _with_consts(mixer, params: dict, consts: dict, inputs: dict, sizes: dict, devices: dict) -> dict:
    """params with each const's tensor, in the spec's order of params: its values (numbers the
    checker evaluated) on the call's device, the same for every head ([H, *shape], a view).
    float64 where an input or param is (the reference's and the torch backend's precision),
    else float32 (the kernels' compute type)."""
    given = (*inputs.values(), *params.values())
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in given) else torch.float32
    device = devices["device"][0] if "device" in devices else torch.device("cpu")
    H = sizes["H"][0] if "H" in sizes else 1
    out = {}
    for decl in mixer.params:
        c = consts.get(decl.name)
        if c is None:
            out[decl.name] = params[decl.name]
            continue
        shape = tuple(fixed_size(mixer, d) for d in c.shape)     # a const's dims are all fixed
        value = torch.tensor(c.values, dtype=dtype, device=device).reshape(shape)
        out[decl.name] = value.expand((H,) + shape)
    return out


def fixed_size(mixer, name: str) -> int | None:
    """The size a spec fixes for dim `name` (`dims E = 2`, or an alias of such a dim), else None."""
    root = mixer.root_dim(name)
    return next((getattr(d, "size", None) for d in mixer.dims if d.name == root), None)


def _bind_heads(inputs: dict, axis: int, sizes: dict) -> None:
    """H = the most heads of any input (the first with that many names it); an input with fewer
    is grouped: its heads must divide H, and head h reads its head h // (H / its heads)."""
    if not inputs:
        return
    src, H = None, -1
    for k, x in inputs.items():         # a plain loop: torch.compile traces no max(key=)
        if x.shape[axis] > H:
            src, H = k, x.shape[axis]
    for k, x in inputs.items():
        n = x.shape[axis]
        if (n == 0 and H > 0) or (n > 0 and H % n):
            raise ArgumentError(
                f"{k}: has {n} heads (axis {axis}), which do not divide H = {H} ({src}'s heads); an input "
                f"shared by groups of heads has H / group heads, head h reading its head h // group "
                f"(fla's GVA, Mamba-2's ngroups), got shape {list(x.shape)}")
    sizes["H"] = (H, src)


def _check_cu_seqlens(cu, B: int, T: int, device: tuple[torch.device, str]) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # no host read while torch.compile traces (a data-dependent guard: no graph); the kernels'
        # custom op checks the values when it runs (runtime/custom_op.py), the torch modes refuse
        _cu_seqlens_kind(cu, B, device)
        return cu
    cu_seqlens_values(cu, B, T, device)
    return cu


def _cu_seqlens_kind(cu, B: int, device: tuple[torch.device, str]) -> None:
    """What can be checked of the offsets without reading them: kind, dtype, rank, device, B."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
        got = f"dtype {cu.dtype}, shape {list(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ArgumentError(f"cu_seqlens: expected a 1-D int32 or int64 tensor of sequence offsets, got {got}")
    where = "the CPU" if device[0].type == "cpu" else f"{device[0]} or the CPU"
    if cu.device.type == "meta":
        raise ArgumentError(f"cu_seqlens: on device meta, which holds no offsets to check; pass it on {where}")
    if cu.device.type != "cpu" and cu.device != device[0]:
        raise ArgumentError(f"cu_seqlens: on device {cu.device}, but {device[1]} is on {device[0]}; "
                            f"pass it on {where}")
    if B != 1:
        raise ArgumentError(f"cu_seqlens: packed sequences need B = 1 (the batch is the packing), got B = {B}")


def cu_seqlens_values(cu, B: int, T: int, device: tuple[torch.device, str]) -> list[int]:
    """The offsets of a packed call, checked: a 1-D int tensor on the inputs' device or the
    CPU, B = 1, from 0 to T, non-decreasing (what keeps every kernel's reads and writes inside
    [0, T)). device: (the inputs' device, the argument that gives it). Reads the values on the
    host (on CUDA a sync: see runtime/fastpath.py for why every call pays it)."""
    _cu_seqlens_kind(cu, B, device)
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != T:
        raise ArgumentError(f"cu_seqlens: must start at 0 and end at T = {T}, got {values[:4]}"
                            f"{'...' if len(values) > 4 else ''}{values[-1:] if len(values) > 4 else ''}")
    for i, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            raise ArgumentError(f"cu_seqlens: offsets must be non-decreasing, got {a} then {b} "
                                f"(cu_seqlens[{i}] > cu_seqlens[{i + 1}])")
    return values


def _check_state(mixer, initial_state, n: int, H: int, sizes,
                 packed: bool, devices: dict, arg: str = "initial_state") -> dict[str, torch.Tensor] | None:
    """States are [B, H, *dims], or [N, H, *dims] for N packed sequences. arg: the argument's
    name in messages (step() calls it state)."""
    if initial_state is None:
        return None
    if isinstance(initial_state, torch.Tensor):
        if len(mixer.states) != 1:
            names = ", ".join(s.name for s in mixer.states)
            raise ArgumentError(f"{arg}: mixer '{mixer.name}' has several states ({names}); pass a dict")
        initial_state = {mixer.states[0].name: initial_state}
    if not isinstance(initial_state, dict):
        raise ArgumentError(f"{arg}: expected a dict keyed by state name, got {type(initial_state).__name__}")
    out = {}
    names = [s.name for s in mixer.states]
    for key in initial_state:
        if key not in names:
            raise ArgumentError(f"{arg}: unknown state '{key}'; mixer '{mixer.name}' has {', '.join(names)}")
    for decl in mixer.states:
        if decl.name not in initial_state:
            lead = "N" if packed else "B"
            raise ArgumentError(f"{arg}: missing state '{decl.name}' "
                                f"(expected [{lead}, H, {', '.join(decl.shape)}])")
        x = initial_state[decl.name]
        want = (n, H) + tuple(sizes[d] for d in decl.shape)
        label = ("N" if packed else "B", "H") + decl.shape
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ArgumentError(f"{arg}['{decl.name}']: expected shape {_fmt(label, want)}, got {got}")
        if x.dtype not in FLOAT_DTYPES:
            raise ArgumentError(f"{arg}['{decl.name}']: expected a floating-point tensor (float16, "
                                f"bfloat16, float32 or float64), got dtype {x.dtype}")
        _check_device(f"{arg}['{decl.name}']", x, devices)
        out[decl.name] = x
    return out




# ---- the call's other arguments, checked alike by mixc.load's op and a compiled module ----

def check_flag_argument(name: str, value) -> None:
    """A yes/no argument must be a bool: "no" or a tensor would be taken as true."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")


def clamp_chunk(chunk: int | None, T: int, kernel: bool) -> int | None:
    """A chunk past the sequence computes what one of T tokens does (the kernels': the power of
    two >= T, at least 16), so it is clamped there: chunk=10**6 at T = 8 allocated 62.5 GB in
    the torch backend, and 2**20 passed Triton's block limit (issue 30)."""
    if chunk is None:
        return None
    if not kernel:
        return min(chunk, max(T, 1))
    return min(chunk, max(16, 1 << max(T - 1, 0).bit_length()))


def clamp_ck(CK: int, T: int) -> int:
    """The recurrent backward's tokens per checkpoint, at most T: past it one checkpoint per
    sequence holds all (CK = 2**40 sized a 281 TB scratch buffer, issue 30)."""
    return min(CK, max(T, 1))


def check_chunking(mode, CK, chunk) -> None:
    """CK (tokens per backward checkpoint of the recurrent kernels) a positive int; chunk (the
    chunked form's C) None, or a power of two >= 16 for the kernels (a matmul block; Triton's
    aranges are powers of two), any positive int for the torch backend."""
    if isinstance(CK, bool) or not isinstance(CK, int) or CK < 1:
        raise ArgumentError(f"CK: expected a positive int (tokens per backward checkpoint), got {CK!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
                              or (mode != "torch" and (chunk < 16 or chunk & (chunk - 1)))):
        want = "a positive int" if mode == "torch" else "a power of two >= 16 (a matmul block)"
        raise ArgumentError(f"chunk: expected {want}, got {chunk!r}")


# ---- a spec's signature without the spec language (a compiled module's METADATA) ----

class Decl(NamedTuple):
    name: str
    shape: tuple


class OptionDecl(NamedTuple):
    name: str
    kind: str             # "float" (a number) or "bool" (a flag)


class Shifted(NamedTuple):
    name: str
    source: str


class ConstDecl(NamedTuple):
    name: str
    shape: tuple
    values: tuple


class DimDecl(NamedTuple):
    name: str
    alias_of: str | None
    size: int | None = None


class Signature:
    """What bind() reads of a MixerIR (names, shapes, option kinds, dim aliases), built from a
    compiled module's METADATA: the compiled module binds with the same code as mixc.load."""

    def __init__(self, meta: dict):
        self.name = meta["mixer"]
        # METADATA of mixc >= this change carries the options in the spec's order with their
        # kinds and each dim's alias; an older module's is rebuilt from what it has
        kinds = meta.get("option_kinds") or {**{o: "float" for o in meta["options"]},
                                            **{f: "bool" for f in meta["flags"]}}
        aliases = meta.get("dim_aliases") or meta["dim_roots"]
        fixed = meta.get("dim_sizes", {})
        self.dims = tuple(DimDecl(d, aliases.get(d), fixed.get(d)) for d in meta["dims"])
        self.inputs = tuple(Decl(k, tuple(v)) for k, v in meta["inputs"].items())
        self.params = tuple(Decl(k, tuple(v)) for k, v in meta["params"].items())
        self.options = tuple(OptionDecl(k, v) for k, v in kinds.items())
        self.states = tuple(Decl(k, tuple(v)) for k, v in meta["states"].items())
        # prev(x) of inputs (derived input, its source); an older module's METADATA has none
        self.shifted = tuple(Shifted(k, v) for k, v in meta.get("shifted", {}).items())
        # const W[E] = [...]: name -> its shape and values (numbers); an older module's has none
        self.consts = tuple(ConstDecl(k, tuple(v["shape"]), tuple(float(x) for x in v["values"]))
                            for k, v in meta.get("consts", {}).items())
        self._aliases = {d.name: d.alias_of for d in self.dims}

    @property
    def is_sequence(self) -> bool:
        return not self.states

    def root_dim(self, name: str) -> str:
        alias = self._aliases.get(name)
        return self.root_dim(alias) if alias else name

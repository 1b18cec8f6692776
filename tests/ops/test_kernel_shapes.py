"""The kernels over the shapes the issue names (T in {1, 17, 64, 130}; K, V in {16, 32, 48}),
strong decay, and prefill-then-decode agreement."""
import pytest
import torch
import torch.nn.functional as F

import mixc
from mixc.derive.layout import tile_dim

from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference

SHAPES = [(1, 16, 16), (17, 32, 16), (64, 16, 48), (130, 48, 32)]        # (T, K, V): every value of each
SPECS = [("simple_gla", "chunk"), ("gla", "chunk"), ("linear_attn", "chunk"), ("gla", "recurrent"),
         ("gated_delta_rule", "chunk"), ("rwkv7", "chunk")]


def _shape_cases():
    """Every (spec, shape) pair; the recurrent kernel's two longest shapes (7 s each in the
    interpreter) behind -m slow, like the full grid."""
    for n, m in SPECS:
        for t, k, v in SHAPES:
            marks = [pytest.mark.slow] if m == "recurrent" and t >= 64 else []
            yield pytest.param(n, m, t, k, v, marks=marks, id=f"{case_id(B=1, T=t, H=2, K=k, V=v)}-{n}-{m}")


@pytest.mark.parametrize("name,mode,T,K,V", list(_shape_cases()))
def test_shapes(name, mode, T, K, V):
    op = mixc.load(name)
    flags = {"use_qk_l2norm_in_kernel": True} if "delta" in name else {}      # fla's use: unit keys
    args, sizes = random_args(op.ir, B=1, T=T, H=2, sizes={"K": K, "V": V}, dtype=torch.float32,
                              requires_grad=True, seed=T + K, draw=_bounded(name))
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32, mode=mode, CK=16)


def _bounded(name):
    """RWKV-7's update S (diag(w) + b a^T): with a = -k~ and b = k~ * gate as fla's model makes
    them (k~ unit), the transition is a contraction; random a, b would blow up over 130 tokens."""
    if name != "rwkv7":
        return None

    def unit(shape, gen):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True)
    return {"a": lambda shape, gen: -unit(shape, torch.Generator().manual_seed(5)),
            "b": lambda shape, gen: unit(shape, torch.Generator().manual_seed(5)) * torch.rand(shape, generator=gen,
                                                                                               dtype=torch.float64)}


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", SPECS, ids=[f"{n}-{m}" for n, m in SPECS])
@pytest.mark.parametrize("T", [1, 17, 64, 130])
@pytest.mark.parametrize("K,V", [(k, v) for k in (16, 32, 48) for v in (16, 32, 48)])
def test_shapes_full_grid(name, mode, T, K, V):
    test_shapes(name, mode, T, K, V)


# -20 per token in the default run; -8 (and the recurrent kernel, which multiplies decays
# per token and forms no exponent differences) behind -m slow
@pytest.mark.parametrize("log_decay", [pytest.param(-8.0, marks=pytest.mark.slow), -20.0])
@pytest.mark.parametrize("name,mode", [("gla", "chunk"), ("simple_gla", "chunk"), ("rwkv6", "chunk"),
                                       ("hgrn", "chunk"), pytest.param("gla", "recurrent", marks=pytest.mark.slow),
                                       ("gated_delta_rule", "chunk"), ("rwkv7", "chunk")])
def test_strong_decay_no_nan(name, mode, log_decay):
    """A log decay of -8 and -20 per token: the chunked form forms only exponents <= 0."""
    op = mixc.load(name)
    gate = {"gla": "g", "simple_gla": "g", "rwkv6": "w", "hgrn": "g", "gated_delta_rule": "g", "rwkv7": "w"}[name]

    def strong(shape, gen):
        return log_decay + 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)

    from helpers import random_args as draw_args
    args, sizes = draw_args(op.ir, B=2, T=40, H=2, sizes={"K": 16, "V": 16, "D": 16}, dtype=torch.float32,
                            requires_grad=True, seed=9, draw={gate: strong} | (_bounded(name) or {}))
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    o, fin = op(**args, initial_state=st, output_final_state=True, mode=mode)
    assert torch.isfinite(o).all() and all(torch.isfinite(v).all() for v in fin.values())
    grads = torch.autograd.grad(o.sum() + sum(v.sum() for v in fin.values()), list(args.values()))
    assert all(torch.isfinite(g).all() for g in grads)
    check_against_reference(op, {}, args, st, torch.float32, mode=mode, CK=16)


@pytest.mark.parametrize("name", ["gla", "mamba2", "rwkv6", "based", "mlstm", "gated_delta_rule", "rwkv7"])
def test_prefill_chunked_then_decode(name):
    """Prefill with the chunked form, then decode token by token with step: equals one pass."""
    op = mixc.load(name)
    B, T, P, H = 2, 23, 17, 2
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={d.name: 5 + i for i, d in enumerate(op.ir.dims)},
                              dtype=torch.float32, seed=13)
    names = {d.name for d in op.ir.inputs}
    full, full_st = op(**args, output_final_state=True, mode="reference")
    pre = {k: (v[:, :P] if k in names else v) for k, v in args.items()}
    o, st = op(**pre, output_final_state=True, mode="chunk")
    outs = [o]
    for t in range(P, T):
        o_t, st = op.step(**{k: (v[:, t] if k in names else v) for k, v in args.items()}, state=st)
        outs.append(o_t[:, None])
    torch.testing.assert_close(torch.cat(outs, 1).double(), full, rtol=1e-4, atol=1e-4)
    for k in full_st:
        torch.testing.assert_close(st[k].double(), full_st[k], rtol=1e-4, atol=1e-4)


TILED = [("gla", {}), ("mamba", {}), ("delta_rule", {}), ("linear_attn", {"normalize": True}), ("mlstm", {}),
         ("rwkv7", {})]


@pytest.mark.parametrize("name,flags", TILED, ids=[n + "".join(f"-{k}" for k in f) for n, f in TILED])
def test_recurrent_kernels_split_the_tile_dim(name, flags, monkeypatch):
    """Blocks of 4 along the tile dim (V, or Mamba's P): several programs per (sequence, head);
    what lacks the tile dim (q, k, z[K], mlstm's n[K], Mamba's B and C) gets its gradient as a
    sum of per-tile partials, and a final-state gradient of a state without it enters once."""
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "RECURRENT_TILE", 4)
    op = mixc.load(name)
    tile = tile_dim(op.plan(**flags).kernel_ir)
    assert tile is not None
    sizes = {d.name: 5 + 2 * i for i, d in enumerate(op.ir.dims) if not d.alias_of}
    assert sizes[tile] > 4                                     # two blocks at least
    args, sizes = random_args(op.ir, B=2, T=9, H=2, sizes=sizes, dtype=torch.float32, requires_grad=True, seed=6)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32, mode="recurrent", CK=4)


# Mamba's N and gla's K in the default run; the other three (same code path) behind -m slow
SPLIT = [pytest.param(n, d, id=n, marks=[] if n in ("mamba", "gla") else [pytest.mark.slow])
         for n, d in (("mamba", "N"), ("mamba2", "N"), ("s4d", "N"), ("gla", "K"), ("retention", "K"))]


@pytest.mark.parametrize("name,dim", SPLIT)
def test_recurrent_kernels_split_the_contracted_dim(name, dim, monkeypatch):
    """Blocks of 4 along the split dim (Mamba's N, the key dim K) and of 4 along the tile dim:
    each program's output is a partial (block j > 0 subtracts the state-free part D * x),
    summed on the host; what lacks the split dim (x, dt, D, v) gets its gradient as a sum of
    per-block partials."""
    from mixc.derive.layout import split_dim
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "RECURRENT_TILE", 4)
    monkeypatch.setattr(launch, "RECURRENT_SPLIT", 4)
    op = mixc.load(name)
    assert split_dim(op.plan()) == dim
    sizes = {d.name: 5 + 2 * i for i, d in enumerate(op.ir.dims) if not d.alias_of} | {dim: 10}
    # three blocks of the split dim, the last one partial
    args, sizes = random_args(op.ir, B=2, T=9, H=2, sizes=sizes, dtype=torch.float32, requires_grad=True, seed=8)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="recurrent", CK=4)


def test_split_recurrent_kernels_with_varlen_and_step(monkeypatch):
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "RECURRENT_TILE", 4)
    monkeypatch.setattr(launch, "RECURRENT_SPLIT", 4)
    op = mixc.load("mamba")
    args, sizes = random_args(op.ir, B=1, T=12, H=2, sizes={"N": 10, "P": 9}, dtype=torch.float32,
                              requires_grad=True, seed=4)
    st = random_state(op.ir, 3, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="recurrent", CK=4,
                            cu_seqlens=torch.tensor([0, 5, 5, 12]))
    one = {k: (v.detach()[:, 0] if k in {d.name for d in op.ir.inputs} else v.detach()) for k, v in args.items()}
    init = {k: v.detach()[:1] for k, v in st.items()}
    o, new = op.step(**one, state=init, mode="recurrent")
    want, want_st = op.reference_step(**one, state=init)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new["S"].double(), want_st["S"], rtol=1e-5, atol=1e-5)


def test_no_split_dim_where_a_contraction_keeps_a_state_free_part():
    """r @ (S + u k v) (rwkv6's bonus) would count r @ (u k v) per block: K is not split; nor is
    anything split under a normalized readout or a stabilizer."""
    from mixc.derive.layout import split_dim
    for name in ("rwkv6", "linear_transformer", "mlstm", "delta_rule"):
        assert split_dim(mixc.load(name).plan()) is None, name


CHUNK_TILED = [("gla", {}), ("simple_gla", {}), ("delta_rule", {}), ("rwkv7", {}), ("mamba2", {}),
               ("mlstm", {}), ("linear_attn", {"normalize": True}), ("hgrn", {})]


# two launches (the CUDA default) for all but rwkv7 (the rank-1 class: delta_rule; 12 s in the
# interpreter); the walk for a key-decay spec and a normalizer (dq/dk partials, z's partial dS0).
# gla's two launches behind -m slow (23 s): test_tiled_chunked_kernels_with_varlen[gla] runs them
# tiled, packed
TILED_PHASES = ([(n, f, 2) for n, f in CHUNK_TILED if n != "rwkv7"]
                + [(n, f, 1) for n, f in CHUNK_TILED if n in ("gla", "linear_attn")])


@pytest.mark.parametrize("name,flags,phases", [
    pytest.param(n, f, p, marks=[pytest.mark.slow] if (n, p) == ("gla", 2) else [],
                 id=n + "".join(f"-{k}" for k in f) + ("-phases" if p == 2 else "-walk")) for n, f, p in TILED_PHASES])
def test_chunked_kernels_split_the_tile_dim(name, flags, phases, monkeypatch):
    """Blocks of 16 along the tile dim (V, Mamba-2's P, HGRN's D) in the chunked forward and
    backward: three programs per (sequence, head), the last block partial; each writes its
    slice of the output, the final state and the checkpoints, and in the backward its slice of
    what has the tile dim and its partial of what lacks it (dq, dk, the decays, the params,
    a normalizer's initial state). In two launches per direction, a state without the tile dim
    keeps one dL/dS per block at each chunk's end."""
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    op = mixc.load(name)
    tile = tile_dim(op.plan(**flags).kernel_ir)
    sizes = {d.name: 6 for d in op.ir.dims if not d.alias_of} | {tile: 40}
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes=sizes, dtype=torch.float32, requires_grad=True, seed=9)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32, mode="chunk", chunk=16)


@pytest.mark.parametrize("name", ["gla", "mamba2", "linear_attn"])
def test_tiled_chunked_kernels_with_varlen(name, monkeypatch):
    """Packed sequences through the tiled chunked kernels: the partials of dq, dk and the params
    are laid out per token of the packed batch (B = 1, T = all tokens); in two launches per
    direction, the params' per chunk slot."""
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load(name)
    flags = {"normalize": True} if name == "linear_attn" else {}
    tile = tile_dim(op.plan(**flags).kernel_ir)
    sizes = {d.name: 5 for d in op.ir.dims if not d.alias_of} | {tile: 33}
    args, sizes = random_args(op.ir, B=1, T=23, H=2, sizes=sizes, dtype=torch.float32, requires_grad=True, seed=4)
    st = random_state(op.ir, 3, 2, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32, mode="chunk", chunk=16,
                            cu_seqlens=torch.tensor([0, 9, 9, 23]))


def test_tiled_recurrent_kernels_with_varlen(monkeypatch):
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "RECURRENT_TILE", 4)
    op = mixc.load("mamba")
    args, sizes = random_args(op.ir, B=1, T=12, H=2, sizes={"N": 5, "P": 9}, dtype=torch.float32, requires_grad=True,
                              seed=3)
    st = random_state(op.ir, 3, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="recurrent", CK=4,
                            cu_seqlens=torch.tensor([0, 5, 5, 12]))


# a chunked spec with a param over the tile dim (V): its tiles kernel keeps one program per block
PARAM_OVER_TILE = """
mixer gated_skip
  dims   K, V
  input  q[K], k[K], v[V], g[]
  param  D[V]
  state  S[K, V]
  update S = exp(g) * S + k * v
  output o = q @ S + D * v
"""


@pytest.mark.parametrize("text,name", [(PARAM_OVER_TILE, "gated_skip"), (None, "simple_gla")],
                         ids=["param-over-tile", "simple_gla"])
def test_chunked_backward_loops_over_the_tile_blocks(text, name, monkeypatch):
    """The chunked backward's tiles kernel: one program per (chunk, head) loops over the tile
    dim's blocks and sums dq, dk, dg in registers (LaunchPlan.tile_loop), so the gradients come
    out of the kernel in the inputs' dtype with no float32 partials for torch to sum; a spec
    with a param over the tile dim keeps one program per block (its param loaded per program),
    and both agree with the reference."""
    import mixc.runtime.launch as launch
    from mixc.pipeline import from_text
    from mixc.standalone.launcher import Launcher
    monkeypatch.setattr(launch, "CHUNK_TILE", 16)
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = from_text(text, f"{name}.mix") if text else mixc.load(name)
    assert launch.plan_of(op.plan()).tile_loop is (text is None)
    grids = []
    real = Launcher.backward

    def spy(*a, **kw):
        grids.append((kw["launch"]["stage"], kw.get("tile_programs")))
        return real(*a, **kw)
    monkeypatch.setattr(Launcher, "backward", spy)
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes={"K": 8, "V": 40}, dtype=torch.float32,
                              requires_grad=True, seed=11)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16)
    assert ("tiles", 1 if text is None else None) in grids and ("walk", None) in grids

"""The library spec titans (Behrouz et al. 2024, "Titans: Learning to Memorize at Test Time"):
a linear memory with momentum, two coupled states, against a float64 loop written here from the
paper (not from mixc's reference):

  S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; x_t),   l(M; x) = ||k_t @ M - v_t||^2 / 2
  M_t = (1 - alpha_t) M_{t-1} + S_t,                     y_t = q_t @ M_t

(the spec's mom is S, mem is M; grad l = k (k @ M - v)^T). Every mode titans has (reference,
torch, the recurrent kernels under Triton's interpreter, the decode step): output, final states
and every gradient, the initial states' too; packed sequences (cu_seqlens) against separate
loops per sequence. Mode "torch" runs the system's chunked form (classes/block_affine.py,
runtime/torch_system.py): checked here at chunk sizes that do not divide T, in float64 and
float32, and at strong decay (gates near 0 and 1) where a cumulative product's inverse would
overflow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixc
import mixc.runtime.torch_chunk as torch_chunk
from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference

TOL = 1e-10


def assert_close(got, want, what, tol=TOL):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, want.detach().abs().max().item())
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def titans_loop(a, s0):
    """The paper's recurrence, token by token, per (batch, head); returns (y, {mom, mem})."""
    q, k, v = a["q"].double(), a["k"].double(), a["v"].double()
    eta, theta, alpha = (a[n].double() for n in ("eta", "theta", "alpha"))
    S, M = s0["mom"].double(), s0["mem"].double()        # [B, H, K, V]
    ys = []
    for t in range(q.shape[1]):
        kt, vt = k[:, t], v[:, t]                         # [B, H, K], [B, H, V]
        pred = torch.einsum("bhk,bhkv->bhv", kt, M)       # the memory's recall of k_t
        grad = kt[..., :, None] * (pred - vt)[..., None, :]   # d/dM of ||k M - v||^2 / 2
        S = eta[:, t, :, None, None] * S - theta[:, t, :, None, None] * grad
        M = (1 - alpha[:, t, :, None, None]) * M + S
        ys.append(torch.einsum("bhk,bhkv->bhv", q[:, t], M))
    y = torch.stack(ys, 1) if ys else q.new_zeros(q.shape[:3] + v.shape[-1:])   # an empty sequence
    return y, {"mom": S, "mem": M}


def packed_loop(a, s0, cu):
    """The loop over each sequence of a packed batch (B = 1) apart, outputs concatenated."""
    ys, finals = [], {"mom": [], "mem": []}
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {n: x[:, lo:hi] for n, x in a.items()}
        y, fin = titans_loop(part, {n: x[i:i + 1] for n, x in s0.items()})
        ys.append(y)
        for n in finals:
            finals[n].append(fin[n])
    return torch.cat(ys, 1), {n: torch.cat(x, 0) for n, x in finals.items()}


_OP = []


def _op():
    if not _OP:
        _OP.append(mixc.load("titans"))
    return _OP[0]


def make_case(*, B, T, H, K, V, seed, dtype=torch.float64, requires_grad=False, states=None, gates=(0.05, 0.95)):
    """Fresh inputs as the paper has them: unit keys (it normalizes q and k), gates in (0, 1)
    (uniform in `gates`); random initial states (`states` sequences of them, default B)."""
    op = _op()
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": V}, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    args["k"] = F.normalize(args["k"], dim=-1)
    args["q"] = F.normalize(args["q"], dim=-1)
    for n in ("eta", "theta", "alpha"):
        args[n] = gates[0] + (gates[1] - gates[0]) * torch.rand(args[n].shape, generator=gen, dtype=torch.float64)
    args = {n: x.to(dtype).detach().requires_grad_(requires_grad) for n, x in args.items()}
    s0 = random_state(op.ir, states or B, H, sizes, seed=seed + 3, dtype=dtype, requires_grad=requires_grad)
    return op, args, s0


def _weights(o, fin, seed=99):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            {n: torch.randn(x.shape, generator=gen, dtype=torch.float64) for n, x in fin.items()})


def _loss(o, fin, w):
    return (w[0] * o.double()).sum() + sum((w[1][n] * fin[n].double()).sum() for n in w[1])


def assert_gradients_match(what, o, fin, o_l, fin_l, args, s0, tol):
    """Every gradient (inputs', initial states') of one weighted loss of output and final states."""
    w = _weights(o_l, fin_l)
    leaves = list(args.values()) + list(s0.values())
    names = list(args) + [f"initial_state[{n}]" for n in s0]
    got = torch.autograd.grad(_loss(o, fin, w), leaves, allow_unused=True)
    want = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for name, a, b in zip(names, got, want):
        assert a is not None, f"{what}: no gradient for {name}"
        assert_close(a, b, f"{what}: d/d {name}", tol=tol)


def test_titans_is_one_block_affine_system():
    plan = _op().plan()
    assert plan.transition == "block-affine system"
    assert plan.forms == ("chunk", "recurrent", "step")       # chunk: the system's kernels (runtime/system_kernels.py)
    (sy,) = plan.systems
    assert sy.describe() == "mom, mem: a 2x2 block-affine system, scalar per head, with rank-1 projections over K"
    assert {(b.of, b.wrt): b.kind() for b in sy.blocks} == {
        ("mom", "mom"): "scalar", ("mom", "mem"): "rank-1 over K",
        ("mem", "mom"): "scalar", ("mem", "mem"): "scalar + rank-1 over K"}


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_forward_and_gradients_match_loop(mode):
    op, args, s0 = make_case(B=2, T=9, H=2, K=3, V=4, seed=11, requires_grad=True)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = titans_loop(args, s0)
    assert o.dtype == torch.float64 and set(fin) == {"mom", "mem"}
    assert_close(o, o_l, f"titans {mode}: output")
    st_tol = TOL if mode == "reference" else 1e-6        # the op's states are float32 (CONVENTIONS)
    for n in fin:
        assert_close(fin[n], fin_l[n], f"titans {mode}: final {n}", tol=st_tol)
    assert_gradients_match(f"titans {mode}", o, fin, o_l, fin_l, args, s0, tol=1e-9 if mode == "reference" else 1e-6)


@pytest.mark.parametrize("mode", ["reference", "torch", "recurrent"])
def test_packed_sequences_match_separate_loops(mode):
    """cu_seqlens with an empty sequence: outputs, final states and every gradient against
    the loop run on each sequence apart (the kernels in float32 within 4x the torch backend's
    error, as every kernel test)."""
    lens = [4, 0, 7, 2]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    dtype = torch.float32 if mode == "recurrent" else torch.float64
    op, args, s0 = make_case(B=1, T=sum(lens), H=2, K=4, V=3, seed=29, dtype=dtype, requires_grad=True,
                             states=len(lens))
    if mode == "recurrent":
        check_against_reference(op, {}, args, s0, dtype, CK=4, cu_seqlens=cu, mode="recurrent",
                                formula=lambda a, s: packed_loop(a, s, cu))
        return
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode)
    o_l, fin_l = packed_loop(args, s0, cu)
    assert_close(o, o_l, f"titans {mode}: packed output")
    for n in fin:
        assert_close(fin[n], fin_l[n], f"titans {mode}: packed final {n}", tol=1e-6)
    assert_close(fin["mem"][1], s0["mem"][1], f"titans {mode}: the empty sequence keeps its state", tol=1e-6)
    assert_gradients_match(f"titans {mode} packed", o, fin, o_l, fin_l, args, s0, tol=1e-9 if mode == "reference" else 1e-6)


def test_step_matches_loop():
    """Decoding token by token from a random state equals the loop over the sequence."""
    T = 5
    op, args, s0 = make_case(B=2, T=T, H=2, K=3, V=4, seed=17)
    o_l, fin_l = titans_loop(args, s0)
    st = s0
    for t in range(T):
        o, st = op.step(**{n: x[:, t] for n, x in args.items()}, state=st)
        assert_close(o, o_l[:, t], f"titans: step {t}", tol=1e-5)
    for n in st:
        assert_close(st[n], fin_l[n], f"titans: {n} after the steps", tol=1e-5)


@pytest.mark.parametrize("CK", [4, 20], ids=lambda c: f"CK{c}")
def test_recurrent_kernels_match_loop(CK):
    """The recurrent kernels (float32, Triton's interpreter): output, final states and every
    gradient against the float64 loop, within 4x the float32 torch backend's error; the
    backward's checkpoints every CK tokens (4: several chunks; 20: one)."""
    op, args, s0 = make_case(B=1, T=20, H=2, K=8, V=8, seed=31, dtype=torch.float32, requires_grad=True)
    check_against_reference(op, {}, args, s0, torch.float32, CK=CK, mode="recurrent", formula=titans_loop)


@pytest.mark.parametrize("shape", [dict(B=2, T=1, H=3, K=5, V=6)], ids=lambda d: case_id(**d))
def test_step_kernel_in_place_matches_loop(shape):
    """op.step on float32 states in place (the decode cache's path) equals one loop step."""
    op, args, s0 = make_case(seed=5, dtype=torch.float32, **shape)
    o_l, fin_l = titans_loop(args, s0)
    cache = {n: x.clone() for n, x in s0.items()}
    o, st = op.step(**{n: x[:, 0] for n, x in args.items()}, state=cache, inplace=True)
    assert_close(o, o_l[:, 0], "titans: in-place step", tol=1e-5)
    for n in cache:
        assert_close(cache[n], fin_l[n], f"titans: {n} updated in place", tol=1e-5)


@pytest.fixture
def chunked_calls(monkeypatch):
    """The chunk sizes of mode "torch"'s calls of the system's chunked form (so that a test of
    mode "torch" fails if it ran the token loop instead)."""
    calls, run = [], torch_chunk.torch_system_forward

    def spy(*args, **kwargs):
        calls.append(kwargs["C"])
        return run(*args, **kwargs)
    monkeypatch.setattr(torch_chunk, "torch_system_forward", spy)
    return calls


def test_torch_mode_runs_the_chunked_form():
    plan = _op().plan()
    assert plan.layout.torch_chunk_unsupported is None and plan.layout.chunk_unsupported is not None
    assert any("mode='torch' runs its chunked form" in n for n in plan.notes)
    (sy,) = plan.systems
    assert sy.chunk.states == ("mom", "mem") and sy.chunk.read == "mem"


CHUNK_CASES = [dict(B=2, T=100, H=3, K=16, V=8, C=16), dict(B=1, T=37, H=2, K=5, V=4, C=8),
               dict(B=2, T=9, H=2, K=3, V=4, C=64), dict(B=1, T=1, H=1, K=4, V=2, C=4)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda d: case_id(**d))
def test_chunked_torch_form_matches_loop(case, dtype, chunked_calls):
    """Mode "torch" (the system's chunked form, C tokens a chunk, C not dividing T): output,
    both final states and every gradient (inputs', initial states') against the float64 loop;
    float64 to 1e-9, float32 to 1e-4 (relative to the largest value)."""
    case = dict(case)
    C = case.pop("C")
    op, args, s0 = make_case(seed=41, dtype=dtype, requires_grad=True, **case)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=C)
    assert chunked_calls == [min(C, case["T"])]
    o_l, fin_l = titans_loop(args, s0)
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert o.dtype == dtype
    assert_close(o, o_l, "titans chunked: output", tol=tol)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunked: final {n}", tol=max(tol, 1e-6))
    assert_gradients_match("titans chunked", o, fin, o_l, fin_l, args, s0, tol=max(tol, 1e-6) * 10)


def test_chunked_torch_form_without_initial_state(chunked_calls):
    op, args, s0 = make_case(B=2, T=23, H=2, K=6, V=5, seed=43, requires_grad=True)
    o, fin = op(**args, output_final_state=True, mode="torch", chunk=8)
    assert chunked_calls == [8]
    zeros = {n: torch.zeros_like(x) for n, x in s0.items()}
    o_l, fin_l = titans_loop(args, zeros)
    assert_close(o, o_l, "titans chunked from zeros: output", tol=1e-9)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunked from zeros: final {n}", tol=1e-6)
    assert_gradients_match("titans chunked from zeros", o, fin, o_l, fin_l, args, {}, tol=1e-6)


@pytest.mark.parametrize("C", [4, 5], ids=lambda c: f"C{c}")
def test_chunked_torch_form_packed(C, chunked_calls):
    """cu_seqlens with an empty sequence and lengths that C does not divide: each sequence from
    its own initial state, against the loop on each sequence apart."""
    lens = [6, 0, 11, 3]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    op, args, s0 = make_case(B=1, T=sum(lens), H=2, K=4, V=3, seed=47, requires_grad=True, states=len(lens))
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode="torch", chunk=C)
    assert chunked_calls == [C]
    o_l, fin_l = packed_loop(args, s0, cu)
    assert_close(o, o_l, "titans chunked packed: output", tol=1e-9)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunked packed: final {n}", tol=1e-6)
    assert_gradients_match("titans chunked packed", o, fin, o_l, fin_l, args, s0, tol=1e-6)


@pytest.mark.parametrize("gates", [(1e-4, 0.02), (0.98, 1 - 1e-4)], ids=["near0", "near1"])
def test_chunked_torch_form_at_strong_decay(gates, chunked_calls):
    """Gates near 0 (a chunk of 64 decays by ~1e-150: exp(-A) of a cumulative sum would
    overflow float32) and near 1, in float32: finite and within 1e-4 of the float64 loop."""
    op, args, s0 = make_case(B=1, T=130, H=2, K=8, V=4, seed=53, dtype=torch.float32, requires_grad=True,
                             gates=gates)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=64)
    assert chunked_calls == [64]
    o_l, fin_l = titans_loop(args, s0)
    assert torch.isfinite(o).all()
    assert_close(o, o_l, f"titans chunked {gates}: output", tol=1e-4)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunked {gates}: final {n}", tol=1e-4)
    assert_gradients_match(f"titans chunked {gates}", o, fin, o_l, fin_l, args, s0, tol=1e-4)


def test_context_parallel_refuses_the_system(tmp_path):
    """cp_group: a shard's transition of a system maps mom and mem together, which context
    parallelism does not do: refused with the reason (one gloo process)."""
    import torch.distributed as dist
    from mixc.runtime.signature import ArgumentError
    op, args, _ = make_case(B=1, T=6, H=2, K=3, V=4, seed=59)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ArgumentError, match=r"cp_group: mixer 'titans' has a block-affine system of coupled "
                           r"states \(mom, mem: .*\): its shard's transition maps the states together"):
            op(**args, cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["k", "v"])
def test_chunked_torch_form_is_causal_under_nan(name, chunked_calls):
    """A NaN in token 5's key or value (chunks of 8; a NaN gate is refused by its declared
    range): the outputs before it equal the loop's, those from it on are NaN, as the loop's,
    and so are the final states."""
    op, args, s0 = make_case(B=1, T=11, H=2, K=3, V=2, seed=61)
    args[name] = args[name].clone()
    args[name][0, 5] = float("nan")
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=8)
    assert chunked_calls == [8]
    o_l, _ = titans_loop(args, s0)
    assert_close(o[:, :5], o_l[:, :5], f"titans chunked, NaN in {name}: the outputs before it", tol=1e-9)
    assert torch.isnan(o[:, 5:]).all() and torch.isnan(o_l[:, 5:]).all()
    assert all(torch.isnan(x).all() for x in fin.values())


# ---- mode "chunk": the system's chunked Triton kernels (runtime/system_kernels.py) ----

KERNEL_CASES = [dict(B=2, T=37, H=2, K=5, V=4, C=16), dict(B=1, T=16, H=1, K=16, V=8, C=16),
                dict(B=1, T=70, H=2, K=8, V=40, C=32)]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The launches of the system's forward kernel (a test of mode "chunk" fails if another path ran)."""
    import mixc.runtime.system_chunk as sc
    calls, run = [], sc._SystemChunk.apply
    monkeypatch.setattr(sc, "SYSTEM_TILE", 16)        # V = 40: three blocks of V, their partials summed
    monkeypatch.setenv("MIXC_POISON", "1")            # outputs poisoned (NaN) before launch

    def spy(*a):
        calls.append(a[0][0])
        return run(*a)
    monkeypatch.setattr(sc._SystemChunk, "apply", spy)
    return calls


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda d: case_id(**d))
def test_chunk_kernels_match_loop(case, kernel_calls):
    """Mode "chunk" (Triton's interpreter, float32): output, both final states and every gradient
    (q, k, v, each gate, both initial states) against the float64 paper loop, T not a multiple
    of C, V in several blocks."""
    case = dict(case)
    C = case.pop("C")
    op, args, s0 = make_case(seed=71, dtype=torch.float32, requires_grad=True, **case)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="chunk", chunk=C)
    assert kernel_calls == [C]
    o_l, fin_l = titans_loop(args, s0)
    assert o.dtype == torch.float32
    assert_close(o, o_l, "titans chunk: output", tol=1e-4)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunk: final {n}", tol=1e-4)
    assert_gradients_match("titans chunk", o, fin, o_l, fin_l, args, s0, tol=1e-4)


def test_chunk_kernels_without_initial_state(kernel_calls):
    op, args, s0 = make_case(B=2, T=23, H=2, K=6, V=5, seed=73, dtype=torch.float32, requires_grad=True)
    o, fin = op(**args, output_final_state=True, mode="chunk", chunk=16)
    assert kernel_calls == [16]
    o_l, fin_l = titans_loop(args, {n: torch.zeros_like(x) for n, x in s0.items()})
    assert_close(o, o_l, "titans chunk from zeros: output", tol=1e-4)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunk from zeros: final {n}", tol=1e-4)
    assert_gradients_match("titans chunk from zeros", o, fin, o_l, fin_l, args, {}, tol=1e-4)


def test_chunk_kernels_packed(kernel_calls):
    """cu_seqlens with an empty sequence, one shorter than a chunk and lengths C does not divide:
    each sequence from its own initial state, against the loop on each sequence apart."""
    lens = [19, 0, 5, 33]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    op, args, s0 = make_case(B=1, T=sum(lens), H=2, K=4, V=3, seed=79, dtype=torch.float32, requires_grad=True,
                             states=len(lens))
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode="chunk", chunk=16)
    assert kernel_calls == [16]
    o_l, fin_l = packed_loop(args, s0, cu)
    assert_close(o, o_l, "titans chunk packed: output", tol=1e-4)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunk packed: final {n}", tol=1e-4)
    assert_close(fin["mem"][1], s0["mem"][1], "titans chunk: the empty sequence keeps its state", tol=1e-6)
    assert_gradients_match("titans chunk packed", o, fin, o_l, fin_l, args, s0, tol=1e-4)


def test_chunk_kernels_bf16(kernel_calls):
    """bf16 inputs (the pieces and the kernels in float32): output and final states within 2e-2
    of the float64 loop run on the same bf16 values."""
    op, args, s0 = make_case(B=1, T=40, H=2, K=8, V=8, seed=83, dtype=torch.bfloat16)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="chunk", chunk=16)
    assert kernel_calls == [16] and o.dtype == torch.bfloat16
    o_l, fin_l = titans_loop(args, s0)
    assert_close(o, o_l, "titans chunk bf16: output", tol=2e-2)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunk bf16: final {n}", tol=2e-2)


def test_chunk_kernels_empty_calls():
    """No sequence (B = 0: the recurrent kernels' empty outputs) and no token (T = 0: each final
    state is its initial one) in mode "chunk"."""
    op, args, s0 = make_case(B=1, T=5, H=2, K=4, V=3, seed=89, dtype=torch.float32)
    o, fin = op(**{n: x[:0] for n, x in args.items()}, output_final_state=True, mode="chunk")
    assert o.shape == (0, 5, 2, 3) and fin["mem"].shape == (0, 2, 4, 3)
    o, fin = op(**{n: x[:, :0] for n, x in args.items()}, initial_state=s0, output_final_state=True, mode="chunk")
    assert o.shape == (1, 0, 2, 3)
    for n in s0:
        assert_close(fin[n], s0[n], f"titans chunk, T = 0: final {n}", tol=0)


@pytest.mark.parametrize("name", ["k", "v"])
def test_chunk_kernels_are_causal_under_nan(name, kernel_calls):
    """A NaN in token 21's key or value (chunks of 16: rows 16-20 share its chunk): the kernels'
    outputs before it equal the loop's (no masked 0 times NaN reaches them), those from it on
    and both final states are NaN, as the loop's; the gradients equal mode "torch"'s (the same
    rule: the token's pieces zeroed, the rows from it on filled with NaN)."""
    op, args, s0 = make_case(B=1, T=37, H=2, K=3, V=2, seed=97, dtype=torch.float32)
    args[name][0, 21] = float("nan")
    grads = {}
    for mode in ("chunk", "torch"):
        a = {n: x.clone().requires_grad_(True) for n, x in args.items()}
        o, fin = op(**a, initial_state=s0, output_final_state=True, mode=mode, chunk=16)
        o_l, _ = titans_loop(args, s0)
        assert_close(o[:, :21], o_l[:, :21], f"titans {mode}, NaN in {name}: the outputs before it", tol=1e-4)
        assert torch.isnan(o[:, 21:]).all() and torch.isnan(o_l[:, 21:]).all()
        assert all(torch.isnan(x).all() for x in fin.values())
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
        loss = (torch.nan_to_num(o, nan=0.0) * w).sum()
        grads[mode] = torch.autograd.grad(loss, [a["q"], a["k"], a["v"], a["theta"]])
    assert kernel_calls == [16]
    for g, (x, y) in zip(["q", "k", "v", "theta"], zip(*grads.values())):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-4, equal_nan=True), f"d{g}: chunk vs torch under NaN in {name}"


def test_chunk_kernels_take_gates_of_zero(kernel_calls):
    """eta = 0 or alpha = 1 at some tokens (a reset of mom or mem: log -inf, past the declared
    range, which the kernel modes do not check): the kernels count resets apart (no inf - inf),
    so output, final states and the gradients of q, k, v, theta and the initial states equal
    the loop's (eta's and alpha's own are infinite there: d log(eta) / d eta at 0)."""
    op, args, s0 = make_case(B=1, T=40, H=2, K=4, V=3, seed=3, dtype=torch.float32)
    args["eta"][0, 5] = 0.0
    args["eta"][0, 20, 1] = 0.0
    args["alpha"][0, 9] = 1.0
    args["alpha"][0, 31, 0] = 1.0
    a = {n: x.clone().requires_grad_(n not in ("eta", "alpha")) for n, x in args.items()}
    s = {n: x.clone().requires_grad_(True) for n, x in s0.items()}
    o, fin = op(**a, initial_state=s, output_final_state=True, mode="chunk", chunk=16)
    assert kernel_calls == [16]
    o_l, fin_l = titans_loop(a, s)
    assert_close(o, o_l, "titans chunk, gates of 0: output", tol=1e-4)
    for n in fin_l:
        assert_close(fin[n], fin_l[n], f"titans chunk, gates of 0: final {n}", tol=1e-4)
    w = _weights(o_l, fin_l)
    leaves = [a["q"], a["k"], a["v"], a["theta"], s["mom"], s["mem"]]
    for name, g1, g2 in zip(["q", "k", "v", "theta", "mom0", "mem0"], torch.autograd.grad(_loss(o, fin, w), leaves),
                            torch.autograd.grad(_loss(o_l, fin_l, w), leaves)):
        assert_close(g1, g2, f"titans chunk, gates of 0: d/d {name}", tol=1e-4)

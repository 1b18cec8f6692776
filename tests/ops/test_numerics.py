"""Numerics the op promises (docs/reliability.md): a long sequence through the torch backend,
log decays from 0 to -20 per token, bf16 inputs of magnitude 1e3, beta near 0 and near 2.
Exponential gates near and beyond overflow are tests/ops/test_stabilizer.py."""
import pytest
import torch

import mixc

from helpers import random_args, random_state
from kernel_checks import check_against_reference


def test_long_sequence_through_the_torch_backend():
    """T = 65536 (1024 chunks) in fp32 against a float64 loop written here."""
    op = mixc.load("gla")
    T, K, V = 65536, 4, 4
    args, _ = random_args(op.ir, B=1, T=T, H=1, sizes={"K": K, "V": V}, dtype=torch.float32, seed=1)
    args["g"] = -torch.rand(1, T, 1, K, generator=torch.Generator().manual_seed(2)) * 0.1
    o, st = op(**args, mode="torch", output_final_state=True)
    q, k, v, g = (args[n][0, :, 0].double() for n in ("q", "k", "v", "g"))
    S, want = torch.zeros(K, V, dtype=torch.float64), torch.empty(T, V, dtype=torch.float64)
    for t in range(T):
        S = torch.exp(g[t])[:, None] * S + k[t][:, None] * v[t][None, :]
        want[t] = (q[t] * K ** -0.5) @ S
    assert torch.isfinite(o).all()
    err = (o[0, :, 0].double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err        # fp32 over 65536 tokens: no drift
    torch.testing.assert_close(st["S"][0, 0].double(), S, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_long_sequence_through_the_interpreted_chunk_kernels():
    """T = 65536 through the chunked Triton kernels under the interpreter (about 16 minutes on
    one core since gla chunks at C = 32 in sub-chunks of 16): forward, final state and every
    gradient against the torch backend in float64."""
    op = mixc.load("gla")
    T, K, V = 65536, 8, 8
    args, _ = random_args(op.ir, B=1, T=T, H=1, sizes={"K": K, "V": V}, dtype=torch.float32,
                          requires_grad=True, seed=3)
    with torch.no_grad():
        args["g"].copy_(-torch.rand(1, T, 1, K, generator=torch.Generator().manual_seed(4)) * 0.1)
    o, st = op(**args, mode="chunk", output_final_state=True)
    ref_args = {n: x.detach().double().requires_grad_() for n, x in args.items()}
    ref, ref_st = op(**ref_args, mode="torch", output_final_state=True)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (o.double() * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.isfinite(o).all()
    scale = ref.abs().max().item()
    assert (o.double() - ref).abs().max().item() <= 1e-5 * scale
    torch.testing.assert_close(st["S"].double(), ref_st["S"].double(), rtol=1e-5, atol=1e-5)
    for n in ("q", "k", "v", "g"):
        got, want = args[n].grad.double(), ref_args[n].grad
        assert torch.isfinite(got).all(), n
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), n


@pytest.mark.parametrize("low", [0.0, -1e-3, -1.0, -8.0, -20.0], ids=lambda x: f"g{x:g}")
@pytest.mark.parametrize("name,mode", [("gla", "chunk"), ("gated_delta_rule", "chunk"), ("simple_gla", "chunk"),
                                       ("gla", "recurrent")])
def test_log_decays_from_zero_to_minus_twenty(name, mode, low):
    """Log decays in [low - 0.5, low] per token (a decay of 1 at low = 0): finite, and within the
    kernels' usual tolerance of the float64 loop."""
    op = mixc.load(name)
    gate = "g"                  # each takes its log decay as the input g

    def draw(shape, gen):
        return torch.clamp(low - 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64), max=0.0)
    args, sizes = random_args(op.ir, B=1, T=37, H=2, sizes={"K": 8, "V": 8, "P": 8, "N": 8}, dtype=torch.float32,
                              requires_grad=True, seed=5, draw={gate: draw})
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode=mode, CK=8, chunk=16)


def test_bf16_inputs_of_magnitude_1e3():
    """q, k, v ~ 1e3 in bf16: outputs ~ 1e7 stay finite and as close to float64 as the eager
    bf16 computation (fp32 accumulation and fp32 states)."""
    op = mixc.load("gla")
    big = {n: (lambda shape, gen: 1e3 * torch.randn(shape, generator=gen, dtype=torch.float64)) for n in "qkv"}
    args, sizes = random_args(op.ir, B=1, T=21, H=2, sizes={"K": 8, "V": 8}, dtype=torch.bfloat16, requires_grad=True,
                              seed=7, draw=big)
    assert max(args[n].abs().max().item() for n in "qkv") > 1e3
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    for mode in ("chunk", "recurrent"):
        check_against_reference(op, {}, args, st, torch.bfloat16, mode=mode, chunk=16)


@pytest.mark.parametrize("beta", [(1e-4, 1e-3), (1.99, 1.999)], ids=["beta~0", "beta~2"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_beta_near_the_ends_of_its_range(beta, mode):
    """The delta rule with unit keys (the in-kernel L2 norm): beta in (0, 2) keeps the
    transition I - beta k k^T a contraction; at its ends nothing blows up."""
    op = mixc.load("gated_delta_rule")
    lo, hi = beta

    def draw(shape, gen):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    args, sizes = random_args(op.ir, B=1, T=29, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, requires_grad=True,
                              seed=11, draw={"beta": draw})
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    check_against_reference(op, {"use_qk_l2norm_in_kernel": True}, args, st, torch.float32, mode=mode, CK=8,
                            chunk=16)


def _reset_args(op, seed):
    """B1-T40-H2-K8: log decays in [-1, 0] with -inf (a decay of 0: a state reset) at tokens 7,
    20 and 21 (two resets in a row, and one in each chunk of 16)."""
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=seed)
    args["g"] = -torch.rand(args["g"].shape, generator=torch.Generator().manual_seed(seed))
    args["g"][:, [7, 20, 21]] = float("-inf")
    return args


@pytest.mark.parametrize("name", ["gla", "simple_gla", "gated_delta_rule"])
def test_a_decay_of_zero_resets_the_state_in_the_torch_backend(name):
    """exp(-inf) = 0: the output and final state equal the float64 reference's (the chunked
    form sums the log decay per pair: b_i - b_j would be -inf - -inf = NaN)."""
    op = mixc.load(name)
    args = _reset_args(op, 21)
    ref, ref_st = op(**{n: x.double() for n, x in args.items()}, mode="reference", output_final_state=True)
    o, st = op(**args, mode="torch", output_final_state=True)
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st["S"].double(), ref_st["S"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["gla", "simple_gla", "gated_delta_rule"])
def test_a_decay_of_zero_resets_the_state_in_the_chunk_kernels(name):
    """The chunked kernels count the resets per token (z) and weigh the pairs across one 0,
    where b_i - b_j gave NaN from the first reset on: output, final state and every gradient
    (the initial state's too) within fp32 rounding of the float64 reference."""
    op = mixc.load(name)
    args = _reset_args(op, 21)
    args["g"][:, 31] = float("-inf")        # and one at a chunk's last token (its weights into S_C)
    st = {n: x.float() for n, x in random_state(op.ir, 1, 2, {"K": 8, "V": 8}).items()}
    a64 = {n: x.double().requires_grad_() for n, x in list(args.items()) + list(st.items())}
    a32 = {n: x.clone().requires_grad_() for n, x in list(args.items()) + list(st.items())}
    ref, ref_st = op(**{n: a64[n] for n in args}, initial_state={"S": a64["S"]}, mode="reference",
                     output_final_state=True)
    o, fs = op(**{n: a32[n] for n in args}, initial_state={"S": a32["S"]}, mode="chunk", chunk=16,
               output_final_state=True)
    gen = torch.Generator().manual_seed(3)
    w, ws = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (ref, ref_st["S"]))
    ((ref * w).sum() + (ref_st["S"] * ws).sum()).backward()
    ((o.double() * w).sum() + (fs["S"].double() * ws).sum()).backward()
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fs["S"].double(), ref_st["S"], rtol=1e-4, atol=1e-5)
    for n in a64:
        got, want = a32[n].grad.double(), a64[n].grad
        assert torch.isfinite(got).all(), n
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, n
    assert (a32["g"].grad[:, [7, 20, 21, 31]] == 0).all()     # every pair across a reset weighs 0


@pytest.mark.parametrize("low", [-8.0, -20.0], ids=lambda x: f"g{x:g}")
@pytest.mark.parametrize("name", ["gla", "simple_gla", "gated_delta_rule"])
@pytest.mark.parametrize("mode", ["torch", "chunk"])
def test_dg_at_strong_decay(mode, name, low):
    """B1-T40-H2-K8, log decays in [low - 0.5, low]: dg within 1e-5 (relative, in norm) of the
    float64 reference in fp32, as the recurrent kernel (before: 4e-4 at -8, 1 to 3 at -20, the
    q dq - k dk identity cancelling the diagonal's O(1) terms; docs/kernels.md has the table).
    The chunked kernels at C = 16 (the rank-1 class was 1e-4 at -8 and 0.7 at -20)."""
    op = mixc.load(name)

    def draw(shape, gen):
        return low - 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=22,
                          draw={"g": draw})
    w = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    a64 = {n: x.double().requires_grad_() for n, x in args.items()}
    (op(**a64, mode="reference")[0] * w).sum().backward()
    a32 = {n: x.clone().requires_grad_() for n, x in args.items()}
    (op(**a32, mode=mode, **({"chunk": 16} if mode == "chunk" else {}))[0].double() * w).sum().backward()
    want = a64["g"].grad
    assert ((a32["g"].grad.double() - want).norm() / want.norm()).item() <= 1e-5


SCALAR_PREV = """
mixer scalar_prev
  dims   K, V
  input  q[K], k[K], v[V], g[]
  state  S[K, V]
  update S = exp(g) * S + k * v
  output o = q @ prev(S) + 0.5 * (q @ S)
"""


@pytest.mark.parametrize("low", [-8.0, -20.0], ids=lambda x: f"g{x:g}")
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("name", ["simple_gla", "scalar_prev"])
def test_dg_at_strong_decay_scalar_class_to_chunk_64(name, chunk, low, tmp_path):
    """The scalar class's chunked kernels at C = 64, its CUDA default (B1-T128-H2-K8, log decays
    in [low - 0.5, low]): every gradient within 1e-6 of the float64 reference (relative, in
    norm). b, the cumulative log decay, reaches -1280 in a chunk, where fp32's grid is 1.2e-4:
    exp(b_i - b_j) of neighbours was off by that much (dg 7e-6 at -8 and 1.5e-5 .. 2.4e-5 at
    -20 with C = 64; 1.4e-6 .. 6.5e-6 with C = 16). b as a compensated sum (hi on a grid that
    sums exactly, lo the remainders): 1.4e-7 .. 4.1e-7. scalar_prev reads S_{t-1} too (b
    shifted by a row: hi and lo each)."""
    if name == "scalar_prev":
        path = tmp_path / "scalar_prev.mix"
        path.write_text(SCALAR_PREV)
        name = str(path)
    op = mixc.load(name)

    def draw(shape, gen):
        return low - 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
    args, _ = random_args(op.ir, B=1, T=128, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=22,
                          draw={"g": draw})
    w = torch.randn(1, 128, 2, 8, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    a64 = {n: x.double().requires_grad_() for n, x in args.items()}
    (op(**a64, mode="reference")[0] * w).sum().backward()
    a32 = {n: x.clone().requires_grad_() for n, x in args.items()}
    (op(**a32, mode="chunk", chunk=chunk)[0].double() * w).sum().backward()
    for n in a64:
        want = a64[n].grad
        assert ((a32[n].grad.double() - want).norm() / want.norm()).item() <= 1e-6, n


NEGATIVE = {"tanh": ("input  q[K], k[K], v[V], g[]", "tanh(g)"),
            "constant": ("input  q[K], k[K], v[V]", "(0 - 0.5)"),
            "per-head": ("input  q[K], k[K], v[V]", "(1 - 2 ** (head - 0.5))")}     # retention's, negative past 0


@pytest.mark.parametrize("kind", list(NEGATIVE))
def test_a_negative_decay_runs_the_recurrence_or_is_refused_at_its_line(kind, tmp_path):
    """A decay that can be negative has no real log (the chunked forms gave NaN): the lint
    says so, mode='auto' takes the recurrent kernels and the torch backend its token loop (both
    equal the float64 reference, gradients too), mode='chunk' and mode='conv' raise an
    ArgumentError naming the decay and its file:line:col. B1-T12-H2-K8 (head 1 of the per-head
    decay is -0.41)."""
    from mixc.derive.lint import lint
    from mixc.runtime.signature import ArgumentError
    inputs, decay = NEGATIVE[kind]
    path = tmp_path / "neg.mix"
    path.write_text(f"mixer neg\n  dims   K, V\n  {inputs}\n  state  S[K, V]\n  update S = {decay} * S + k * v\n"
                    "  output o = q @ S\n")
    op = mixc.load(str(path))
    assert any("can be negative" in w.message and w.span.line == 5 for w in lint(op.plan()))
    args, _ = random_args(op.ir, B=1, T=12, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=31)
    a64 = {n: x.double().requires_grad_() for n, x in args.items()}
    ref = op(**a64, mode="reference")[0]
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    (ref * w).sum().backward()
    for mode in ("auto", "torch"):
        a32 = {n: x.clone().requires_grad_() for n, x in args.items()}
        o = op(**a32, mode=mode)[0]
        (o.double() * w).sum().backward()
        torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        for n in a32:
            torch.testing.assert_close(a32[n].grad.double(), a64[n].grad, rtol=1e-4,
                                       atol=1e-4 * a64[n].grad.abs().max().item())
    for mode in ("chunk", "conv") if kind != "tanh" else ("chunk",):
        with pytest.raises(ArgumentError, match=rf"mode='{mode}'.*the decay of S, .* \(.*neg\.mix:5:10\), is not "
                                                r"provably >= 0"):
            op(**args, mode=mode)


@pytest.mark.parametrize("low", [-0.5, -20.0], ids=lambda x: f"g{x:g}")
@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("name", ["gla", "rwkv6"])
def test_key_diagonal_sub_chunks_with_resets_and_strong_decay(name, chunk, low):
    """The key-diagonal class's chunk in sub-chunks of 16 (mixc/classes/key_diag.py: below the diagonal
    matmuls through a reference row, the diagonal sub-blocks elementwise; rwkv6 reads S_{t-1},
    its keys moved a row): B1-T100-H2-K8, log decays in [low - 0.5, low] per key, resets (a
    decay of 0) on both sides of sub-chunk and chunk borders and on one key alone. Output,
    final state and every gradient (the decay's and the initial state's) within 1e-5 in norm
    of float64."""
    op = mixc.load(name)
    gate = "g" if name == "gla" else "w"

    def draw(shape, gen):
        return low - 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
    args, sizes = random_args(op.ir, B=1, T=100, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=31,
                              draw={gate: draw})
    args[gate][:, [15, 16, 47, 63, 64]] = float("-inf")
    args[gate][:, 40, :, 3] = float("-inf")              # one key's state only
    st = {n: x.float() for n, x in random_state(op.ir, 1, 2, sizes).items()}
    a64 = {n: x.double().requires_grad_() for n, x in list(args.items()) + list(st.items())}
    a32 = {n: x.clone().requires_grad_() for n, x in list(args.items()) + list(st.items())}
    ref, ref_st = op(**{n: a64[n] for n in args}, initial_state={"S": a64["S"]}, mode="reference",
                     output_final_state=True)
    o, fs = op(**{n: a32[n] for n in args}, initial_state={"S": a32["S"]}, mode="chunk", chunk=chunk,
               output_final_state=True)
    gen = torch.Generator().manual_seed(3)
    w, ws = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (ref, ref_st["S"]))
    ((ref * w).sum() + (ref_st["S"] * ws).sum()).backward()
    ((o.double() * w).sum() + (fs["S"].double() * ws).sum()).backward()
    assert ((o.double() - ref).norm() / ref.norm()).item() <= 1e-5
    assert ((fs["S"].double() - ref_st["S"]).norm() / ref_st["S"].norm()).item() <= 1e-5
    for n in a64:
        got, want = a32[n].grad.double(), a64[n].grad
        assert torch.isfinite(got).all(), n
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, n

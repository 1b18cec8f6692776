"""A spec with constant tensors (`const D[E] = [1, 1 / 4]`): two states stacked on a fixed dim
E = 2, each decayed at its own const rate and mixed into the output by const weights, against a
float64 loop written here from the recurrence (not from mixc's reference):

  Z_t[e] = exp(g_t * D[e]) Z_{t-1}[e] + k_t v_t^T,   o_t = s * sum_e W[e] q_t @ Z_t[e]

with D = [1, 1/4], W = [1/2, -1], s = 2 ** -1 written in the spec. Every mode (reference, torch,
the recurrent and chunked kernels under Triton's interpreter, the decode step, packed sequences):
output, final state and every gradient of the inputs and the initial state. The consts are never
arguments: the op supplies them (standalone/binding.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import random_args, random_state
from kernel_checks import check_against_reference
from mixc.pipeline import from_text

SPEC = """
mixer constmix
  dims   K, V, E = 2
  input  q[K], k[K], v[V], g[] in (-inf, 0]
  const  D[E] = [1, 1 / 4], W[E] = [0.5, -1], s[] = 2 ** -1
  state  Z[E, K, V]
  update Z = exp(g * D) * Z + k * v
  output o = s * (q @ (W @ Z))
"""
D, W, S = (1.0, 0.25), (0.5, -1.0), 0.5


def loop(a, s0):
    """The recurrence token by token in float64; returns (o, {Z})."""
    q, k, v, g = (a[n].double() for n in ("q", "k", "v", "g"))
    Z = s0["Z"].double()                                   # [B, H, E, K, V]
    d = torch.tensor(D, dtype=torch.float64)[:, None, None]
    w = torch.tensor(W, dtype=torch.float64)
    ys = []
    for t in range(q.shape[1]):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]     # [B, H, K, V]
        Z = torch.exp(g[:, t, :, None, None, None] * d) * Z + kv[:, :, None]
        ys.append(S * torch.einsum("bhk,e,bhekv->bhv", q[:, t], w, Z))
    o = torch.stack(ys, 1) if ys else q.new_zeros(q.shape[:3] + v.shape[-1:])     # an empty sequence
    return o, {"Z": Z}


def packed_loop(a, s0, cu):
    ys, fins = [], []
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, fin = loop({n: x[:, lo:hi] for n, x in a.items()}, {"Z": s0["Z"][i:i + 1]})
        ys.append(y)
        fins.append(fin["Z"])
    return torch.cat(ys, 1), {"Z": torch.cat(fins, 0)}


@pytest.fixture(scope="module")
def op():
    return from_text(SPEC, "constmix.mix")


def make_case(op, *, B, T, H, K, V, seed, dtype=torch.float64, states=None):
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": V}, seed=seed, dtype=dtype,
                              requires_grad=True)
    s0 = random_state(op.ir, states or B, H, sizes, seed=seed + 3, dtype=dtype, requires_grad=True)
    return args, s0


def assert_close(got, want, what, tol):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    scale = max(1.0, want.detach().abs().max().item())
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def assert_gradients(what, o, fin, o_l, fin_l, args, s0, tol):
    gen = torch.Generator().manual_seed(5)
    w_o = torch.randn(o_l.shape, generator=gen, dtype=torch.float64)
    w_z = torch.randn(fin_l["Z"].shape, generator=gen, dtype=torch.float64)
    leaves, names = [*args.values(), s0["Z"]], [*args, "initial_state[Z]"]
    got = torch.autograd.grad((w_o * o.double()).sum() + (w_z * fin["Z"].double()).sum(), leaves)
    want = torch.autograd.grad((w_o * o_l).sum() + (w_z * fin_l["Z"]).sum(), leaves)
    for name, a, b in zip(names, got, want):
        assert_close(a, b, f"{what}: d/d {name}", tol)


def test_the_consts_are_not_arguments(op):
    assert [p.name for p in op.ir.given_params] == [] and [c.name for c in op.ir.consts] == ["D", "W", "s"]
    assert "D" not in str(op.__signature__) and "Consts, fixed by the spec" in op.__doc__


@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_forward_and_gradients_match_loop(op, mode):
    args, s0 = make_case(op, B=2, T=9, H=2, K=3, V=4, seed=11)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = loop(args, s0)
    assert o.dtype == torch.float64
    tol = 1e-10 if mode == "reference" else 1e-6
    assert_close(o, o_l, f"{mode}: output", tol)
    assert_close(fin["Z"], fin_l["Z"], f"{mode}: final Z", tol)
    assert_gradients(mode, o, fin, o_l, fin_l, args, s0, tol)


@pytest.mark.parametrize("mode,CK", [("recurrent", 4), ("chunk", 4)], ids=["recurrent-CK4", "chunk-C4"])
def test_kernels_match_loop(op, mode, CK):
    """The kernels in float32 (Triton's interpreter) within 4x the torch backend's error of the
    float64 loop: output, final state, every gradient; the chunked ones over several chunks."""
    args, s0 = make_case(op, B=1, T=11, H=2, K=8, V=8, seed=31, dtype=torch.float32)
    check_against_reference(op, {}, args, s0, torch.float32, CK=CK, mode=mode, formula=loop)


def test_packed_sequences_match_separate_loops(op):
    lens = [4, 0, 5]
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    args, s0 = make_case(op, B=1, T=sum(lens), H=2, K=4, V=4, seed=29, dtype=torch.float32, states=len(lens))
    check_against_reference(op, {}, args, s0, torch.float32, CK=4, cu_seqlens=cu, mode="recurrent",
                            formula=lambda a, s: packed_loop(a, s, cu))


@pytest.mark.parametrize("mode", ["reference", "torch", "recurrent"])
def test_step_matches_loop(op, mode):
    T = 4
    args, s0 = make_case(op, B=2, T=T, H=2, K=3, V=4, seed=17, dtype=torch.float32)
    args = {n: x.detach() for n, x in args.items()}
    st = {"Z": s0["Z"].detach()}
    o_l, fin_l = loop(args, st)
    for t in range(T):
        o, st = op.step(**{n: x[:, t] for n, x in args.items()}, state=st, mode=mode)
        assert_close(o, o_l[:, t], f"step {mode} {t}", 1e-5)
    assert_close(st["Z"], fin_l["Z"], f"step {mode}: Z", 1e-5)


def test_passing_a_const_is_an_error_naming_it(op):
    args, s0 = make_case(op, B=1, T=3, H=1, K=2, V=2, seed=3)
    with pytest.raises(Exception, match=r"^W: not an argument; 'W' is a const of mixer 'constmix'"):
        op(**args, W=torch.ones(1, 2, dtype=torch.float64), mode="reference")


@pytest.mark.parametrize("mode", ["torch", "recurrent"])
def test_in_place_steps_match_loop(op, mode):
    """The decode cache's path (float32 state updated in place), replayed from the second token."""
    T = 3
    args, s0 = make_case(op, B=2, T=T, H=2, K=3, V=4, seed=19, dtype=torch.float32)
    args = {n: x.detach() for n, x in args.items()}
    cache = {"Z": s0["Z"].detach().clone()}
    o_l, fin_l = loop(args, {"Z": cache["Z"].clone()})
    for t in range(T):
        o, _ = op.step(**{n: x[:, t] for n, x in args.items()}, state=cache, mode=mode, inplace=True)
        assert_close(o, o_l[:, t], f"in-place step {mode} {t}", 1e-5)
    assert_close(cache["Z"], fin_l["Z"], f"in-place step {mode}: Z", 1e-5)


def test_the_compiled_module_supplies_the_consts(op, tmp_path):
    """`mixc compile -o DIR`: the module binds with its METADATA's consts (numbers only: the
    spec's text of a value never reaches it), equals the op, and refuses a const passed."""
    import importlib.util

    from mixc.cli import main
    spec_file = tmp_path / "constmix.mix"
    spec_file.write_text(SPEC)
    assert main(["compile", str(spec_file), "-o", str(tmp_path / "out")]) == 0
    spec = importlib.util.spec_from_file_location("compiled_constmix", tmp_path / "out" / "constmix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.METADATA["consts"] == {"D": {"shape": ["E"], "values": [1.0, 0.25]},
                                      "W": {"shape": ["E"], "values": [0.5, -1.0]},
                                      "s": {"shape": [], "values": [0.5]}}
    args, s0 = make_case(op, B=2, T=7, H=2, K=4, V=4, seed=23, dtype=torch.float32)
    args = {n: x.detach() for n, x in args.items()}
    o1, st1 = op(**args, initial_state={"Z": s0["Z"].detach()}, output_final_state=True)
    o2, st2 = mod.op(**args, initial_state={"Z": s0["Z"].detach()}, output_final_state=True)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st2["Z"], st1["Z"], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"^D: not an argument; 'D' is a const"):
        mod.op(**args, D=torch.ones(2, 2))


DECAY_SPEC = """
mixer chandecay
  dims   K = 4, V
  input  q[K], k[K], v[V]
  const  lam[K] = [0.9, 0.5, 0.25, 1]
  state  S[K, V]
  update S = lam * S + k * v
  output o = q @ S
"""
LAM = (0.9, 0.5, 0.25, 1.0)


def decay_loop(a, s0):
    """S_t = diag(lam) S_{t-1} + k_t v_t^T, o_t = q_t @ S_t, in float64."""
    q, k, v = (a[n].double() for n in ("q", "k", "v"))
    lam = torch.tensor(LAM, dtype=torch.float64)[:, None]
    Sx = s0["S"].double()
    ys = []
    for t in range(q.shape[1]):
        Sx = lam * Sx + k[:, t, :, :, None] * v[:, t, :, None, :]
        ys.append(torch.einsum("bhk,bhkv->bhv", q[:, t], Sx))
    return torch.stack(ys, 1), {"S": Sx}


@pytest.fixture(scope="module")
def decay_op():
    return from_text(DECAY_SPEC, "chandecay.mix")


def test_a_const_decay_is_proved_in_range_and_gets_the_chunked_form(decay_op):
    """The const's values span its range ([0.25, 1]): the decay is provably in (0, 1]."""
    assert decay_op.ir.param("lam").range is not None and "chunk" in decay_op.plan().forms


@pytest.mark.parametrize("mode", ["reference", "torch", "chunk"])
def test_a_const_per_channel_decay_matches_loop(decay_op, mode):
    dtype = torch.float32 if mode == "chunk" else torch.float64
    args, s0 = make_case(decay_op, B=2, T=10, H=2, K=4, V=3, seed=41, dtype=dtype)
    if mode == "chunk":
        check_against_reference(decay_op, {}, args, s0, dtype, CK=4, mode=mode, formula=decay_loop)
        return
    o, fin = decay_op(**args, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = decay_loop(args, s0)
    tol = 1e-10 if mode == "reference" else 1e-6
    assert_close(o, o_l, f"{mode}: output", tol)
    assert_close(fin["S"], fin_l["S"], f"{mode}: final S", tol)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(o_l.shape, generator=gen, dtype=torch.float64)
    leaves = [*args.values(), s0["S"]]
    for a, b in zip(torch.autograd.grad((w * o).sum(), leaves), torch.autograd.grad((w * o_l).sum(), leaves)):
        assert_close(a, b, f"{mode}: gradient", tol)


def test_a_layer_makes_no_parameter_of_a_const(op):
    """mixc.nn.MixerLayer learns params; a const's values are the spec's (no nn.Parameter)."""
    from mixc.nn import MixerLayer
    layer = MixerLayer(op, 16, 2, mode="torch", head_dims={"K": 4, "V": 4})
    assert not any(n.startswith("param_") for n, _ in layer.named_parameters())     # param_<name>: a param's
    y = layer(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2)))
    y = y[0] if isinstance(y, tuple) else y
    assert y.shape == (2, 5, 16) and torch.isfinite(y).all()


def test_a_sequence_mixer_reads_a_const():
    """gMLP's spatial gating unit scaled by a const (a sequence mixer: no state) equals the
    library's gmlp scaled by hand, in the reference and torch modes."""
    from mixc.dsl import read_spec
    text = read_spec("gmlp").text.replace("mixer gmlp", "mixer gmlp_scaled")
    text = text.replace("  output y = ", "  const  c[] = 3 / 4\n  output y = c * ").replace("+ b)", "+ b))") \
        .replace("c * z1", "c * (z1")
    scaled, base = from_text(text, "gmlp_scaled.mix"), from_text(read_spec("gmlp").text, "gmlp.mix")
    args, _ = random_args(base.ir, B=2, T=6, H=2, sizes={"D": 3}, dtype=torch.float64, seed=8)
    want = 0.75 * base(**args, mode="reference")[0]
    for mode in ("reference", "torch"):
        assert_close(scaled(**args, mode=mode)[0], want, f"gmlp scaled by a const, {mode}", 1e-10)


def test_fullgraph_compile_traces_the_consts(op):
    """torch.compile(fullgraph=True): the binder's const tensors trace as constants (no graph
    break), forward and the inputs' gradients equal eager."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 2 * 10)

    def model(x):
        q, k, v, g = proj(x).view(2, 5, 2, -1).split([3, 3, 3, 1], -1)
        o, _ = op(q=q, k=k, v=v, g=torch.nn.functional.logsigmoid(g[..., 0]), mode="recurrent")
        return o
    x = torch.randn(2, 5, 8)
    want = model(x)
    want_g = torch.autograd.grad(want.pow(2).sum(), list(proj.parameters()))
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    got_g = torch.autograd.grad(got.pow(2).sum(), list(proj.parameters()))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)

"""MixerLayer over every library spec: a prefill then token-by-token steps, and a prefill
continued by a second forward, equal the forward over the whole sequence; the spec's params
are module parameters that train; each role gives its paper's parametrization."""
import math

import pytest
import torch
import torch.nn.functional as F

import mixc
from mixc.nn import MixerLayer
from tests.nn.nn_specs import SPECS, layer_kwargs

B, T, D, H = 2, 20, 32, 2


def _layer(spec, T=T, **kw):
    torch.manual_seed(0)
    return MixerLayer(spec, D, H, mode="torch", **layer_kwargs(spec, T), **kw).double()


def _close(a, b, what):
    # The ops keep states in float32 (the CONVENTIONS), so a state handed from one call to the
    # next rounds to fp32: tight fp32 tolerances, not float64 ones.
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err < 2e-6, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("spec", SPECS, ids=[f"{s}-B{B}-T{T}-D{D}" for s in SPECS])
def test_prefill_then_steps_equal_forward(spec):
    layer = _layer(spec)
    x = torch.randn(B, T, D, dtype=torch.float64)
    y, none = layer(x)
    assert none is None and y.shape == (B, T, D) and torch.isfinite(y).all()
    y1, st = layer(x[:, :12], use_cache=True)
    outs = [y1]
    for t in range(12, T):
        yt, st = layer.step(x[:, t], st)
        assert yt.shape == (B, D)
        outs.append(yt[:, None])
    _close(torch.cat(outs, 1), y, "prefill 12 then 8 steps")
    y2, st2 = layer(x[:, 12:], state=layer(x[:, :12], use_cache=True)[1], use_cache=True)
    _close(torch.cat([y1, y2], 1), y, "prefill 12 then a forward over 8")
    assert layer.state_size(st2) > 0


@pytest.mark.parametrize("spec", SPECS)
def test_steps_from_an_empty_state(spec):
    """step(x, None) starts a fresh sequence (the state of a forward over zero tokens)."""
    layer = _layer(spec, T=6)
    x = torch.randn(B, 6, D, dtype=torch.float64)
    y, _ = layer(x)
    st, outs = None, []
    for t in range(6):
        yt, st = layer.step(x[:, t], st)
        outs.append(yt)
    _close(torch.stack(outs, 1), y, "steps from nothing")


@pytest.mark.parametrize("spec", SPECS)
def test_spec_params_are_trained_module_parameters(spec):
    layer = _layer(spec, T=8)
    names = dict(layer.named_parameters())
    for d in layer.op.ir.params:
        p = names[f"param_{d.name}"]
        H_ = layer.n_heads
        assert p.shape == (H_,) + tuple(layer.sizes[n] for n in d.shape)
    y, _ = layer(torch.randn(B, 8, D, dtype=torch.float64))
    y.square().sum().backward()
    for n, p in layer.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n


def _inputs(layer, x):
    inputs, _, _, _ = layer._project(x, None)
    return inputs


def test_roles_gla_gate_is_a_normalized_log_decay():
    layer = _layer("gla")
    g = _inputs(layer, torch.randn(B, T, D, dtype=torch.float64))["g"]
    assert g.shape == (B, T, H, D // H)
    assert (g <= 0).all() and (g > -F.softplus(torch.tensor(30.0)) / 16).all()
    # logsigmoid(x) / 16: about -log(2) / 16 for x near 0
    assert abs(g.median().item() + math.log(2) / 16) < 0.03


def test_roles_mamba2_init():
    layer = _layer("mamba2")
    p = layer.spec_params()
    assert ((p["A"] <= -1) & (p["A"] >= -16)).all()                 # A = -exp(A_log), A in [1, 16]
    dt = F.softplus(p["dt_bias"])
    assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all()       # softplus(dt_bias) log-uniform
    assert torch.equal(p["D"], torch.ones_like(p["D"]))
    assert layer.sizes["N"] == 16 and layer.sizes["P"] == D // H
    assert "param_A_log" not in dict(layer.named_parameters())        # stored as param_A, reparametrized


def test_roles_mamba_s4d_real_A():
    layer = _layer("mamba")
    A = layer.spec_params()["A"]                                      # [H, N, P]
    assert torch.allclose(A[0, :, 0], -torch.arange(1, 17, dtype=torch.float64))


def test_roles_delta_rule_beta_and_l2norm():
    layer = _layer("delta_rule")
    assert layer.options == {"use_qk_l2norm_in_kernel": True}
    beta = _inputs(layer, torch.randn(B, T, D, dtype=torch.float64))["beta"]
    assert beta.shape == (B, T, H) and ((beta > 0) & (beta < 1)).all()


def test_roles_gated_delta_rule_gate():
    layer = _layer("gated_delta_rule")
    names = dict(layer.named_parameters())
    assert "g_A_log" in names and "g_dt_bias" in names
    g = _inputs(layer, torch.randn(B, T, D, dtype=torch.float64))["g"]
    assert g.shape == (B, T, H) and (g < 0).all()


def test_roles_rwkv7_a_b():
    layer = _layer("rwkv7")
    i = _inputs(layer, torch.randn(B, T, D, dtype=torch.float64))
    assert torch.allclose(i["a"].norm(dim=-1), torch.ones(B, T, H, dtype=torch.float64))
    ratio = i["b"] / -i["a"]                                          # b = kk * sigmoid(.) with kk = -a
    assert ((ratio > 0) & (ratio < 1)).all()
    assert ((i["w"] < 0) & (i["w"] > -math.exp(-0.5))).all()


def test_roles_performer_features_are_frozen():
    layer = _layer("performer")
    assert not layer.param_W.requires_grad and layer.sizes["M"] == 32


def test_a_users_spec_gets_plain_projections(tmp_path):
    """Inputs the role table does not know get an identity projection, params N(0, 0.1)."""
    path = tmp_path / "mine.mix"
    path.write_text("mixer mine\n  dims K, V\n  input z[K], k[K], v[V], lam[]\n  param bonus[V]\n"
                    "  state S[K, V]\n  update S = exp(-softplus(lam)) * S + k * v\n"
                    "  output o = z @ S + bonus * v\n")
    torch.manual_seed(0)
    layer = MixerLayer(str(path), 24, 3, mode="torch", head_dims={"K": 4, "V": 6}).double()
    assert layer.shapes == {"z": (4,), "k": (4,), "v": (6,), "lam": ()}
    assert layer.param_bonus.shape == (3, 6)
    assert layer.conv_width == 3 * (4 + 6)                           # k and v are conv'ed, z and lam not
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    y, _ = layer(x)
    y1, st = layer(x[:, :4], use_cache=True)
    outs = [y1] + [layer.step(x[:, t], st)[0][:, None] for t in range(4, 5)]
    _close(torch.cat(outs, 1), y[:, :5], "user spec")


def test_head_dims_options_and_errors():
    layer = MixerLayer("gla", 32, 2, head_dims={"K": 8, "V": 24}, mode="torch", conv_size=0,
                       output_gate=False, options={"scale": 0.5})
    assert layer.conv is None and layer.sizes == {"K": 8, "V": 24}
    assert layer.in_proj.out_features == 2 * (8 + 8 + 24 + 8)
    assert layer(torch.randn(1, 5, 32))[0].shape == (1, 5, 32)
    with pytest.raises(ValueError, match="has dims K, V"):
        MixerLayer("gla", 32, 2, head_dims={"N": 4})
    with pytest.raises(ValueError, match="spec 'gla' has scale"):
        MixerLayer("gla", 32, 2, options={"window": 3})
    with pytest.raises(ValueError, match="give max_len"):
        MixerLayer("hyena", 32, 2)
    op = mixc.load("retention")
    assert MixerLayer(op, 16, 2).op is op                             # a loaded op is taken as is


def test_kernels_through_the_layer():
    """mode='auto' under TRITON_INTERPRET=1 (tests/conftest.py) runs the Triton kernels: the
    same layer gives the torch backend's output and gradients."""
    torch.manual_seed(0)
    layer = MixerLayer("simple_gla", 16, 2)
    x = torch.randn(1, 17, 16)
    y, _ = layer(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.mode = "torch"
    y2, _ = layer(x)
    y2.square().sum().backward()
    assert (y - y2).abs().max() < 1e-4
    for n, p in layer.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= 1e-3 * max(1.0, p.grad.abs().max().item()), n

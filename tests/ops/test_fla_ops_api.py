"""mixc.ops as a drop-in for fla 0.6's call sites: fla's signatures (read from fla's source),
errors that name the parameter (ArgumentError, never a TypeError), the parameters mixc honours
by translating them (state_v_first, reverse, g_gamma, gates and betas from raw values, ...),
gradients, and the signatures and docstrings of mixc.ops and of mixc.load's ops."""
from __future__ import annotations

import inspect
import pickle
import pydoc

import pytest
import torch
import torch.nn.functional as F

import mixc
import mixc.ops as ops
from fla_refs import delta_loop, fla_naive, fla_signature, kv_loop
from mixc.standalone.errors import ArgumentError

B, T, H, K, V = 2, 12, 2, 8, 6
ALIASES = {"chunk_gdn", "fused_recurrent_gdn"}


def _draw(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(q=n(B, T, H, K), k=n(B, T, H, K), v=n(B, T, H, V), gk=F.logsigmoid(n(B, T, H, K) + 2),
                g=F.logsigmoid(n(B, T, H) + 2), beta=torch.rand(B, T, H, generator=g) * 0.8 + 0.1,
                h0=n(B, H, K, V) * 0.5, raw=n(B, T, H), rawk=n(B, T, H, K), A_log=n(H) * 0.3, dt_bias=n(H) * 0.3,
                dt_bias_k=n(H * K) * 0.3)


def _close(x, want, tol=2e-4):
    err = (x.double() - want.double()).abs().max().item()
    assert err <= tol * (1 + want.double().abs().max().item()), f"max error {err:.3g}"


# ---- fla's signatures ----

@pytest.mark.parametrize("name", sorted(set(ops.__all__) - ALIASES))
def test_signature_is_fla_s(name):
    """fla's parameters in fla's order with fla's defaults; mixc adds keyword-only ones only
    (fla's **kwargs it reads, and mode)."""
    fn = getattr(ops, name)
    ours = [(p.name, "<required>" if p.default is p.empty else p.default,
             "keyword" if p.kind is p.KEYWORD_ONLY else "positional") for p in inspect.signature(fn).parameters.values()]
    fla = fla_signature(name, fn.fla_op.where)
    positional = [p for p in fla if p[2] == "positional"]
    assert ours[:len(positional)] == positional
    for p in fla[len(positional):]:
        assert p in ours, f"fla's keyword-only {p} missing"
    assert all(kind == "keyword" for _, _, kind in ours[len(positional):])


def test_signature_without_fla():
    """The same check for two functions, written out (it runs where fla is not installed)."""
    assert list(inspect.signature(ops.chunk_gla).parameters) == [
        "q", "k", "v", "g", "scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens",
        "cu_seqlens_cpu", "mode"]
    assert list(inspect.signature(ops.fused_recurrent_gla).parameters)[:6] == ["q", "k", "v", "gk", "gv", "scale"]
    assert inspect.signature(ops.fused_recurrent_rwkv7).parameters["output_final_state"].default is True
    assert inspect.signature(ops.chunk_rwkv7).parameters["scale"].default == 1.0


# ---- errors name the parameter ----

def _errors():
    x = _draw()
    q, k, v, g, gk, beta = x["q"], x["k"], x["v"], x["g"], x["gk"], x["beta"]
    return [
        ("missing", lambda: ops.chunk_gla(q, k, v), r"chunk_gla: missing a required argument: 'g'"),
        ("extra", lambda: ops.chunk_gla(q, k, v, gk, gk=gk), r"unexpected keyword argument 'gk'.*takes \(q, k, v, g"),
        ("positional", lambda: ops.chunk_gla(q, k, v, gk, None, None, False, False, None, None, 1),
         r"too many positional arguments"),
        ("not-a-tensor", lambda: ops.chunk_gla(q.tolist(), k, v, gk), r"^q: chunk_gla takes a tensor here, got list"),
        ("gv", lambda: ops.fused_recurrent_gla(q, k, v, gk, gv=v), r"^gv: fused_recurrent_gla on mixc cannot take gv"),
        ("output_attentions", lambda: ops.parallel_retention(q, k, v, output_attentions=True),
         r"^output_attentions: .*never forms them"),
        ("cp_context", lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object()),
         r"^cp_context: .*cp_group"),
        ("head_first", lambda: ops.chunk_simple_gla(q, k, v, g, head_first=False), r"^head_first: .*removed"),
        ("intermediate", lambda: ops.chunk_kda(q, k, v, gk, beta, return_intermediate_states=True),
         r"^return_intermediate_states:"),
        ("householder", lambda: ops.chunk_gated_delta_product(q, k, v, g, beta, 3), r"^num_householder: .*got 3"),
        ("forget-gate", lambda: ops.parallel_attn(q, k, v, g), r"^g: parallel_attn on mixc cannot take g"),
        ("sink", lambda: ops.parallel_attn(q, k, v, sink_bias=torch.zeros(H)), r"^sink_bias:"),
        ("neg-eigval", lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True),
         r"^allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True"),
        ("A_log", lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True), r"^A_log: needed"),
        ("beta-per-value", lambda: ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta=v), r"^beta: a beta per value"),
        ("lower_bound", lambda: ops.chunk_dplr_delta_rule(q, k, v, k, k, gk, lower_bound=1.0), r"^lower_bound: must be negative"),
        ("shape", lambda: ops.chunk_gla(q, k, v, gk[..., :3]), r"^chunk_gla \(mixc spec 'gla'\): g: dim K"),
        ("renamed", lambda: ops.fused_recurrent_gla(q, k, v, gk[..., :3]), r"gk as g\): g: dim K"),
        ("state", lambda: ops.chunk_gla(q, k, v, gk, initial_state={"S": x["h0"]}), r"^initial_state: chunk_gla takes a tensor"),
        ("state-shape", lambda: ops.chunk_gla(q, k, v, gk, initial_state=x["h0"][:1]), r"initial_state\['S'\]: expected shape"),
        ("flag", lambda: ops.chunk_gla(q, k, v, gk, output_final_state="yes"), r"output_final_state: expected True or False"),
        ("both-layouts", lambda: ops.fused_recurrent_simple_gla(q, k, v, g, state_v_first=True, transpose_state_layout=True),
         r"^transpose_state_layout: pass state_v_first or"),
        ("tuple-state", lambda: ops.chunk_linear_attn(q, k, v, initial_state=(x["h0"], None), normalize=False),
         r"^initial_state: a \(S, z\) tuple is read with normalize=True only"),
    ]


@pytest.mark.parametrize("call,match", [(c, m) for _, c, m in _errors()], ids=[i for i, _, _ in _errors()])
def test_errors_name_the_parameter(call, match):
    with pytest.raises(ArgumentError, match=match):
        call()


# ---- parameters honoured by translation (the torch backend: the translation is the same for every mode) ----

def test_state_v_first_and_its_old_name():
    x = _draw(1)
    q, k, v, gk, h0 = x["q"], x["k"], x["v"], x["gk"], x["h0"]
    o, S = ops.chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True, mode="torch")
    o1, S1 = ops.chunk_gla(q, k, v, gk, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                           state_v_first=True, mode="torch")
    _close(o1, o)
    _close(S1, S.transpose(-1, -2))
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o2, S2 = ops.fused_recurrent_gla(q, k, v, gk, initial_state=h0.transpose(-1, -2), output_final_state=True,
                                         transpose_state_layout=True, mode="torch")
    _close(S2, S1)


def test_reverse_with_packed_sequences():
    """reverse=True runs each packed sequence from its end: the loop on the flipped sequences."""
    x = _draw(2)
    q, k, v, gk = (x[n].reshape(1, B * T, H, -1) for n in ("q", "k", "v", "gk"))
    cu = torch.tensor([0, 5, B * T])
    o, S = ops.fused_recurrent_gla(q, k, v, gk, initial_state=x["h0"], output_final_state=True, reverse=True,
                                   cu_seqlens=cu)           # the recurrent kernels under TRITON_INTERPRET=1
    for i, (s, e) in enumerate([(0, 5), (5, B * T)]):
        flip = lambda t: t[:, s:e].flip(1)  # noqa: E731
        want_o, want_S = kv_loop(flip(q), flip(k), flip(v), flip(gk), K ** -0.5, x["h0"][i:i + 1])
        _close(o[:, s:e], want_o.flip(1))
        _close(S[i:i + 1], want_S)


def test_simple_gla_g_gamma_and_no_gate():
    x = _draw(3)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    gamma = -torch.rand(H) - 0.05
    o, S = ops.chunk_simple_gla(q, k, v, g, g_gamma=gamma, output_final_state=True, mode="torch")
    _close(o, kv_loop(q, k, v, (g + gamma)[..., None].expand(q.shape), K ** -0.5)[0])
    o, _ = ops.fused_recurrent_simple_gla(q, k, v, g_gamma=gamma, mode="torch")
    _close(o, kv_loop(q, k, v, gamma[None, None, :, None].expand(q.shape), K ** -0.5)[0])
    o, _ = ops.fused_recurrent_gla(q, k, v, mode="torch")          # no gate: no decay
    _close(o, kv_loop(q, k, v, torch.zeros_like(q), K ** -0.5)[0])


def test_gates_and_betas_from_raw_values():
    """use_gate_in_kernel, use_beta_sigmoid_in_kernel and allow_neg_eigval, computed as fla's
    kernels do (fla/ops/gated_delta_rule/gate.py, fla/ops/kda/gate.py), written out here."""
    x = _draw(4)
    q, k, v = x["q"], F.normalize(x["k"], dim=-1), x["v"]
    raw, rawk, A_log, dt_bias, dt_bias_k = x["raw"], x["rawk"], x["A_log"], x["dt_bias"], x["dt_bias_k"]
    beta = 2 * torch.sigmoid(raw)
    g = -A_log.exp() * F.softplus(raw + dt_bias)
    o, S = ops.chunk_gated_delta_rule(q, k, v, raw, raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                      output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, mode="torch")
    want_o, want_S = delta_loop(q, [k], [v], [beta], g[..., None].expand(q.shape), K ** -0.5)
    _close(o, want_o)
    _close(S, want_S)
    gk = -A_log.exp()[:, None] * F.softplus(rawk + dt_bias_k.view(H, K))
    o, _ = ops.fused_recurrent_kda(q, k, v, rawk, torch.sigmoid(raw), A_log, dt_bias_k, use_gate_in_kernel=True,
                                   mode="torch")
    _close(o, delta_loop(q, [k], [v], [torch.sigmoid(raw)], gk, K ** -0.5)[0])
    bounded = -5 * torch.sigmoid(A_log.exp()[:, None] * (rawk + dt_bias_k.view(H, K)))
    o, _ = ops.chunk_kda(q, k, v, rawk, torch.sigmoid(raw), use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         A_log=A_log, dt_bias=dt_bias_k, mode="torch")
    _close(o, delta_loop(q, [k], [v], [torch.sigmoid(raw)], bounded, K ** -0.5)[0])


def test_recurrent_gated_delta_rule_picks_the_spec():
    """g: gated_delta_rule; gk: kda (with g too: g + gk, as fla decays by both); neither: delta_rule."""
    x = _draw(5)
    q, k, v, g, gk, beta = x["q"], F.normalize(x["k"], dim=-1), x["v"], x["g"], x["gk"], x["beta"]
    o, _ = ops.fused_recurrent_gated_delta_rule(q, k, v, g, gk, beta=beta, mode="torch")
    _close(o, delta_loop(q, [k], [v], [beta], g[..., None] + gk, K ** -0.5)[0])
    o, _ = ops.fused_recurrent_gated_delta_rule(q, k, v, mode="torch")            # beta ones, no decay
    _close(o, delta_loop(q, [k], [v], [torch.ones(B, T, H)], torch.zeros_like(q), K ** -0.5)[0])


def test_linear_attn_normalized_state():
    """normalize=True: fla returns (S or None, z [N, 1, H, K]) even without output_final_state,
    and takes (S, z) back as initial_state."""
    x = _draw(6)
    q, k, v = x["q"].abs() + 0.1, x["k"].abs() + 0.1, x["v"]
    o, (S, z) = ops.chunk_linear_attn(q[:, :5], k[:, :5], v[:, :5], mode="torch")
    assert S is None and z.shape == (B, 1, H, K)
    _, (S, z) = ops.chunk_linear_attn(q[:, :5], k[:, :5], v[:, :5], output_final_state=True, mode="torch")
    o2, _ = ops.chunk_linear_attn(q[:, 5:], k[:, 5:], v[:, 5:], initial_state=(S, z), mode="torch")
    whole, _ = ops.chunk_linear_attn(q, k, v, mode="torch")
    _close(o2, whole[:, 5:])


def test_delta_product_of_one_step_is_the_gated_delta_rule():
    x = _draw(7)
    q, k, v, g, beta = x["q"], F.normalize(x["k"], dim=-1), x["v"], x["g"], x["beta"]
    o, _ = ops.chunk_gated_delta_product(q, k, v, g, beta, 1, mode="torch")
    _close(o, delta_loop(q, [k], [v], [beta], g[..., None].expand(q.shape), K ** -0.5)[0])


def test_packed_delta_product_against_fla():
    """cu_seqlens over fla's interleaved keys: fla's naive reference takes cu_seqlens too."""
    x = _draw(8)
    q, g = x["q"].reshape(1, B * T, H, K), x["g"].reshape(1, B * T, H)
    kk = F.normalize(torch.randn(1, 2 * B * T, H, K), dim=-1)
    vv, bb = torch.randn(1, 2 * B * T, H, V), torch.rand(1, 2 * B * T, H) * 0.8 + 0.1
    cu = torch.tensor([0, 7, B * T])
    o, S = ops.chunk_gated_delta_product(q, kk, vv, g, bb, 2, initial_state=x["h0"], output_final_state=True,
                                         cu_seqlens=cu, mode="torch")
    fo, fS = fla_naive("gated_delta_product/naive", "naive_recurrent_gated_delta_product")(
        q, kk, vv, g, bb, K ** -0.5, cu_seqlens=cu, initial_state=x["h0"], output_final_state=True, num_householder=2)
    _close(o, fo)
    _close(S, fS)


def test_gradients_through_the_chunked_kernels():
    """chunk_gla's backward (the chunked kernels under TRITON_INTERPRET=1) against autograd
    through the float64 loop, for q, k, v, g and the initial state."""
    x = _draw(9)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "gk", "h0")]
    o, S = ops.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True)
    do, dS = torch.randn_like(o), torch.randn_like(S)
    got = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    wo, wS = kv_loop(*ref[:4], K ** -0.5, ref[4])
    want = torch.autograd.grad((wo * do.double()).sum() + (wS * dS.double()).sum(), ref)
    for a, b in zip(got, want):
        _close(a, b, tol=5e-4)


# ---- help() and inspect.signature ----

@pytest.mark.parametrize("name", sorted(ops.__all__))
def test_docstring_from_the_spec(name):
    fn = getattr(ops, name)
    doc = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    d = fn.fla_op
    assert f"{d.where}.{d.name} of fla 0.6" in doc and "Spec '" in doc and "mixer " in doc
    for p in inspect.signature(fn).parameters:
        assert f"    {p}: " in fn.__doc__, f"{p} undocumented"
    for p in d.refused:
        assert "refused unless" in fn.__doc__.split(f"    {p}: ")[1].splitlines()[0]


@pytest.mark.parametrize("spec", ["gla", "mamba2", "swa"])
def test_loaded_op_signature_and_help(spec):
    op = mixc.load(spec)
    sig = inspect.signature(op)
    names = [d.name for d in (*op.ir.inputs, *op.ir.params)] + [o.name for o in op.ir.options]
    assert list(sig.parameters)[:len(names)] == names
    assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values())
    assert {"initial_state", "output_final_state", "cu_seqlens", "mode"} <= set(sig.parameters)
    text = pydoc.render_doc(op, renderer=pydoc.plaintext)
    assert f"{spec}(*, " in text and "Spec:" in text and f"mixer {spec}" in text
    assert inspect.signature(pickle.loads(pickle.dumps(op))) == sig


def test_loaded_op_option_defaults():
    sig = inspect.signature(mixc.load("gated_delta_rule"))
    assert sig.parameters["scale"].default is None                    # K ** -0.5: an expression of K
    assert sig.parameters["use_qk_l2norm_in_kernel"].default is False
    assert inspect.signature(mixc.load("rwkv7")).parameters["scale"].default == 1
    assert "scale: a number, default K ** -0.5 (None: the default)" in mixc.load("gla").__doc__

"""mixc's ops inside transformers models (mixc.integrations.transformers): a patched tiny random
model gives the prompt logits of transformers' own pure-torch path within fp32 tolerance, the
same recurrent states in the model's cache layout, and the same 16 greedy tokens, with the
prefill through the op and every decoded token through op.step; gradients match in training;
unpatch restores the class's forward; errors are named."""
import collections
import copy
import re
import types

import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next

from mixc.integrations import hf_cores
from mixc.integrations import transformers as mixc_hf
from mixc.runtime.signature import ArgumentError
from tests.integrations.hf_models import MODELS, SPEC_OF, VOCAB, build

B, PROMPT, NEW = 2, 8, 16


def _batch(name):
    # transformers 5.24's RWKV decode broadcasts the token shift of a [B, C] state against the
    # [B, 1, C] token (RwkvSelfAttention.extract_key_value): with B > 1 every sequence's key is
    # [B, C] wide and its greedy tokens differ from the sequence run alone; with B = 1 they equal a
    # recomputation. The patched model reproduces either; its test decodes one sequence.
    return 1 if name == "rwkv" else B


transformers.logging.set_verbosity_error()      # the fallback notices ("causal_conv1d is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|attention mask)")

# default runs: Qwen3-Next, Mamba and the Mamba-2 family (its copies cost ~0.1 s each once the
# op is loaded) in the torch backend, Qwen3-Next through the chunked kernels (Triton's
# interpreter), Kimi-Linear (KDA) in the torch backend; the other models and modes are slow
FAST = {("qwen3_next", "torch"), ("mamba", "torch"), ("jamba", "torch"), ("qwen3_next", "chunk"),
        ("kimi_linear", "torch"), ("rwkv", "torch")} | {
    (n, "torch") for n in ("mamba2", "bamba", "falcon_h1", "zamba2", "nemotron_h", "granite_moe_hybrid")}
CASES = [(n, "torch") for n in MODELS] + [(n, "chunk") for n in ("qwen3_next", "kimi_linear", "mamba2", "nemotron_h")] \
    + [(n, "recurrent") for n in ("mamba", "qwen3_next")] + [("rwkv", "chunk"), ("rwkv", "recurrent")]
PARAMS = [pytest.param(n, m, id=f"{n}-{m}-B{_batch(n)}-T{PROMPT}+{NEW}",
                       marks=() if (n, m) in FAST else pytest.mark.slow) for n, m in CASES]


def _prompt(name=None):
    return torch.randint(3, VOCAB, (_batch(name), PROMPT), generator=torch.Generator().manual_seed(1))



def _generate(model, ids):
    """(tokens [B, PROMPT + NEW], the logits of each generated token [NEW, B, vocab])."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _mixer_states(out, layers):
    """The recurrent state each mixer layer's decode continues from, in the model's layout.
    RWKV keeps (num, den, max) per layer in out.state[2:5] ([batch, C, layer] each): compared as
    the real numerator and denominator num * exp(max), den * exp(max), which the adapter keeps
    at another max (hf_cores._rwkv4)."""
    if getattr(out, "state", None) is not None:
        num, den, mx = (s[..., layers] for s in out.state[2:5])
        return {i: torch.stack([num * mx.exp(), den * mx.exp()])[..., j] for j, i in enumerate(layers)}
    return {i: out.cache.get_recurrent_state(i) for i in layers}


def _layer_index(module):
    return module.layer_idx if hasattr(module, "layer_idx") else module.layer_id       # RWKV: layer_id


def _count_op_calls(monkeypatch, spec):
    """Counts the op's sequence calls and single-token steps (the patched model's prefill and decode)."""
    calls, inside = collections.Counter(), []
    cls = type(hf_cores.spec_op(spec))
    call, step = cls.__call__, cls.step

    def counted_call(self, *a, **k):
        if not inside:                  # the torch backend's step calls the op on one token
            calls["call"] += 1
        return call(self, *a, **k)

    def counted_step(self, *a, **k):
        calls["step"] += 1
        inside.append(1)
        try:
            return step(self, *a, **k)
        finally:
            inside.pop()
    monkeypatch.setattr(cls, "__call__", counted_call)
    monkeypatch.setattr(cls, "step", counted_step)
    return calls


@pytest.mark.parametrize("name, mode", PARAMS)
def test_patched_model_matches_transformers(name, mode, monkeypatch):
    original = mixc_hf.torch_fallback(build(name))        # transformers' pure-torch path, whatever is installed
    mixers = mixc_hf.find_mixers(original)
    spec = SPEC_OF.get(name, "mamba2")
    assert set(mixers.values()) == {spec}
    layers = sorted(_layer_index(m) for n, m in original.named_modules() if n in mixers)
    patched = mixc_hf.patch(copy.deepcopy(original), mode=mode)
    assert mixc_hf.patched(patched) == {n: (spec, mode) for n in mixers}
    ids = _prompt(name)
    with torch.no_grad():
        ref = original(ids, use_cache=True)
        calls = _count_op_calls(monkeypatch, spec)
        out = patched(ids, use_cache=True)
        assert calls == {"call": len(layers)}, "the prefill did not run through mixc's op"
        scale = max(1.0, ref.logits.abs().max().item())
        err = (out.logits - ref.logits).abs().max().item()
        assert err <= 1e-5 * scale, f"prompt logits differ by {err:.2e} (scale {scale:.1f})"
        # the state the decode continues from, in the cache's own layout and dtype
        want, got = _mixer_states(ref, layers), _mixer_states(out, layers)
        for i in layers:
            assert got[i].shape == want[i].shape and got[i].dtype == want[i].dtype
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5 * want[i].abs().max().item())
        monkeypatch.undo()
        expected, expected_logits = _generate(original, ids)
        calls = _count_op_calls(monkeypatch, spec)
        tokens, logits = _generate(patched, ids)
    assert calls == {"call": len(layers), "step": (NEW - 1) * len(layers)}, "decode did not run through op.step"
    assert tokens.shape == (_batch(name), PROMPT + NEW)
    assert torch.equal(tokens, expected), f"greedy tokens differ:\n{tokens[:, PROMPT:]}\n{expected[:, PROMPT:]}"
    # min_new_tokens masks the end-of-text logits with -inf (the same in both)
    finite = expected_logits.isfinite()
    err = (logits - expected_logits)[finite].abs().max().item()
    assert torch.equal(logits.isfinite(), finite) and err <= 1e-5 * scale, f"decoded logits differ by {err:.2e}"


@pytest.mark.parametrize("name", ["mamba2", "rwkv", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_training_gradients_match(name):
    """model.train() without a cache takes the fused path (mamba_split_conv1d_scan_combined),
    which the patch turns off: the unfused path runs through mixc's op, with autograd."""
    original = mixc_hf.torch_fallback(build(name)).train()
    patched = mixc_hf.patch(copy.deepcopy(original), mode="torch")
    ids = _prompt()
    grads = []
    for model in (original, patched):
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    mixer_grads = [n for n in grads[0] if any(p in n for p in ("A_log", "dt_bias", "time_decay", "time_first"))]
    assert mixer_grads, "no gradient reached the mixer's own parameters"
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5 * max(1.0, g.abs().max().item()), msg=n)


def _swapped(layer):
    """What a patch changes in a layer: its forward (the globals route) and the forwards of its
    private kernel functions (the kernel route, transformers 5.25)."""
    funcs = layer.__dict__.get("_kernel_funcs", {})
    return {"forward": layer.__dict__.get("forward"), **{k: f.__dict__.get("forward") for k, f in funcs.items()}}


def test_unpatch_restores_the_class_forward_and_nothing_global_changes():
    module_fn = modeling_qwen3_next.torch_chunk_gated_delta_rule
    module_state = dict(getattr(module_fn, "__dict__", {}))
    model = build("qwen3_next")
    layer = model.model.layers[0].linear_attn
    assert not any(_swapped(layer).values())
    mixc_hf.patch(model, mode="torch")
    assert any(_swapped(layer).values()) and mixc_hf.patched(model)
    assert modeling_qwen3_next.torch_chunk_gated_delta_rule is module_fn       # the module is untouched
    assert dict(getattr(module_fn, "__dict__", {})) == module_state            # (5.25: a kernels module)
    other = build("qwen3_next", seed=1).model.layers[0].linear_attn
    assert not any(_swapped(other).values())                                   # other models too
    assert mixc_hf.unpatch(model) is model
    assert not any(_swapped(layer).values()) and mixc_hf.patched(model) == {}
    assert layer.forward.__func__ is type(layer).forward


def test_patch_again_replaces_the_mode():
    model = mixc_hf.patch(build("mamba"), mode="torch")
    mixc_hf.patch(model, mode="reference")
    assert set(mixc_hf.patched(model).values()) == {("mamba", "reference")}


def test_errors_name_the_problem():
    with pytest.raises(ArgumentError, match=r"model: expected a torch.nn.Module .*got str"):
        mixc_hf.patch("Qwen/Qwen3-Next")
    with pytest.raises(ArgumentError, match=r"mode: expected one of .*got 'fast'"):
        mixc_hf.patch(build("mamba"), mode="fast")
    with pytest.raises(ArgumentError, match=r"model: Sequential has no mixer layer mixc can patch"):
        mixc_hf.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ArgumentError, match=r"mode='chunk': layer backbone.layers.0.mixer runs mixc's mamba, "
                                            r"which has no chunked form"):
        mixc_hf.patch(build("mamba"), mode="chunk")


# a layer built as transformers 5.25 builds Qwen3-Next's when the `kernels` package is missing or
# of a version it does not accept (use_kernelized_func is then a no-op): its forward calls the
# core itself but the conv through causal_conv1d_forward, whose own globals a copied forward
# cannot reach. Patching its core alone would let packed sequences leak through the conv.
def causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
    return torch.nn.functional.conv1d(hidden_states, conv1d.weight, padding=3, groups=hidden_states.shape[1])[
        ..., :hidden_states.shape[-1]]


def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
    return value, None


class _PlainGatedDeltaNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(8, 8, 4, groups=8)

    def forward(self, hidden_states, cache=None, **kwargs):
        x = causal_conv1d_forward(self.conv1d, hidden_states.transpose(1, 2), cache, 0, **kwargs).transpose(1, 2)
        q = x[..., None, :]
        return torch_chunk_gated_delta_rule(q, q, q, g=x[..., :1], beta=x[..., :1], **kwargs)[0]


def test_a_layer_mixc_cannot_take_over_whole_is_refused_by_name_and_version():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _PlainGatedDeltaNet(), _PlainGatedDeltaNet())
    assert mixc_hf.find_mixers(model) == {"1": "gated_delta_rule", "2": "gated_delta_rule"}
    version = re.escape(transformers.__version__)
    with pytest.raises(ArgumentError, match=rf"layer 1 \(_PlainGatedDeltaNet, transformers {version}\): its forward "
                                            r"calls causal_conv1d_forward, .*mixc patches no layer"):
        mixc_hf.patch(model, mode="torch")
    assert mixc_hf.patched(model) == {} and not any("forward" in m.__dict__ for m in model)


def test_a_kernelized_scan_wrapper_is_refused_and_nothing_is_patched():
    """transformers 5.25 lets kernelize() replace a layer's mamba2_scan_forward (the scan with its
    cache handling); mixc's core inside it would then never be called. patch() refuses the model,
    naming the layer, and leaves every layer as it was (the first layer, which it could patch,
    too)."""
    model = build("mamba2")
    layers = [m for n, m in model.named_modules() if n in mixc_hf.find_mixers(model)]
    if "mamba2_scan_forward" not in layers[1].__dict__.get("_kernel_funcs", {}):
        pytest.skip(f"transformers {transformers.__version__}'s Mamba2Mixer calls no mamba2_scan_forward")
    wrapper = layers[1]._kernel_funcs["mamba2_scan_forward"]
    wrapper.forward = types.MethodType(lambda self, *args, **kwargs: None, wrapper)     # as kernelize does
    before = [_swapped(layer) for layer in layers]
    with pytest.raises(ArgumentError, match=r"layer backbone.layers.1.mixer \(Mamba2Mixer, transformers "
                                            rf"{re.escape(transformers.__version__)}\): its mamba2_scan_forward "
                                            r"was replaced \(kernelize\)"):
        mixc_hf.patch(model, mode="torch")
    assert mixc_hf.patched(model) == {} and [_swapped(layer) for layer in layers] == before

"""MixerLM: cached generation equals recomputing the whole prefix, for every library spec and a
hybrid; sampling; hybrid stacks; a few training steps lower the loss."""
import pytest
import torch
import torch.nn.functional as F

from mixc.nn import MixerLM, generate, layer_specs, sample
from tests.nn.nn_specs import SPECS, layer_kwargs

VOCAB, D, PROMPT, NEW = 17, 16, 5, 4


def _model(specs, **kw):
    torch.manual_seed(0)
    spec = specs if isinstance(specs, str) else specs[0]
    lk = layer_kwargs(spec, PROMPT + NEW)
    return MixerLM(VOCAB, D, 2, specs, n_heads=2, mode="torch", layer_kwargs=lk, **kw).double().eval()


def _check_generation(model, B=2):
    prompt = torch.randint(0, VOCAB, (B, PROMPT), generator=torch.Generator().manual_seed(1))
    ids, logits = model.generate(prompt, NEW, return_logits=True)
    assert ids.shape == (B, PROMPT + NEW) and torch.equal(ids[:, :PROMPT], prompt)
    for i in range(NEW):
        with torch.no_grad():
            full = model(ids[:, :PROMPT + i])[0][:, -1]                   # recompute the whole prefix
        err = (logits[:, i] - full).abs().max().item()
        assert err < 1e-5 * max(1.0, full.abs().max().item()), f"token {i}: logits differ by {err:.2e}"
        assert torch.equal(full.argmax(-1), ids[:, PROMPT + i]), f"token {i}: greedy choice differs"


@pytest.mark.parametrize("spec", SPECS, ids=[f"{s}-B2-T{PROMPT}+{NEW}-D{D}" for s in SPECS])
def test_cached_generation_equals_recomputation(spec):
    _check_generation(_model(spec))


def test_hybrid_generation_equals_recomputation():
    model = _model("gla", attention_every=2)
    assert model.specs == ["gla", "attention"]
    _check_generation(model)


def test_mixed_stack_generation():
    """Any list of specs, one per layer, each with its own state in the cache."""
    torch.manual_seed(0)
    model = MixerLM(VOCAB, D, specs=["mamba2", "delta_rule", "retention"], n_heads=2, mode="torch").double().eval()
    assert model.specs == ["mamba2", "delta_rule", "retention"]
    _check_generation(model, B=3)
    _, state = model(torch.zeros(1, 7, dtype=torch.long), use_cache=True)
    assert len(state) == 3 and model.state_size(state) == 2 * (16 * 8) + 2 * (8 * 8) + 2 * (8 * 8)


def test_layer_specs():
    assert layer_specs("gla", 3) == ["gla"] * 3
    assert layer_specs("gla", 8, attention_every=4) == ["gla"] * 3 + ["attention"] + ["gla"] * 3 + ["attention"]
    assert layer_specs("mamba2", 2, 2, "swa") == ["mamba2", "swa"]
    with pytest.raises(ValueError):
        layer_specs("gla", 2, 0)
    with pytest.raises(ValueError, match="one spec"):
        MixerLM(VOCAB, D, specs=["gla", "gla"], attention_every=2)
    m = MixerLM(VOCAB, D, 2, "gla", attention_every=2, n_heads=2, layer_kwargs={"conv_size": 0},
                per_spec_kwargs={"attention": {"output_gate": False}})
    assert [b.mixer.output_gate for b in m.blocks] == [True, False]
    assert all(b.mixer.conv is None for b in m.blocks)


def test_sampling():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    assert sample(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}                        # top-2 only
    model = _model("retention")
    prompt = torch.zeros(2, 3, dtype=torch.long)
    a = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (2, 9)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    model = MixerLM(VOCAB, 32, 2, "gla", n_heads=2, mode="torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(24).remainder(VOCAB)[None].repeat(4, 1)
    losses = []
    for _ in range(15):
        logits, _ = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_docs_example_runs():
    """docs/nn.md's first python block runs as written."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "nn.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    env = {}
    exec(compile(code, "docs/nn.md", "exec"), env)
    assert env["model"].specs == ["mamba2"] * 3 + ["attention"] and env["ids"].shape == (1, 13)
    assert env["y2"].shape == (2, 64)


@pytest.mark.parametrize("spec", ["gla", "gated_delta_rule"], ids=lambda s: f"{s}-B2-T{PROMPT}+{NEW}-D{D}-float32")
def test_a_float32_model_in_reference_mode_runs_and_matches_mode_torch(spec):
    """mode="reference" computes the op in float64 and returns float64: the layer around it keeps
    the model's float32 (it raised "expected m1 and m2 to have the same dtype" in the output
    projection); the logits equal mode torch's to float32 precision, and generation works."""
    torch.manual_seed(0)
    lk = layer_kwargs(spec, PROMPT + NEW)
    ref = MixerLM(VOCAB, D, 2, spec, n_heads=2, mode="reference", layer_kwargs=lk).eval()
    fast = MixerLM(VOCAB, D, 2, spec, n_heads=2, mode="torch", layer_kwargs=lk).eval()
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = ref(ids)[0], fast(ids)[0]
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    out = ref.generate(ids, 2)
    assert out.shape == (2, PROMPT + 2)

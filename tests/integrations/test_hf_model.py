"""mixc's language model as a transformers model (mixc.integrations.hf_model): the Auto classes
build it from AutoConfig.for_model('mixc', ...), save_pretrained / from_pretrained round-trip it
(the spec travels in config.json: a library name, or a user spec's text), and generate() with a
MixcCache gives MixerLM's own greedy tokens, and the tokens of a loop that recomputes the whole
prefix every step; beam search reorders the cache; the loss is the shifted cross-entropy."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache

from mixc.integrations import hf_model
from mixc.integrations.hf_model import MixcCache, MixcConfig, MixcForCausalLM, MixcModel
from mixc.nn import MixerLM

transformers.logging.set_verbosity_error()      # the load report, the generation-config notices

VOCAB, B, PROMPT, NEW = 29, 2, 6, 8

# a user's spec (inputs the role table does not know, a param): its text is what the config keeps
USER_SPEC = ("mixer mine\n  dims K, V\n  input z[K], k[K], v[V], lam[]\n  param bonus[V]\n"
             "  state S[K, V]\n  update S = exp(-softplus(lam)) * S + k * v\n"
             "  output o = z @ S + bonus * v\n")

CASES = {
    "gla": dict(spec="gla"),
    "user-spec": dict(spec=USER_SPEC, layer_kwargs={"head_dims": {"K": 4, "V": 6}}),
    "gla+attention": dict(spec="gla", attention_every=2),        # a KV cache beside a recurrent state
}


def _config(case, **kw):
    return AutoConfig.for_model("mixc", vocab_size=VOCAB, d_model=24, n_layers=2, n_heads=2, mode="torch",
                                **CASES[case], **kw)


def _model(case, seed=0, **kw):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(case, **kw)).eval()


def _prompt(seed=1):
    return torch.randint(0, VOCAB, (B, PROMPT), generator=torch.Generator().manual_seed(seed))


def _recompute(model, prompt, n):
    """Greedy decoding without a cache: the whole prefix through forward() at every step."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("case", ["gla", "user-spec"])
def test_auto_classes_build_save_load_and_generate(case, tmp_path):
    model = _model(case)
    assert isinstance(model, MixcForCausalLM) and isinstance(model.config, MixcConfig)
    assert isinstance(model.model, MixerLM)                    # mixc.nn's model, not a second one
    assert model.config.hidden_size == 24 and model.config.num_hidden_layers == 2
    prompt = _prompt()

    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    assert isinstance(out.cache, MixcCache) and out.cache.get_seq_length() == PROMPT + NEW - 1
    own, own_logits = model.model.generate(prompt, NEW, return_logits=True)
    assert torch.equal(out.sequences, own), "generate() differs from MixerLM.generate"
    hf_logits = torch.stack(out.logits, 1)
    assert (hf_logits - own_logits).abs().max() <= 1e-5 * own_logits.abs().max()
    assert torch.equal(out.sequences, _recompute(model, prompt, NEW)), "generate() differs from recomputation"

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mixc" and saved["spec"] == CASES[case]["spec"]     # the text itself
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MixcForCausalLM and loaded.config.spec == model.config.spec
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert loaded.model.head.weight is loaded.model.embed.weight                       # tied again
    assert torch.equal(loaded.generate(prompt, max_new_tokens=NEW, do_sample=False), own)

    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is MixcModel
    h = base(prompt).last_hidden_state
    assert torch.equal(loaded.model.head(h), loaded(prompt).logits)


def test_hybrid_cache_beam_search_and_sampling():
    """A KV cache beside a recurrent state; beam search reorders the MixcCache along the batch
    (the same beams as without a cache); sampled sequences with a seed are the cache-free ones."""
    model = _model("gla+attention")
    assert model.model.specs == ["gla", "attention"]
    prompt = _prompt(2)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), _recompute(model, prompt, NEW))
    beams = dict(max_new_tokens=5, num_beams=3, do_sample=False, early_stopping=False)
    assert torch.equal(model.generate(prompt, **beams), model.generate(prompt, use_cache=False, **beams))
    samples = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        samples.append(model.generate(prompt, max_new_tokens=5, do_sample=True, top_k=5, num_return_sequences=2,
                                      use_cache=use_cache))
    assert samples[0].shape == (2 * B, PROMPT + 5) and torch.equal(*samples)


def test_a_given_cache_continues_and_other_caches_are_refused():
    model = _model("gla")
    prompt = _prompt(3)
    cache = MixcCache(model.config)
    with torch.no_grad():
        first = model(prompt[:, :4], cache=cache, use_cache=True)
        second = model(prompt[:, 4:], cache=first.cache, use_cache=True)
        whole = model(prompt, use_cache=False).logits
    assert second.cache is cache and cache.get_seq_length() == PROMPT
    assert (second.logits - whole[:, 4:]).abs().max() <= 1e-5 * whole.abs().max()
    with pytest.raises(TypeError, match="MixcCache"):
        model(prompt, cache=DynamicCache(), use_cache=True)
    mask = torch.ones_like(prompt)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        model.generate(prompt, attention_mask=mask, max_new_tokens=2)


def test_loss_and_training_step():
    model = _model("gla").train()
    ids = _prompt(4)
    out = model(ids, labels=ids)
    ref = F.cross_entropy(model.model(ids)[0][:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert out.cache is None and torch.allclose(out.loss, ref)
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad), "a parameter got no grad"


def test_config_spec_forms(tmp_path):
    path = tmp_path / "mine.mix"
    path.write_text(USER_SPEC)
    assert MixcConfig(spec=str(path)).spec == USER_SPEC                # a path's text, not the path
    cfg = MixcConfig(spec=["gla", USER_SPEC], n_layers=2)
    assert MixcConfig.from_dict(cfg.to_dict()).spec == ["gla", USER_SPEC]
    with pytest.raises(ValueError, match="not a library spec"):
        MixcConfig(spec="no_such_spec")
    with pytest.raises(ValueError, match="one per layer"):
        MixcConfig(spec=["gla"], n_layers=2)
    with pytest.raises(ValueError, match="positive int"):
        MixcConfig(d_model=0)
    hf_model.register()                                                 # idempotent
    assert AutoConfig.for_model("mixc").model_type == "mixc"

"""A patched tiny model in bfloat16 against the same model unpatched in bfloat16 (transformers'
pure-torch path) and in float32. mixc's ops take bf16 inputs, compute in float32 and return bf16;
transformers' paths compute partly in bf16 (Mamba-2's torch_forward) and partly in float32
(Qwen3-Next's, RWKV's loops), so the two bf16 models differ by bf16 roundings, not by fp32 ones.

Measured (tests/integrations/hf_models.py, B2-T8+16, RWKV B1; logit scale = the float32
model's largest |logit|, 3.7-7.3): prompt logits of patched vs unpatched bf16 within 0 (Qwen3-Next,
Kimi-Linear: both round the same float32 core) to 1.3e-2 of the scale (Bamba), 2.5 bf16 ulps at
most; the patched bf16 model is as close to the float32 one as transformers' bf16 path is (ratio
0.8-1.2). Greedy tokens equal for Qwen3-Next, Mamba-2, Mamba and RWKV in mode torch. Where they
differ (NemotronH torch, Mamba-2 chunk), it is a bf16 near-tie: the float32 model's two
candidates are within the tolerance, and mixc's pick was the float32 model's."""
import copy

import pytest
import torch
import transformers

from mixc.integrations import transformers as mixc_hf
from tests.integrations.hf_models import VOCAB, build

PROMPT, NEW = 8, 16
TOL = 2e-2              # of the logit scale: 2.5 bf16 ulps (2^-8 relative) of the largest logit
transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|attention mask)")

# (model, mode, whether the greedy tokens must be identical; else a divergence must be a near-tie)
CASES = [("qwen3_next", "torch", True), ("mamba2", "torch", True), ("mamba", "torch", True),
         ("rwkv", "torch", True)]
SLOW = [("bamba", "torch", False), ("nemotron_h", "torch", False), ("qwen3_next", "chunk", False),
        ("mamba2", "chunk", False), ("rwkv", "chunk", False), ("mamba", "recurrent", False)]
PARAMS = [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in CASES] + [
    pytest.param(*c, id=f"{c[0]}-{c[1]}", marks=pytest.mark.slow) for c in SLOW]


def _generate(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("name, mode, exact", PARAMS)
def test_bf16_patched_model_matches_bf16_transformers(name, mode, exact):
    batch = 1 if name == "rwkv" else 2          # transformers' RWKV decode: test_transformers._batch
    ids = torch.randint(3, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    f32 = mixc_hf.torch_fallback(build(name))
    original = copy.deepcopy(f32).to(torch.bfloat16)
    patched = mixc_hf.patch(copy.deepcopy(original), mode=mode)
    with torch.no_grad():
        want32 = f32(ids).logits
        ref, out = original(ids).logits, patched(ids).logits
        expected, expected_logits = _generate(original, ids)
        tokens, logits = _generate(patched, ids)
    assert out.dtype == ref.dtype          # bf16 (Mamba's heads return float32 logits from bf16 weights)
    ref, out = ref.float(), out.float()
    scale = want32.abs().max().item()
    err = (out - ref).abs().max().item()
    assert err <= TOL * scale, f"prompt logits: bf16 patched vs unpatched differ by {err:.3g} (scale {scale:.2f})"
    # no further from the float32 model than transformers' own bf16 path (plus a quarter ulp)
    mine, theirs = (out - want32).abs().max().item(), (ref - want32).abs().max().item()
    assert mine <= 1.5 * theirs + 1e-3 * scale, f"bf16 error vs float32: mixc {mine:.3g}, transformers {theirs:.3g}"

    differ = (tokens != expected).any(0).nonzero()
    steps = NEW if len(differ) == 0 else differ[0].item() - PROMPT      # generated steps that agree
    if exact:
        assert steps == NEW, f"greedy tokens differ:\n{tokens[:, PROMPT:]}\n{expected[:, PROMPT:]}"
    # the logits of every agreeing step (min_new_tokens masks the end-of-text logit in both)
    finite = expected_logits[:steps].isfinite()
    err = (logits[:steps] - expected_logits[:steps])[finite].abs().max().item() if steps else 0.0
    assert err <= TOL * scale, f"generated logits differ by {err:.3g} (scale {scale:.2f})"
    if steps < NEW:
        # a near-tie: at the first step where they part, the float32 model ranks the two picks
        # within the tolerance
        row = (tokens[:, PROMPT + steps] != expected[:, PROMPT + steps]).nonzero()[0].item()
        with torch.no_grad():
            last = f32(tokens[row:row + 1, :PROMPT + steps]).logits[0, -1]
        a, b = tokens[row, PROMPT + steps], expected[row, PROMPT + steps]
        gap = (last[a] - last[b]).abs().item()
        assert gap <= TOL * scale, f"step {steps}: tokens {a.item()} vs {b.item()} are {gap:.3g} apart in float32"

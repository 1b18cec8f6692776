"""Packed sequences through a patched model: several sequences laid end to end in a row, their
starts given as transformers gives them (mamba_ssm's seq_idx for the Mamba-2 family,
flash-attention's cu_seq_lens_q for Qwen3-Next, OlmoHybrid and Kimi-Linear, both from
DataCollatorWithFlattening), give each sequence's logits as the unpatched model run on that
sequence alone. transformers' own torch path refuses seq_idx ("can't keep packed sequences
apart without causal_conv1d") and lets cu_seq_lens_q leak through its conv; the patch keeps
them apart in the op (cu_seqlens) and in the causal conv (hf_packing.packed_conv), which
transformers 5.25 calls from inside causal_conv1d_forward (the layer's private kernel function
causal_conv1d_fn: test_mixer_layer_keeps_packed_sequences_apart)."""
import copy

import pytest
import torch
import transformers

from mixc.integrations import transformers as mixc_hf
from mixc.runtime.signature import ArgumentError
from tests.integrations.hf_models import VOCAB, build

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|attention mask)")

ROWS = [[5, 3], [2, 6]]         # two rows of 8 tokens, two sequences each (seq_idx)
ONE_ROW = [5, 3, 6]             # cu_seq_lens_q: one row of 14 tokens
CASES = [("mamba2", "seq_idx", "torch"), ("qwen3_next", "cu_seq_lens_q", "torch")]
# GraniteMoeHybrid is not here: its model builds the attention layers' mask without position_ids,
# so a packed row leaks through its (sdpa) attention layer whatever the mixers do
SLOW = [(n, "seq_idx", "torch") for n in ("bamba", "falcon_h1", "zamba2", "nemotron_h")] + [
    ("olmo_hybrid", "cu_seq_lens_q", "torch"), ("qwen3_next", "seq_idx", "torch"),
    ("kimi_linear", "cu_seq_lens_q", "torch"), ("kimi_linear", "seq_idx", "torch"),
    ("mamba2", "seq_idx", "chunk"), ("qwen3_next", "cu_seq_lens_q", "chunk")]
PARAMS = [pytest.param(*c, id="-".join(c)) for c in CASES] + [
    pytest.param(*c, id="-".join(c), marks=pytest.mark.slow) for c in SLOW]


def _packed_batch(how, gen):
    """(input_ids [rows, T], the model's packing kwargs, [(row, start, length)] of each sequence)."""
    rows = ROWS if how == "seq_idx" else [ONE_ROW]
    ids = torch.randint(3, VOCAB, (len(rows), sum(rows[0])), generator=gen)
    spans = [(r, sum(lens[:i]), n) for r, lens in enumerate(rows) for i, n in enumerate(lens)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])
    kwargs = {"position_ids": positions}
    if how == "seq_idx":
        kwargs["seq_idx"] = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
                                         for lens in rows]).to(torch.int32)
    else:
        cu = torch.tensor([0] + torch.tensor(ONE_ROW).cumsum(0).tolist(), dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(ONE_ROW), max_length_k=max(ONE_ROW))
    return ids, kwargs, spans


def _logits(model, ids, **kwargs):
    """The head over the base model's output: Mamba2ForCausalLM (transformers 5.24) does not pass
    its keyword arguments on to the backbone, so seq_idx reaches the mixers from Mamba2Model only."""
    hidden = model.base_model(ids, use_cache=False, **kwargs).last_hidden_state
    return model.get_output_embeddings()(hidden)


@pytest.mark.parametrize("name, how, mode", PARAMS)
def test_packed_sequences_equal_each_sequence_alone(name, how, mode):
    original = mixc_hf.torch_fallback(build(name))
    patched = mixc_hf.patch(copy.deepcopy(original), mode=mode)
    ids, kwargs, spans = _packed_batch(how, torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = _logits(patched, ids, **kwargs)
        unmarked = _logits(patched, ids, position_ids=kwargs["position_ids"])
        leak = 0.0
        for row, start, n in spans:
            alone = _logits(original, ids[row:row + 1, start:start + n])[0]
            got = packed[row, start:start + n]
            scale = max(1.0, alone.abs().max().item())
            err = (got - alone).abs().max().item()
            # measured 4e-7 to 2e-6 of the scale, Qwen3-Next 1.5e-5 (its attention runs the packed
            # row under a block-diagonal mask, its MoE over more tokens): 1e-4
            assert err <= 1e-4 * scale, f"sequence at row {row}, {start}:{start + n}: logits differ by {err:.2e}"
            leak = max(leak, (unmarked[row, start:start + n] - alone).abs().max().item())
    # the same row without the packing kwargs mixes the sequences: the test can see a leak
    assert leak > 1e-2, f"the sequences do not interact even unmarked ({leak:.2e}): the test proves nothing"


def test_transformers_own_torch_path_refuses_seq_idx():
    """Why the patch wraps the conv too: transformers without causal_conv1d refuses seq_idx in
    its conv (and torch_fallback's unwrapped conv would let the sequences leak)."""
    try:
        import causal_conv1d  # noqa: F401
        pytest.skip("causal_conv1d is installed: transformers keeps packed sequences apart itself")
    except ImportError:
        pass
    ids, kwargs, _ = _packed_batch("seq_idx", torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="packed sequences"):
        _logits(build("mamba2"), ids, **kwargs)


LAYER_LENS = [5, 3, 6]          # one row of 14 tokens, three sequences


def _mixer(model):
    names = mixc_hf.find_mixers(model)
    return next(m for n, m in model.named_modules() if n in names)


def _layer_marks(how):
    cu = torch.tensor([0] + torch.tensor(LAYER_LENS).cumsum(0).tolist(), dtype=torch.int32)
    if how == "seq_idx":
        return {"seq_idx": torch.cat([torch.full((n,), i) for i, n in enumerate(LAYER_LENS)])[None].to(torch.int32)}
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LAYER_LENS), "max_length_k": max(LAYER_LENS)}


def _run(layer, hidden, **kwargs):
    out = layer(hidden_states=hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("how", ["cu_seq_lens_q", "seq_idx"])
@pytest.mark.parametrize("name", ["qwen3_next", "olmo_hybrid", "kimi_linear", "mamba2", "bamba"])
def test_mixer_layer_keeps_packed_sequences_apart(name, how):
    """One patched mixer layer on a packed row equals the unpatched layer on each sequence alone:
    its short conv and its core both keep the sequences apart. transformers 5.25 calls the conv
    through causal_conv1d_forward, where a patch of the forward's globals never reached it (the
    sequences leaked, logits 3.7-5.5 off, nothing raised); the Mamba-2 family's scan ignored
    cu_seq_lens_q (mamba_ssm's signature has no place for it)."""
    original = mixc_hf.torch_fallback(build(name))
    patched = mixc_hf.patch(copy.deepcopy(original), mode="torch")
    hidden = torch.randn(1, sum(LAYER_LENS), 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = _run(_mixer(patched), hidden, **_layer_marks(how))
        unmarked = _run(_mixer(patched), hidden)
        start, leak = 0, 0.0
        for n in LAYER_LENS:
            alone = _run(_mixer(original), hidden[:, start:start + n])
            scale = max(1.0, alone.abs().max().item())
            err = (packed[:, start:start + n] - alone).abs().max().item()
            assert err <= 1e-5 * scale, f"{how}: tokens {start}:{start + n} differ from the sequence alone by {err:.2e}"
            leak = max(leak, (unmarked[:, start:start + n] - alone).abs().max().item())
            start += n
    assert leak > 1e-3, f"the sequences do not interact even unmarked ({leak:.2e}): the test proves nothing"


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_mamba_layers_refuse_packed_sequences(name):
    """transformers' Mamba layers pass the packing marks to their conv but not to their scan
    (mamba_scan_forward calls mamba_selective_scan without them): a patched layer refuses them,
    where it kept the conv apart and mixed the scan (1e-2 to 0.3 off, nothing raised)."""
    layer = _mixer(mixc_hf.patch(build(name), mode="torch"))
    hidden = torch.randn(1, sum(LAYER_LENS), 32, generator=torch.Generator().manual_seed(0))
    for how in ("cu_seq_lens_q", "seq_idx"):
        with pytest.raises(ArgumentError, match=r"packed sequences .*pass no packing marks to their scan"):
            _run(layer, hidden, **_layer_marks(how))
    _run(layer, hidden)             # without marks it runs

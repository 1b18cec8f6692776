"""Put mixc's ops inside a Hugging Face transformers model and check it against the original.

    pip install -e '.[models]'
    python examples/transformers_swap.py                        # tiny random Qwen3-Next and Mamba-2
    python examples/transformers_swap.py --mode torch --new 32
    python examples/transformers_swap.py --model PATH_OR_NAME  # a checkpoint you have (from_pretrained)

Each model's mixer layers (Gated DeltaNet, KDA, Mamba, Mamba-2 and the hybrids sharing their
code) get mixc's op for the prompt and op.step for every generated token; the model's own
projections, conv, norm and cache stay. The original runs transformers' pure-torch path
(torch_fallback), whatever fla or mamba_ssm is installed. "auto" runs mixc's Triton kernels on
CUDA, or on the CPU when TRITON_INTERPRET=1 was set before Python started (slow: keep it tiny),
and mixc's torch backend otherwise.
"""
import argparse
import copy
import time

import torch
import transformers

from mixc.integrations import transformers as mixc_hf


def tiny_models():
    """Random models built from configs in code (no download)."""
    torch.manual_seed(0)
    qwen = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"], initializer_range=0.2))
    mamba2 = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, state_size=16,
        n_groups=2, chunk_size=8, initializer_range=0.2))
    return {"Qwen3-Next (tiny, random)": qwen, "Mamba-2 (tiny, random)": mamba2}


def compare(title, model, mode, prompt_len, new):
    original = mixc_hf.torch_fallback(model.eval())
    patched = mixc_hf.patch(copy.deepcopy(original), mode=mode)
    vocab = original.config.vocab_size
    ids = torch.randint(3, vocab, (2, prompt_len), generator=torch.Generator().manual_seed(1)).to(original.device)
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    print(f"\n{title}: mixer layers {mixc_hf.find_mixers(original)}")
    with torch.no_grad():
        ref = original(ids).logits
        t = time.perf_counter()
        out = patched(ids).logits
        t_prefill = time.perf_counter() - t
        want = original.generate(ids, **gen)
        t = time.perf_counter()
        got = patched.generate(ids, **gen)
        t_gen = time.perf_counter() - t
    err = (out - ref).abs().max().item()
    print(f"  prompt logits: max |mixc - transformers| = {err:.2e} (logits up to {ref.abs().max().item():.2f})")
    print(f"  greedy tokens ({new}): {'identical' if torch.equal(got, want) else 'DIFFERENT'}")
    print(f"  mixc ({mode}): prefill {t_prefill:.2f} s, generate {t_gen:.2f} s")
    return torch.equal(got, want)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="auto", choices=mixc_hf.MODES)
    ap.add_argument("--model", help="a checkpoint for AutoModelForCausalLM.from_pretrained")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    if args.model:
        models = {args.model: transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)}
    else:
        models = tiny_models()
    ok = all([compare(t, m, args.mode, args.prompt, args.new) for t, m in models.items()])
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

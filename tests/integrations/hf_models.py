"""Tiny random transformers models with mixer layers, built from configs in code (no downloads):
hidden 32, two layers (a mixer and, in hybrids, an attention layer), vocab 64, small heads;
weights drawn with a fixed seed and a larger init scale than the library default (0.02 gives
logits within 0.4 of each other, where greedy decoding is decided by rounding)."""
import math

import torch
import transformers as T

VOCAB = 64
INIT = 0.2
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _qwen3_next():
    return T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"], initializer_range=INIT, **_TOKENS))


def _olmo_hybrid():
    return T.OlmoHybridForCausalLM(T.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"], initializer_range=INIT, **_TOKENS))


def _kimi_linear():
    return T.KimiLinearForCausalLM(T.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_heads=2, linear_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, initializer_range=INIT, **_TOKENS))


def _mamba():
    return T.MambaForCausalLM(T.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, initializer_range=INIT, **_TOKENS))


def _falcon_mamba():
    return T.FalconMambaForCausalLM(T.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, initializer_range=INIT, **_TOKENS))


def _jamba():
    return T.JambaForCausalLM(T.JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False,
        initializer_range=INIT, **_TOKENS))


def _mamba2():
    # time_step_limit clamps part of the step sizes (drawn in [0.001, 0.1]) in the prefill, as
    # transformers does (its decode does not clamp: neither does mamba_ssm's selective_state_update)
    return T.Mamba2ForCausalLM(T.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=8, time_step_limit=(0.002, 0.05), initializer_range=INIT, **_TOKENS))


def _bamba():
    return T.BambaForCausalLM(T.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=8, initializer_range=INIT, **_TOKENS))


def _falcon_h1():
    return T.FalconH1ForCausalLM(T.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=8, initializer_range=INIT, **_TOKENS))


def _zamba2():
    return T.Zamba2ForCausalLM(T.Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        mamba_d_state=16, n_mamba_heads=8, mamba_ngroups=2, num_attention_heads=2, chunk_size=8,
        use_mamba_kernels=False, adapter_rank=8, initializer_range=INIT, **_TOKENS))


def _nemotron_h():
    return T.NemotronHForCausalLM(T.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, chunk_size=8, use_mamba_kernels=False, time_step_limit=(0.0, 0.05),
        initializer_range=INIT, **_TOKENS))


def _granite_moe_hybrid():
    return T.GraniteMoeHybridForCausalLM(T.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=32,
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=8, initializer_range=INIT, **_TOKENS))


def _rwkv():
    # RWKV-4. Its init ties every time_first (u) to 1 and draws the head orthogonal with gain
    # 0.5 (logits within ~2): u is redrawn per channel and the head scaled by 4
    model = T.RwkvForCausalLM(T.RwkvConfig(
        vocab_size=VOCAB, context_length=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
        intermediate_size=64, **_TOKENS))
    with torch.no_grad():
        for block in model.rwkv.blocks:
            block.attention.time_first.copy_(math.log(0.3) + 0.5 * torch.randn(32))
        model.head.weight.mul_(4)
    return model


MODELS = {
    "qwen3_next": _qwen3_next, "kimi_linear": _kimi_linear, "mamba": _mamba, "mamba2": _mamba2,
    "bamba": _bamba, "falcon_h1": _falcon_h1, "zamba2": _zamba2, "nemotron_h": _nemotron_h,
    "jamba": _jamba, "granite_moe_hybrid": _granite_moe_hybrid, "olmo_hybrid": _olmo_hybrid,
    "falcon_mamba": _falcon_mamba, "rwkv": _rwkv,
}
SPEC_OF = {"qwen3_next": "gated_delta_rule", "olmo_hybrid": "gated_delta_rule", "kimi_linear": "kda",
           "mamba": "mamba", "falcon_mamba": "mamba", "jamba": "mamba", "rwkv": "rwkv4"}       # the others: mamba2


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().eval()

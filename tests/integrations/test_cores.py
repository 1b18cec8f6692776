"""The replacements of transformers' core functions (mixc/integrations/hf_cores.py) called
directly against transformers' own, on inputs a tiny model does not reach."""
import pytest
import torch
from transformers.models.rwkv import modeling_rwkv

from mixc.integrations import hf_cores


def _rwkv_inputs(B, T, C, seed, key_offset):
    gen = torch.Generator().manual_seed(seed)
    key = key_offset + 2 * torch.randn(B, T, C, generator=gen)
    value = torch.randn(B, T, C, generator=gen)
    time_decay = torch.linspace(-4.0, 1.5, C) + 0.1 * torch.randn(C, generator=gen)
    time_first = torch.log(torch.tensor(0.3)) + 0.5 * torch.randn(C, generator=gen)
    return time_decay, time_first, key, value


@pytest.mark.parametrize("key_offset", [0.0, 100.0], ids=["keys-N(0,2)", "keys-near-100"])
def test_rwkv_cache_state_through_prefill_and_decode(key_offset):
    """RWKV-4's cache (num, den, max) through a prefill of 6 tokens and 3 decoded ones, with keys
    near 100 too (exp(k) overflows float32 at 88; transformers' running max keeps the state
    finite, and so does the adapter, which shifts the keys by the state's scale): the outputs
    equal transformers' rwkv_linear_attention_cpu and the real state num * exp(max), taken in
    float64, equals its state's."""
    linear_attention = hf_cores.make("rwkv4", mode="torch", op_kwargs={})["rwkv_linear_attention"]
    B, C = 2, 6
    w, u, key, value = _rwkv_inputs(B, 9, C, seed=4, key_offset=key_offset)
    start = [torch.zeros(B, C), torch.zeros(B, C), torch.full((B, C), -1e30)]     # the model's empty state
    want_state, got_state = [s.clone() for s in start], [s.clone() for s in start]
    for a, b in ((0, 6), (6, 7), (7, 8), (8, 9)):
        want, want_state = modeling_rwkv.rwkv_linear_attention_cpu(w, u, key[:, a:b], value[:, a:b],
                                                                     state=want_state, return_state=True)
        got, got_state = linear_attention(w, u, key[:, a:b], value[:, a:b], state=got_state, return_state=True)
        assert got.dtype == want.dtype and all(s.dtype == torch.float32 for s in got_state)
        assert all(torch.isfinite(s).all() for s in got_state)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"output of tokens {a}:{b}")
        for i, what in ((0, "num"), (1, "den")):
            real = lambda st: st[i].double() * st[2].double().exp()             # noqa: E731
            torch.testing.assert_close(real(got_state), real(want_state), rtol=1e-5, atol=1e-5 * real(want_state)
                                       .abs().max().item(), msg=f"{what} * exp(max) after tokens {a}:{b}")


def test_mamba2_seq_idx_keeps_segments_apart_with_states():
    """mamba_ssm's seq_idx [batch, T] over two rows of two and three segments, with an initial
    state per row and the final states asked for: each segment equals transformers' own
    mamba2_chunk_scan run on it alone, the row's first segment from the row's initial state and
    the others from zero, and the final state of a row is its last segment's."""
    import inspect
    from transformers.models.mamba2 import modeling_mamba2
    torch_scan = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
    scan = hf_cores.make("mamba2", mode="torch", op_kwargs={})["mamba2_chunk_scan"]
    gen = torch.Generator().manual_seed(7)
    B, T, H, P, G, N = 2, 9, 4, 3, 2, 5
    rows = [[4, 5], [2, 3, 4]]
    x, dt = torch.randn(B, T, H, P, generator=gen), torch.randn(B, T, H, generator=gen)
    Bm, Cm = torch.randn(B, T, G, N, generator=gen), torch.randn(B, T, G, N, generator=gen)
    A, D, dt_bias = -torch.rand(H, generator=gen) - 0.5, torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    init = torch.randn(B, H, P, N, generator=gen)
    seq_idx = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]).to(torch.int32)
    kw = dict(chunk_size=4, D=D, dt_bias=dt_bias, dt_softplus=True)
    y, final = scan(x, dt, A, Bm, Cm, initial_states=init, seq_idx=seq_idx, return_final_states=True, **kw)
    for b, lens in enumerate(rows):
        start = 0
        for i, n in enumerate(lens):
            s = slice(start, start + n)
            y_l, fin_l = torch_scan(x[b:b + 1, s], dt[b:b + 1, s], A, Bm[b:b + 1, s], Cm[b:b + 1, s],
                                    initial_states=init[b:b + 1] if i == 0 else None, return_final_states=True, **kw)
            torch.testing.assert_close(y[b:b + 1, s], y_l, rtol=1e-5, atol=1e-5, msg=f"row {b} segment {i}")
            start += n
        torch.testing.assert_close(final[b:b + 1], fin_l, rtol=1e-5, atol=1e-5, msg=f"row {b} final state")

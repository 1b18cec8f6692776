"""Causality under non-finite input (issue 19): a token's output depends only on the tokens at
or before it, even when a later token holds inf or NaN (right-padded batches with garbage in
the padding). The chunked forms zero such a token's key-side rows before their matmuls and set
the readouts from it on to NaN; attention and the FFT convolution do the same per row."""
import pytest
import torch

import mixc
from mixc.runtime.signature import ArgumentError

from helpers import random_args

T, BAD = 40, 29
T_FFT = 80           # past DIRECT_MAX_TAPS (64): the convolutions take the FFT path


def _with(args, name, token, value):
    out = dict(args)
    out[name] = args[name].clone()
    out[name][:, token] = value
    return out


def _same(got, want, fft=False):
    """Bit for bit; through an FFT within its rounding (the FFT mixes every input's rounding,
    the zeroed one's included, into every output)."""
    if not fft:
        assert torch.equal(got, want)
        return
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("mode", ["chunk", "torch", pytest.param("recurrent", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,first,second", [("gla", "k", "v"), ("delta_rule", "k", "beta"), ("mamba2", "B", "x")],
                         ids=["gla", "delta_rule", "mamba2"])
def test_a_late_inf_or_nan_leaves_earlier_outputs_unchanged(name, first, second, mode):
    """B1-T40-H2-K8: inf at token 29 in one input, NaN at token 34 in another: the outputs of
    tokens 0..28 equal those of the clean input bit for bit; those from token 29 on are not
    finite (as the reference's)."""
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 8, "V": 8, "N": 8, "P": 8}, dtype=torch.float32, seed=11)
    clean, _ = op(**args, mode=mode, chunk=16) if mode == "chunk" else op(**args, mode=mode)
    dirty_args = _with(_with(args, first, BAD, float("inf")), second, BAD + 5, float("nan"))
    dirty, _ = op(**dirty_args, mode=mode, chunk=16) if mode == "chunk" else op(**dirty_args, mode=mode)
    assert torch.equal(dirty[:, :BAD], clean[:, :BAD])
    assert not torch.isfinite(dirty[:, BAD:]).all(dim=-1).any()


@pytest.mark.parametrize("name,inp,reach", [("attention", "k", T), ("attention", "v", T), ("swa", "k", 8),
                                            ("hyena", "v", T_FFT), ("hyena", "x1", T_FFT), ("hyena", "x2", 1)],
                         ids=["attention-k", "attention-v", "swa-k", "hyena-v", "hyena-x1", "hyena-x2"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_sequence_mixers_in_torch_mode_stay_causal(name, inp, reach, value):
    """B1-T40-H2 (Hyena T80, the FFT path): only the rows that read token 29 (all later ones; a
    window of 8: rows 29..36; Hyena's gate x2: row 29) are not finite, the others equal the
    clean input's."""
    op = mixc.load(name)
    kw = {"window": 8} if name == "swa" else {}
    n = T_FFT if name == "hyena" else T
    args, _ = random_args(op.ir, B=1, T=n, H=2, sizes={"K": 8, "V": 8, "D": 8}, dtype=torch.float32, seed=12)
    clean, _ = op(**args, mode="torch", **kw)
    dirty, _ = op(**_with(args, inp, BAD, value), mode="torch", **kw)
    reached = torch.zeros(n, dtype=torch.bool)
    reached[BAD:BAD + reach] = True
    _same(dirty[:, ~reached], clean[:, ~reached], fft=name == "hyena")
    assert not torch.isfinite(dirty[:, reached]).any()


@pytest.mark.parametrize("name", ["s4d"])
def test_the_fft_convolution_form_stays_causal(name):
    """mode='conv', B1-T80-H2 (the FFT path): inf in x at token 29 leaves rows 0..28 as they were."""
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=T_FFT, H=2, sizes={"N": 8, "D": 8}, dtype=torch.float32, seed=13)
    clean, _ = op(**args, mode="conv")
    dirty, _ = op(**_with(args, "x", BAD, float("inf")), mode="conv")
    _same(dirty[:, :BAD], clean[:, :BAD], fft=True)
    assert not torch.isfinite(dirty[:, BAD:]).all()


DECAYS = {"gla": "g", "rwkv6": "w", "hgrn2": "g", "gated_delta_rule": "g", "kda": "g", "rwkv7": "w",
          "gated_delta_product": "g"}


@pytest.mark.parametrize("mode", ["chunk", "torch", pytest.param("recurrent", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(DECAYS))
def test_a_late_nan_or_inf_log_decay_leaves_earlier_outputs_right(name, mode):
    """B1-T40-H2-K8, the default chunk (one chunk holds every token): the log decay is NaN at
    token 20 in head 0 and +inf in head 1 (garbage in a padded tail). The outputs of tokens
    0..19 equal the float64 reference's (were all NaN: the bad log entered the chunk's
    cumulative sums and reference rows); from token 21 on no row is finite (issue 30). Mode torch
    refuses them instead: the library's gates declare their range, which it checks."""
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=14, bounded=True)
    ref, _ = op(**{k: v.double() for k, v in args.items()}, mode="reference")
    g = DECAYS[name]
    args[g] = args[g].clone()
    args[g][:, 20, 0] = float("nan")
    args[g][:, 20, 1] = float("inf")
    if mode == "torch":
        # the torch backend checks the gate's declared range (`in [-inf, 0]`) before it computes:
        # the garbage is refused by name, the first bad value by its index
        with pytest.raises(ArgumentError, match=rf"^{g}: expected values in \[-inf, 0\], .* got {g}\[0, 20, 0"):
            op(**args, mode=mode)
        return
    got, _ = op(**args, mode=mode)
    torch.testing.assert_close(got[:, :20].double(), ref[:, :20], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(got[:, 21:]).all(dim=-1).any()

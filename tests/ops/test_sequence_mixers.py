"""The sequence mixers (conv, mix, attend): every library spec, forward and the gradient of
every input and param, in float32 and float64, against float64 references written here from
the papers' formulas (direct O(T^2) sums for the convolutions and position biases, a masked
softmax for attention); prefill then step equals the whole sequence; bad input gets a clear
error. Run on the CPU through the torch path (the sequence ops have no Triton kernel)."""
import pytest
import torch

import mixc
from mixc.runtime.signature import ArgumentError

from helpers import case_id, random_args

# ---- float64 references, from the papers' formulas ------------------------------------


def toeplitz(h, T):
    """[H, t, s, ...]: h[:, t - s] for s <= t, 0 above the diagonal (h's taps along axis 1)."""
    t = torch.arange(T)
    lag = t[:, None] - t[None, :]
    ok = (lag >= 0) & (lag < h.shape[1])
    m = h[:, lag.clamp(0, h.shape[1] - 1)]
    return m * ok.reshape((1, T, T) + (1,) * (m.dim() - 3)).to(m.dtype)


def conv_ref(h, x):
    """Causal convolution y_t = sum_{s<=t} h_{t-s} x_s, h [H, >=T, D], x [B, T, H, D]."""
    return torch.einsum("htsd,bshd->bthd", toeplitz(h, x.shape[1]), x)


def hyena_ref(v, x1, x2, h1, h2):
    return x2 * conv_ref(h2, x1 * conv_ref(h1, v))


def aft_ref(q, k, v, bias):
    """sigmoid(q_t) * sum_{s<=t} softmax_s(k_s + bias[t, s]) v_s per channel; bias [H, T, T]."""
    T = q.shape[1]
    logits = k[:, None] + bias.permute(1, 2, 0)[None, :, :, :, None]        # [B, t, s, H, D]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal[None, :, :, None, None], float("-inf"))
    return torch.sigmoid(q) * torch.einsum("btshd,bshd->bthd", torch.softmax(logits, 2), v)


def aft_full_ref(q, k, v, w):
    T = q.shape[1]
    return aft_ref(q, k, v, w[:, :T, :T])


def aft_conv_ref(q, k, v, w):
    """The bias w[t - s] for 0 <= t - s < L, 0 further back."""
    return aft_ref(q, k, v, toeplitz(w, q.shape[1]))


def mix_ref(W, x, causal):
    T = x.shape[1]
    W = W[:, :T, :T]
    if causal:
        W = W * torch.ones(T, T, dtype=W.dtype).tril()
    return torch.einsum("hts,bshd->bthd", W, x)


def mlp_mixer_ref(x, W1, b1, W2, b2, causal=False):
    """The paper's token-mixing MLP: W2 gelu(W1 x + b1) + b2 along the tokens (exact GELU)."""
    T = x.shape[1]
    h = torch.nn.functional.gelu(mix_ref(W1, x, causal) + b1[:, :T].T[None, :, :, None])
    return mix_ref(W2, h, causal) + b2[:, :T].T[None, :, :, None]


def gmlp_ref(z1, z2, W, b, causal=False):
    return z1 * (mix_ref(W, z2, causal) + b[:, :z1.shape[1]].T[None, :, :, None])


def attention_ref(q, k, v, scale=None, window=None):
    T = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bthk,bshk->bhts", q * scale, k)
    t = torch.arange(T)
    ok = t[None, :] <= t[:, None]
    if window is not None:
        ok = ok & (t[:, None] - t[None, :] < window)
    return torch.einsum("bhts,bshv->bthv", torch.softmax(s.masked_fill(~ok, float("-inf")), -1), v)


REFS = {"hyena": hyena_ref, "aft_full": aft_full_ref, "aft_conv": aft_conv_ref, "mlp_mixer": mlp_mixer_ref,
        "gmlp": gmlp_ref, "swa": attention_ref, "attention": attention_ref}

# (spec, options, B, T, H, dims): T = 100 takes the FFT paths (filters longer than 64 taps)
CASES = [
    ("hyena", {}, 2, 100, 3, {"D": 5}),
    ("hyena", {}, 1, 9, 2, {"D": 3}),
    ("aft_full", {}, 2, 37, 3, {"D": 4}),
    ("aft_conv", {}, 2, 37, 3, {"D": 4, "L": 7}),
    ("aft_conv", {}, 1, 100, 2, {"D": 3, "L": 70}),
    ("mlp_mixer", {}, 2, 23, 3, {"D": 4}),
    ("mlp_mixer", {"causal": True}, 2, 23, 3, {"D": 4}),
    ("gmlp", {}, 2, 23, 3, {"D": 4}),
    ("gmlp", {"causal": True}, 1, 16, 2, {"D": 3}),
    ("swa", {"window": 5}, 2, 37, 3, {"K": 16, "V": 8}),
    ("swa", {"window": 1}, 1, 9, 2, {"K": 4, "V": 4}),
    ("swa", {"window": 64, "scale": 0.3}, 2, 20, 2, {"K": 8, "V": 8}),
    ("attention", {}, 2, 37, 3, {"K": 16, "V": 8}),
]
IDS = [f"{n}-" + case_id(B=B, T=T, H=H, **d) + "".join(f"-{k}{v}" for k, v in o.items()) for n, o, B, T, H, d in CASES]


def draw(name, B, T, H, dims, seed=0):
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=B, T=T, H=H, sizes=dims, dtype=torch.float64, seed=seed)
    if name == "hyena":                  # filters that decay along the lags, as implicit filters do
        for h in ("h1", "h2"):
            args[h] = args[h] * torch.exp(-0.05 * torch.arange(T, dtype=torch.float64))[None, :, None]
    return op, args


def grads_close(got, want, rtol):
    """Max error relative to the largest reference entry (at least 0.01: a gradient that is 0, as
    q's and k's with a window of 1, is compared with an absolute tolerance)."""
    scale = want.abs().max().clamp_min(1e-2)
    err = ((got.double() - want).abs().max() / scale).item()
    assert err < rtol, err


@pytest.mark.parametrize("name,opts,B,T,H,dims", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_forward_and_every_gradient_against_the_papers_formula(name, opts, B, T, H, dims, dtype):
    op, args = draw(name, B, T, H, dims)
    mine = {k: v.to(dtype).requires_grad_() for k, v in args.items()}
    ref_args = {k: v.clone().requires_grad_() for k, v in args.items()}
    o, st = op(**mine, **opts)
    assert st is None and o.dtype == dtype and torch.isfinite(o).all()
    r = REFS[name](**ref_args, **opts)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    grads_close(o, r, tol)
    w = torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((o.double() * w).sum(), list(mine.values()))
    want = torch.autograd.grad((r * w).sum(), list(ref_args.values()))
    for k, a, b in zip(mine, got, want):
        assert a.dtype == dtype and a.shape == b.shape, k
        grads_close(a, b, 10 * tol)


@pytest.mark.parametrize("name,opts,B,T,H,dims", CASES[::3], ids=IDS[::3])
def test_reference_mode_is_the_same_function(name, opts, B, T, H, dims):
    """mode="reference" (direct sums, the written-out softmax, no exponential scales) agrees too."""
    op, args = draw(name, B, T, H, dims)
    o, _ = op(**args, **opts, mode="reference")
    torch.testing.assert_close(o, REFS[name](**args, **opts), rtol=1e-10, atol=1e-10)


# ---- prefill, then one token at a time ---------------------------------------------------

STEP_CASES = [
    ("hyena", {}, {"D": 3}, 70),      # filters as long as the sequence: FFT prefill, direct steps
    ("aft_full", {}, {"D": 4}, 20),
    ("aft_conv", {}, {"D": 4, "L": 6}, 20),
    ("mlp_mixer", {"causal": True}, {"D": 3}, 20),
    ("gmlp", {"causal": True}, {"D": 3}, 20),
    ("swa", {"window": 4}, {"K": 8, "V": 4}, 20),
    ("swa", {"window": 40}, {"K": 8, "V": 4}, 20),     # a window longer than the sequence so far
    ("attention", {}, {"K": 8, "V": 4}, 20),
]


def split(op, args, t0, t1):
    names = {d.name for d in op.ir.inputs}
    return {k: (v[:, t0:t1] if k in names else v) for k, v in args.items()}


@pytest.mark.parametrize("name,opts,dims,T", STEP_CASES, ids=[f"{n}-T{T}" + "".join(f"-{k}{v}" for k, v in o.items())
                                                             for n, o, _, T in STEP_CASES])
def test_prefill_then_step_equals_the_whole_sequence(name, opts, dims, T):
    op, args = draw(name, 2, T, 2, dims, seed=5)
    full, _ = op(**args, **opts)
    P = 7 if name != "aft_conv" else 6        # a prefill no shorter than the filter
    o, st = op(**split(op, args, 0, P), **opts, output_final_state=True)
    assert st["pos"].tolist() == [P, P]
    outs = [o]
    for t in range(P, T - 5):
        token = {k: (v[:, 0] if k in {d.name for d in op.ir.inputs} else v) for k, v in split(op, args, t, t + 1).items()}
        ot, st = op.step(**token, **opts, state=st)
        outs.append(ot[:, None])
    # the last tokens as one more call that continues from the cache
    rest, st = op(**split(op, args, T - 5, T), **opts, initial_state=st, output_final_state=True)
    outs.append(rest)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert st["pos"].tolist() == [T, T]


def test_packed_sequences_and_steps_from_different_positions():
    """cu_seqlens runs each sequence on its own; their caches then step from different positions."""
    for name, opts, dims in (("swa", {"window": 3}, {"K": 4, "V": 4}), ("aft_full", {}, {"D": 3}),
                             ("hyena", {}, {"D": 3}), ("aft_conv", {}, {"D": 3, "L": 2})):
        op, args = draw(name, 1, 16, 2, dims, seed=9)
        cu = torch.tensor([0, 5, 16])
        o, st = op(**split(op, args, 0, 16), **opts, cu_seqlens=cu, output_final_state=True)
        assert st["pos"].tolist() == [5, 11]
        for a, b in ((0, 5), (5, 16)):
            alone, _ = op(**split(op, args, a, b), **opts)
            torch.testing.assert_close(o[:, a:b], alone, rtol=1e-10, atol=1e-10)
        # step both sequences with the same next token: each continues its own history
        nxt = draw(name, 1, 17, 2, dims, seed=10)[1]          # its inputs; the params stay args'
        names = {d.name for d in op.ir.inputs}
        token = {k: (nxt[k][:, 16].expand(2, *nxt[k][:, 16].shape[1:]) if k in names else v) for k, v in args.items()}
        ot, st2 = op.step(**token, **opts, state=st)
        assert st2["pos"].tolist() == [6, 12]
        for i, (a, b) in enumerate(((0, 5), (5, 16))):
            seq = {k: (torch.cat([v[:, a:b], nxt[k][:, 16:17]], 1) if k in names else v) for k, v in args.items()}
            whole, _ = op(**seq, **opts)
            torch.testing.assert_close(ot[i:i + 1], whole[:, -1], rtol=1e-10, atol=1e-10)


def test_packed_sequences_continue_from_their_caches():
    """cu_seqlens with initial_state: each packed sequence continues its own cache."""
    for name, opts, dims in (("swa", {"window": 3}, {"K": 4, "V": 4}), ("aft_full", {}, {"D": 3}),
                             ("hyena", {}, {"D": 3}), ("aft_conv", {}, {"D": 3, "L": 2})):
        op, args = draw(name, 1, 30, 2, dims, seed=9)
        names = {d.name for d in op.ir.inputs}

        def packed(*spans):
            return {k: (torch.cat([v[:, a:b] for a, b in spans], 1) if k in names else v) for k, v in args.items()}
        _, st = op(**packed((0, 10), (15, 22)), **opts, cu_seqlens=torch.tensor([0, 10, 17]), output_final_state=True)
        o, st = op(**packed((10, 15), (22, 30)), **opts, cu_seqlens=torch.tensor([0, 5, 13]), initial_state=st,
                   output_final_state=True)
        assert st["pos"].tolist() == [15, 15]
        first, _ = op(**split(op, args, 0, 15), **opts)
        second, _ = op(**split(op, args, 15, 30), **opts)
        torch.testing.assert_close(o, torch.cat([first[:, 10:], second[:, 7:]], 1), rtol=1e-10, atol=1e-10)


def test_empty_prefill_then_steps_and_low_precision():
    """Zero tokens with output_final_state give an empty cache to decode from (even with a filter
    longer than the tokens so far); bf16 inputs give a bf16 output computed in float32."""
    for name, dims in (("aft_conv", {"D": 3, "L": 4}), ("swa", {"K": 4, "V": 4}), ("hyena", {"D": 3}),
                       ("aft_full", {"D": 3})):
        op, args = draw(name, 2, 6, 2, dims, seed=3)
        full, _ = op(**args)
        _, st = op(**split(op, args, 0, 0), output_final_state=True)
        assert st["pos"].tolist() == [0, 0]
        outs = []
        for t in range(6):
            token = {k: (v[:, t] if k in {d.name for d in op.ir.inputs} else v) for k, v in args.items()}
            o, st = op.step(**token, state=st)
            outs.append(o)
        torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-10, atol=1e-10)
        low, _ = op(**{k: v.to(torch.bfloat16) for k, v in args.items()})
        assert low.dtype == torch.bfloat16 and low.shape == full.shape
        grads_close(low, full, 0.05)


def test_gradients_flow_through_a_cache():
    """A cache from a prefill carries gradients into the next call (as a state does)."""
    op, args = draw("attention", 1, 12, 2, {"K": 4, "V": 4}, seed=2)
    args = {k: v.requires_grad_() for k, v in args.items()}
    _, st = op(**split(op, args, 0, 8), output_final_state=True)
    o, _ = op(**split(op, args, 8, 12), initial_state=st)
    full, _ = op(**args)
    g = torch.autograd.grad(o.sum(), list(args.values()))
    want = torch.autograd.grad(full[:, 8:].sum(), list(args.values()))
    for a, b in zip(g, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---- exponentials carried with their scale ------------------------------------------------

@pytest.mark.parametrize("name", ["aft_full", "aft_conv"])
def test_aft_with_keys_beyond_the_range_of_exp(name):
    """k near 150 overflows exp in float32 (above ~88); the scaled exponentials stay exact."""
    op, args = draw(name, 2, 24, 2, {"D": 3, "L": 5}, seed=4)
    args["k"] = args["k"] * 5 + 150
    o, _ = op(**{k: v.float() for k, v in args.items()})
    assert torch.isfinite(o).all()
    grads_close(o, REFS[name](**args), 1e-5)


# ---- bad input ------------------------------------------------------------------------------

def test_a_filter_longer_than_the_sequence():
    op, args = draw("aft_conv", 1, 6, 2, {"D": 3, "L": 8})
    with pytest.raises(ArgumentError, match=r"the filter has L = 8 taps but the sequence has T = 6 tokens"):
        op(**args)


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_a_window_that_is_not_a_positive_whole_number(window):
    op, args = draw("swa", 1, 6, 2, {"K": 4, "V": 4})
    with pytest.raises(ArgumentError, match=r"window: the window of attend\(q \* scale, k, v, window=window\) "
                                            r"\(in output o\) must be a whole number of tokens >= 1"):
        op(**args, window=window)


def test_a_mixing_matrix_of_the_wrong_size():
    op, args = draw("mlp_mixer", 1, 6, 2, {"D": 3})
    small = dict(args, W2=args["W2"][:, :5, :5])
    with pytest.raises(ArgumentError, match=r"W2: a per-position param must cover the positions of the call: it has "
                                            r"5 rows \(axis 1\), the call reaches position 5 \(T = 6 tokens\)"):
        op(**small)
    with pytest.raises(ArgumentError, match=r"W1: expected a per-position param of shape \[H, T, T\] \(rank 3\), "
                                            r"got shape \[2, 6\] \(rank 2\)"):
        op(**dict(args, W1=args["W1"][:, 0]))
    with pytest.raises(ArgumentError, match=r"b1: a per-position param must cover"):
        op(**dict(args, b1=args["b1"][:, :3]))
    gen = torch.Generator().manual_seed(4)
    bigger = dict(args, W1=torch.randn(2, 9, 11, dtype=torch.float64, generator=gen),
                  b1=torch.randn(2, 9, dtype=torch.float64, generator=gen),
                  W2=torch.randn(2, 8, 7, dtype=torch.float64, generator=gen),
                  b2=torch.randn(2, 10, dtype=torch.float64, generator=gen))
    o, _ = op(**bigger)                 # larger than T: the top-left T x T block
    torch.testing.assert_close(o, mlp_mixer_ref(args["x"], bigger["W1"], bigger["b1"], bigger["W2"], bigger["b2"]))


def test_attention_with_mismatched_key_dims():
    op, args = draw("attention", 1, 6, 2, {"K": 4, "V": 4})
    with pytest.raises(ArgumentError, match=r"k: dim K \(axis 3\) is 5, but q gives K = 4"):
        op(**dict(args, k=torch.randn(1, 6, 2, 5, dtype=torch.float64)))


def test_what_a_non_causal_mixer_refuses():
    op, args = draw("mlp_mixer", 1, 6, 2, {"D": 3})
    assert not op.can_step() and op.can_step(causal=True)
    with pytest.raises(ArgumentError, match=r"output_final_state=True: mixer 'mlp_mixer' has no state to continue "
                                            r"from: mix\(\) in let h is not causal"):
        op(**args, output_final_state=True)
    with pytest.raises(ArgumentError, match="no state to continue from"):
        op.step(x=args["x"][:, 0], W1=args["W1"], b1=args["b1"], W2=args["W2"], b2=args["b2"],
                state={"pos": torch.zeros(1, dtype=torch.long)})


def test_modes_and_caches_that_do_not_fit():
    op, args = draw("swa", 2, 8, 2, {"K": 4, "V": 4})
    for mode in ("chunk", "recurrent", "conv"):
        with pytest.raises(ArgumentError, match=f"mode='{mode}': mixer 'swa' is a sequence mixer"):
            op(**args, mode=mode)
    _, st = op(**args, window=4, output_final_state=True)
    token = {k: v[:, 0] for k, v in args.items()}
    with pytest.raises(ArgumentError, match=r"initial_state\['attend0_k'\]: expected shape \[N, H, 2, K\].*it holds 3 "
                                            r"past tokens where this call keeps 2"):
        op.step(**token, window=3, state=st)
    with pytest.raises(ArgumentError, match=r"initial_state: missing cache entry 'attend0_v'"):
        op.step(**token, window=4, state={"pos": st["pos"], "attend0_k": st["attend0_k"]})
    with pytest.raises(ArgumentError, match=r"initial_state: unknown cache entry 'S'"):
        op.step(**token, window=4, state=dict(st, S=st["pos"]))
    with pytest.raises(ArgumentError, match=r"q: expected an input of shape \[B, H, K\]"):
        op.step(**args, window=4, state=st)


# ---- the forms of conv(), and the compiled module ---------------------------------------------

CONVS = """
mixer convs
  dims   D, L
  input  x[D], f[D]
  param  w[L, D]
  output y = conv(w, x) + conv(f, x) + conv(w, x, causal=false) + conv(f, x, causal=false) + conv(2, x)
"""


def _direct(h, x, causal):
    """y_t = sum_j h_j x_{t-j} (causal) or x_{t-j+c}, c = (L-1)//2; h [B|1, L, H, D], x [B, T, H, D]."""
    T, L = x.shape[1], h.shape[1]
    c = 0 if causal else (L - 1) // 2
    y = torch.zeros(torch.broadcast_shapes(h[:, :1].shape, x[:, :1].shape)[:1] + x.shape[1:], dtype=x.dtype)
    for t in range(T):
        for j in range(L):
            if 0 <= t - j + c < T:
                y[:, t] += h[:, j] * x[:, t - j + c]
    return y


@pytest.mark.parametrize("T", [9, 70], ids=["T9-direct", "T70-fft"])
def test_every_form_of_conv(T):
    """A tap dim (L taps, params), a filter per token and batch row (an input: taps along time),
    centred (causal=false) and a constant filter (a cumulative sum)."""
    from mixc.pipeline import from_text
    op = from_text(CONVS, "convs.mix")
    gen = torch.Generator().manual_seed(1)
    x, f = (torch.randn(2, T, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    o, _ = op(x=x, f=f, w=w)
    wt = w.permute(1, 0, 2).unsqueeze(0)                          # [1, L, H, D]
    ref = (_direct(wt, x, True) + _direct(f, x, True) + _direct(wt, x, False) + _direct(f, x, False)
           + 2 * torch.cumsum(x, 1))
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    g = torch.autograd.grad(o.square().sum(), (x, f, w))
    rg = torch.autograd.grad(ref.square().sum(), (x, f, w))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_compiled_module_imports_on_its_own(tmp_path, capsys):
    import importlib.util

    from mixc.cli import main
    assert main(["compile", "swa", "-o", str(tmp_path)]) == 0
    assert "no Triton kernel: computed by torch" in capsys.readouterr().out
    spec = importlib.util.spec_from_file_location("compiled_swa", tmp_path / "swa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.METADATA["kernels"] == {} and mod.METADATA["cache"] == ["pos", "attend0_k", "attend0_v"]
    _, args = draw("swa", 1, 6, 2, {"K": 4, "V": 4})
    o, st = mod.op(**args, window=3, output_final_state=True)
    torch.testing.assert_close(o.double(), attention_ref(**args, window=3))
    assert main(["run", "gmlp", "--T", "12", "--H", "2", "--dim", "D=4"]) == 0
    assert "gradients of z1, z2, W, b" in capsys.readouterr().out

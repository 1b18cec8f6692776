"""Mamba-3's trapezoidal update (mixc/specs/mamba3.mix, prev() of inputs) against a float64 loop
written from the paper, not from mixc's reference:

    h_t = alpha_t h_{t-1} + beta_t B_{t-1} x_{t-1}^T + gamma_t B_t x_t^T,   y_t = h_t^T C_t + D x_t
    alpha_t = exp(delta_t A), beta_t = (1 - lambda_t) delta_t alpha_t, gamma_t = lambda_t delta_t,
    delta_t = softplus(dt_t + dt_bias), lambda_t = sigmoid(lam_t), B_{-1} x_{-1} = the state's carry.

In every mode (reference, torch, recurrent, chunk): outputs, final states (h and the carried
prev_B, prev_x), the gradient of every input, param and initial state; packed sequences against
separate runs; the decode step token by token (functional, in place, a cache of slots)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import random_args, random_state

PARAMS = ("A", "D", "dt_bias")
MODES = ("reference", "torch", "recurrent", "chunk")
TOL = {"reference": 1e-12, "torch": 1e-12, "recurrent": 2e-5, "chunk": 2e-5}   # the kernels compute in fp32
SIZES = {"N": 4, "P": 3}
CHUNKS = {"chunk": {"chunk": 16}, "torch": {"chunk": 8}}     # several chunks, a partial last one


@pytest.fixture(scope="module")
def op():
    return mixc.load("mamba3")


def paper_loop(a: dict, s0: dict | None, softplus: bool = True):
    """The trapezoidal recurrence token by token in float64. a: inputs [b, t, h, *] and params
    [h]; s0: {"h": [b, h, n, p], "prev_B": [b, h, n], "prev_x": [b, h, p]} or None."""
    x, dt, Bm, Cm, lam = a["x"], a["dt"], a["B"], a["C"], a["lam"]
    A, D, dt_bias = a["A"], a["D"], a["dt_bias"]
    b, T, H, P = x.shape
    N = Bm.shape[-1]
    h = s0["h"] if s0 is not None else x.new_zeros(b, H, N, P)
    Bp = s0["prev_B"] if s0 is not None else x.new_zeros(b, H, N)
    xp = s0["prev_x"] if s0 is not None else x.new_zeros(b, H, P)
    ys = []
    for t in range(T):
        delta = F.softplus(dt[:, t] + dt_bias) if softplus else dt[:, t] + dt_bias     # [b, h]
        alpha = torch.exp(delta * A)
        lmb = torch.sigmoid(lam[:, t])
        beta, gamma = (1 - lmb) * delta * alpha, lmb * delta
        h = (alpha[..., None, None] * h + beta[..., None, None] * Bp[..., :, None] * xp[..., None, :]
             + gamma[..., None, None] * Bm[:, t, :, :, None] * x[:, t, :, None, :])
        ys.append(torch.einsum("bhn,bhnp->bhp", Cm[:, t], h) + D[:, None] * x[:, t])
        Bp, xp = Bm[:, t], x[:, t]
    y = torch.stack(ys, 1) if ys else x.new_zeros(b, 0, H, P)
    return y, {"h": h, "prev_B": Bp, "prev_x": xp}


def close(got, want, tol, what):
    scale = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    err = (got.detach().double() - want.detach()).abs().max().item() if want.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def _args(op, B, T, H, seed=0):
    kw, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=SIZES, seed=seed)
    return kw, sizes


def _grads(fn, leaves: dict, weights):
    """The gradients of a weighted sum of fn()'s output and final states w.r.t. leaves."""
    for v in leaves.values():
        v.grad = None
    o, st = fn()
    loss = (o.double() * weights["o"]).sum() + sum((st[k].double() * weights[k]).sum() for k in ("h", "prev_B", "prev_x"))
    loss.backward()
    return o, st, {k: v.grad.clone() for k, v in leaves.items()}


# the kernel modes from a zero state behind -m slow (14 s under the interpreter): a given state
# covers the same kernels and the carried entries' gradients too
CASES = [pytest.param(mode, with_state, id=f"{mode}-{'given' if with_state else 'zero'}-state",
                      marks=[pytest.mark.slow] if mode in ("recurrent", "chunk") and not with_state else [])
         for mode in MODES for with_state in (False, True)]


@pytest.mark.parametrize("mode,with_state", CASES)
def test_mamba3_equals_the_paper_loop(op, mode, with_state):
    B, T, H = 2, 37, 2
    kw, sizes = _args(op, B, T, H)
    s0 = random_state(op.ir, B, H, sizes) if with_state else None
    leaves = {k: v.requires_grad_(True) for k, v in kw.items()}
    if s0 is not None:
        leaves.update({f"s0.{k}": v.requires_grad_(True) for k, v in s0.items()})
    gen = torch.Generator().manual_seed(7)
    o_shape = (B, T, H, SIZES["P"])
    weights = {"o": torch.randn(o_shape, generator=gen, dtype=torch.float64),
               "h": torch.randn(B, H, SIZES["N"], SIZES["P"], generator=gen, dtype=torch.float64),
               "prev_B": torch.randn(B, H, SIZES["N"], generator=gen, dtype=torch.float64),
               "prev_x": torch.randn(B, H, SIZES["P"], generator=gen, dtype=torch.float64)}
    want_o, want_st, want_g = _grads(lambda: paper_loop(kw, s0), leaves, weights)
    extra = CHUNKS.get(mode, {})
    got_o, got_st, got_g = _grads(lambda: op(**kw, initial_state=s0, output_final_state=True, mode=mode, **extra),
                                  leaves, weights)
    tol = TOL[mode]
    close(got_o, want_o, tol, f"{mode}: y")
    assert set(got_st) == {"h", "prev_B", "prev_x"}
    for k in want_st:
        close(got_st[k], want_st[k], tol, f"{mode}: final {k}")
    for k in want_g:
        close(got_g[k], want_g[k], tol * 10, f"{mode}: d{k}")


@pytest.mark.parametrize("mode", ["reference", "torch", "chunk"])
def test_mamba3_without_the_softplus(op, mode):
    """dt_softplus=false: delta = dt + dt_bias as given (an activated step size)."""
    kw, sizes = _args(op, 2, 21, 2, seed=13)
    kw["dt"] = F.softplus(kw["dt"])
    kw["dt_bias"] = torch.zeros_like(kw["dt_bias"])
    s0 = random_state(op.ir, 2, 2, sizes, seed=14)
    want_o, want_st = paper_loop(kw, s0, softplus=False)
    o, st = op(**kw, initial_state=s0, output_final_state=True, mode=mode, dt_softplus=False, **CHUNKS.get(mode, {}))
    close(o, want_o, TOL[mode], f"{mode}: y")
    for k in want_st:
        close(st[k], want_st[k], TOL[mode], f"{mode}: final {k}")


@pytest.mark.parametrize("mode", MODES)
def test_mamba3_packed_sequences_equal_separate_runs(op, mode):
    lengths = [5, 0, 1, 21]             # an empty sequence and a one-token one among them
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T, H = int(cu[-1]), 2
    kw, sizes = _args(op, 1, T, H, seed=3)
    s0 = random_state(op.ir, len(lengths), H, sizes, seed=4)
    extra = CHUNKS.get(mode, {})
    o, st = op(**kw, initial_state=s0, cu_seqlens=cu, output_final_state=True, mode=mode, **extra)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: (v[:, a:b] if v.dim() >= 3 and k not in ("A", "D", "dt_bias") else v) for k, v in kw.items()}
        want_o, want_st = paper_loop(part, {k: v[i:i + 1] for k, v in s0.items()})
        close(o[:, a:b], want_o, TOL[mode], f"{mode}: sequence {i}'s y")
        for k in want_st:
            close(st[k][i:i + 1], want_st[k], TOL[mode], f"{mode}: sequence {i}'s final {k}")


@pytest.mark.parametrize("mode,inplace", [("reference", False), ("torch", False), ("recurrent", False),
                                          ("torch", True), ("recurrent", True)],
                         ids=["reference", "torch", "recurrent", "torch-inplace", "recurrent-inplace"])
def test_mamba3_decode_steps_equal_the_paper_loop(op, mode, inplace):
    B, T, H = 3, 6, 2
    kw, sizes = _args(op, B, T, H, seed=5)
    s0 = random_state(op.ir, B, H, sizes, seed=6)
    want_o, want_st = paper_loop(kw, s0)
    dtype = torch.float32 if inplace else torch.float64
    state = {k: v.to(dtype).clone() for k, v in s0.items()}
    given = state
    for t in range(T):
        tok = {k: (v[:, t] if k not in PARAMS else v) for k, v in kw.items()}
        o, state = op.step(**tok, state=state, mode=mode, inplace=inplace)
        close(o, want_o[:, t], TOL["recurrent"] if inplace else TOL[mode], f"{mode}: step {t}'s y")
        if inplace:
            assert state is given
    for k in want_st:
        close(state[k], want_st[k], TOL["recurrent"], f"{mode}: state {k} after {T} steps")


@pytest.mark.parametrize("mode", ["torch", "recurrent"])
def test_mamba3_decode_into_a_cache_of_slots(op, mode):
    B, T, H, slots = 2, 4, 2, 5
    idx = torch.tensor([3, 1])
    kw, sizes = _args(op, B, T, H, seed=8)
    s0 = random_state(op.ir, B, H, sizes, seed=9)
    want_o, want_st = paper_loop(kw, s0)
    cache = {k: torch.randn((slots,) + tuple(v.shape[1:]), dtype=torch.float32) for k, v in s0.items()}
    untouched = {k: v[[0, 2, 4]].clone() for k, v in cache.items()}
    for k, v in s0.items():
        cache[k][idx] = v.float()
    for t in range(T):
        tok = {k: (v[:, t] if k not in PARAMS else v) for k, v in kw.items()}
        o, _ = op.step(**tok, state=cache, mode=mode, inplace=True, state_indices=idx)
        close(o, want_o[:, t], TOL["recurrent"], f"{mode}: step {t}'s y")
    for k in want_st:
        close(cache[k][idx], want_st[k], TOL["recurrent"], f"{mode}: slot state {k}")
        assert torch.equal(cache[k][[0, 2, 4]], untouched[k]), f"{mode}: slots not named changed ({k})"


def test_mamba3_explain_shows_the_split_and_the_carry(op):
    from mixc.derive.explain import explain
    text = explain(op.plan())
    assert "class: sum of outer products" in text and "forms: chunk, recurrent, step" in text
    assert "k_1 = prev_B, v_1 = (1 - lam_t) * delta * alpha * prev_x; k_2 = B, v_2 = lam_t * delta * x" in text
    assert "prev_B[B, T, H, N] = prev(B): B one token back" in text and "state    prev_x[B, H, P]" in text


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_mamba3_compiled_module_shifts_as_the_op(tmp_path, mode):
    """`mixc compile mamba3 -o DIR`: the module's op computes prev(x) itself (standalone/shift.py)
    and equals the paper loop with packed sequences; its step carries prev_B, prev_x."""
    import importlib.util
    from mixc.cli import main
    assert main(["compile", "mamba3", "-o", str(tmp_path)]) == 0
    spec = importlib.util.spec_from_file_location(f"_mamba3_{mode}", tmp_path / "mamba3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    op = mixc.load("mamba3")
    lengths = [7, 0, 18]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    kw, sizes = _args(op, 1, int(cu[-1]), 2, seed=11)
    s0 = random_state(op.ir, len(lengths), 2, sizes, seed=12)
    o, st = mod.op(**kw, initial_state=s0, cu_seqlens=cu, output_final_state=True, mode=mode)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: (v[:, a:b] if k not in PARAMS else v) for k, v in kw.items()}
        want_o, want_st = paper_loop(part, {k: v[i:i + 1] for k, v in s0.items()})
        close(o[:, a:b], want_o, TOL["recurrent"], f"compiled {mode}: sequence {i}'s y")
        for k in want_st:
            close(st[k][i:i + 1], want_st[k], TOL["recurrent"], f"compiled {mode}: sequence {i}'s final {k}")
    def seq(a, b):
        return {k: (v[:, a:b] if k not in PARAMS else v) for k, v in kw.items()}
    init = {k: v[2:3] for k, v in s0.items()}
    _, carried = mod.op(**seq(7, 24), initial_state=init, output_final_state=True, mode=mode)
    o1, s1 = mod.step(**{k: (v[:, 0] if k not in PARAMS else v) for k, v in seq(24, 25).items()}, state=carried)
    want_o, want_st = paper_loop(seq(7, 25), init)
    close(o1, want_o[:, -1], TOL["recurrent"], "compiled step's y")
    for k in want_st:
        close(s1[k], want_st[k], TOL["recurrent"], f"compiled step's {k}")

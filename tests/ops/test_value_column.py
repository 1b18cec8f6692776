"""The per-value-column rank-1 class (mixc/classes/value_column.py) on its two example specs,
exact Longhorn (examples/longhorn_exact.mix: a step eps^c per value column) and the delta rule
with a value-diagonal decay (examples/delta_rule_value_decay.mix), against float64 loops
written from the papers' recurrences as matrices per value column (not from the specs):
outputs, final states, every input gradient and the initial state's, in mode 'torch' (the
chunked torch form: V batched [C, C] solves per chunk; and 'auto' on the CPU without the
interpreter), 'recurrent' (the Triton kernels under the interpreter) and the step form;
packed sequences (cu_seqlens); fresh random inputs, T not a multiple of the chunk."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import random_state

from .test_reference_new_specs import _loss, _loss_weights, assert_close

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"longhorn": ROOT / "examples" / "longhorn_exact.mix",
         "value_decay": ROOT / "examples" / "delta_rule_value_decay.mix"}
ST_TOL = 1e-6            # the torch backend's states are float32 (CONVENTIONS); outputs float64
KERNEL_TOL = 2e-5        # the kernels compute in float32


def longhorn_loop(a, s0):
    """Longhorn's closed form per value column c (Liu et al. 2024, the implicit online-regression
    step): s^c_t = (I - eps^c_t k_t k_t^T) s^c_{t-1} + eps^c_t v^c_t k_t, eps^c = beta^c / (1 + beta^c |k|^2);
    o^c_t = q_t . s^c_t."""
    q, k, v, beta = a["q"], a["k"], a["v"], a["beta"]
    S = s0["S"].clone()
    Kd, Vd = k.shape[-1], v.shape[-1]
    eye = torch.eye(Kd, dtype=torch.float64)
    out = []
    for t in range(q.shape[1]):
        kt = k[:, t]                                                          # [b, h, K]
        eps = beta[:, t] / (1 + beta[:, t] * (kt * kt).sum(-1, keepdim=True))  # [b, h, V]
        cols = []
        for c in range(Vd):
            M = eye - eps[..., c, None, None] * kt[..., :, None] * kt[..., None, :]
            cols.append(torch.einsum("bhij,bhj->bhi", M, S[..., c]) + eps[..., c, None] * v[:, t, :, c, None] * kt)
        S = torch.stack(cols, -1)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), {"S": S}


def value_decay_loop(a, s0, scale):
    """S_t = (I - beta_t k_t k_t^T) S_{t-1} diag(exp(g_t)) + beta_t k_t v_t^T; o_t = scale q_t^T S_t."""
    q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
    S = s0["S"].clone()
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        P = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = P @ S @ torch.diag_embed(g[:, t].exp()) + bt * kt[..., :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(out, 1), {"S": S}


def loop(spec, args, s0):
    if spec == "longhorn":
        return longhorn_loop(args, s0)
    return value_decay_loop(args, s0, args["q"].shape[-1] ** -0.5)


def case(spec, *, B, T, H, Kd=4, Vd=5, seed, n_states=None, requires_grad=True):
    """(op, args, s0): fresh float64 inputs as the papers draw them (unit keys for the delta rule,
    beta in (0, 1), log gates <= 0; Longhorn's keys need no norm: eps keeps its step a contraction)."""
    op = mixc.load(str(SPECS[spec]))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    args = {"q": randn(B, T, H, Kd), "k": randn(B, T, H, Kd), "v": randn(B, T, H, Vd)}
    if spec == "longhorn":
        args["beta"] = torch.sigmoid(randn(B, T, H, Vd))
    else:
        args["k"] = F.normalize(args["k"], dim=-1)
        args["g"] = F.logsigmoid(randn(B, T, H, Vd) + 2)
        args["beta"] = torch.sigmoid(randn(B, T, H))
    args = {k: v.requires_grad_(requires_grad) for k, v in args.items()}
    s0 = random_state(op.ir, n_states or B, H, {"K": Kd, "V": Vd}, seed=seed + 7, requires_grad=requires_grad)
    return op, args, s0


def check_all(what, o, fin, o_l, fin_l, leaves, names, tol, st_tol):
    """Output, final state and every gradient of one weighted loss, against the loop's."""
    assert_close(o, o_l, f"{what}: output", tol=tol)
    assert_close(fin["S"], fin_l["S"], f"{what}: final state", tol=st_tol)
    w = _loss_weights(o_l, fin_l)
    got = torch.autograd.grad(_loss(o, fin, w), leaves, allow_unused=True)
    want = torch.autograd.grad(_loss(o_l, fin_l, w), leaves)
    for name, a, b in zip(names, got, want):
        assert a is not None, f"{what}: no gradient for {name}"
        assert_close(a, b, f"{what}: d/d {name}", tol=st_tol)


@pytest.mark.parametrize("spec,mode,chunk", [("longhorn", "torch", 4), ("value_decay", "torch", 8),
                                             ("longhorn", "auto", None), ("value_decay", "auto", 32)])
def test_torch_chunked_form_matches_loop(spec, mode, chunk, chunk_calls, monkeypatch):
    """T = 21 over chunks of 4, 8, 32 and the class's default 16 (the last chunk partial)."""
    if mode == "auto":            # auto on CPU without Triton's interpreter is the torch backend
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    B, T, H = 2, 21, 2
    op, args, s0 = case(spec, B=B, T=T, H=H, seed={"longhorn": 3, "value_decay": 5}[spec] + (chunk or 0))
    kw = {} if chunk is None else {"chunk": chunk}
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode=mode, **kw)
    # the chunked form ran (the class's own C: 16; a chunk past T = 21 clamped to it), not the token loop
    assert chunk_calls == [min(chunk or 16, T)]
    o_l, fin_l = loop(spec, args, s0)
    check_all(f"{spec} {mode} C={chunk}", o, fin, o_l, fin_l, list(args.values()) + [s0["S"]],
              list(args) + ["initial_state[S]"], 1e-6, ST_TOL)


@pytest.mark.parametrize("spec", list(SPECS))
def test_recurrent_kernels_match_loop(spec):
    B, T, H = 2, 11, 2
    op, args, s0 = case(spec, B=B, T=T, H=H, seed=13)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="recurrent")
    o_l, fin_l = loop(spec, args, s0)
    check_all(f"{spec} recurrent", o, fin, o_l, fin_l, list(args.values()) + [s0["S"]],
              list(args) + ["initial_state[S]"], KERNEL_TOL, KERNEL_TOL)


@pytest.mark.parametrize("spec", list(SPECS))
def test_step_matches_loop(spec):
    """Decoding token by token from a random state equals the loop over the sequence."""
    B, T, H = 2, 4, 2
    op, args, s0 = case(spec, B=B, T=T, H=H, seed=17, requires_grad=False)
    o_l, fin_l = loop(spec, args, s0)
    st = s0
    for t in range(T):
        o, st = op.step(**{k: v[:, t] for k, v in args.items()}, state=st)
        assert_close(o, o_l[:, t], f"{spec}: step {t}", tol=1e-5)
    assert_close(st["S"], fin_l["S"], f"{spec}: state after the steps", tol=1e-5)


@pytest.mark.parametrize("spec,mode", [("longhorn", "torch"), ("value_decay", "torch"), ("value_decay", "recurrent")])
def test_packed_sequences_match_separate_loops(spec, mode):
    """cu_seqlens with an empty sequence and one longer than two chunks; gradients too."""
    lens = [5, 0, 9, 2]
    op, args, s0 = case(spec, B=1, T=sum(lens), H=2, seed=23, n_states=len(lens))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    kw = {"chunk": 4} if mode == "torch" else {}
    o, fin = op(**args, initial_state=s0, output_final_state=True, cu_seqlens=cu, mode=mode, **kw)
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if b == a:                               # an empty sequence keeps its initial state
            finals.append(s0["S"][i:i + 1])
            continue
        o_i, fin_i = loop(spec, {k: v[:, a:b] for k, v in args.items()}, {"S": s0["S"][i:i + 1]})
        outs.append(o_i)
        finals.append(fin_i["S"])
    tol = ST_TOL if mode == "torch" else KERNEL_TOL
    check_all(f"{spec} {mode} packed", o, fin, torch.cat(outs, 1), {"S": torch.cat(finals, 0)},
              list(args.values()) + [s0["S"]], list(args) + ["initial_state[S]"], tol, tol)


@pytest.mark.parametrize("spec", list(SPECS))
def test_the_left_comes_as_key_and_value_factors(spec):
    """Longhorn's -eps k and the decayed delta rule's -a beta k reach the torch form as their
    factors side by side, L [.., KF + VF] (products over the keys then [C, C], shared by the columns)."""
    from mixc.runtime.cache import load_module
    op, args, _ = case(spec, B=1, T=3, H=2, Kd=4, Vd=5, seed=1, requires_grad=False)
    pc = load_module(op.plan()).torch_pieces(args, {}, {"scale": torch.tensor(0.5, dtype=torch.float64)}
                                             if spec == "value_decay" else {}, {"K": 4, "V": 5}, 1, 3, 2)
    assert pc["L"]["S"].shape == (1, 3, 2, 4 + 5)


# a left that is no product of a key and a value factor (sigmoid(w) spans K and V): the torch form
# takes it whole, L [.., KF, VF]
FULL_LEFT = """mixer vc_full_left
  dims   K, V
  input  q[K], k[K], v[V], w[K, V]
  state  S[K, V]
  update S = S - 0.5 * sigmoid(w) * k * (k @ S) + k * v
  output o = q @ S
"""


def test_a_left_without_key_and_value_factors(tmp_path):
    from mixc.runtime.cache import load_module
    from mixc.runtime.inputs import random_args
    f = tmp_path / "vc_full_left.mix"
    f.write_text(FULL_LEFT)
    op = mixc.load(str(f))
    assert op.plan().transition == "per-value-column rank-1" and op.plan().layout.torch_chunked
    B, T, H, sizes = 2, 13, 2, {"K": 3, "V": 4}
    args, _ = random_args(op.ir, B=B, T=T, H=H, sizes=sizes, seed=29, requires_grad=True)
    pc = load_module(op.plan()).torch_pieces({k: v.detach() for k, v in args.items()}, {}, {}, sizes, B, T, H)
    assert pc["L"]["S"].shape == (B, T, H, 3, 4)                 # the left itself, per column
    s0 = random_state(op.ir, B, H, sizes, seed=31, requires_grad=True)
    o, fin = op(**args, initial_state=s0, output_final_state=True, mode="torch", chunk=5)
    o_l, fin_l = op(**args, initial_state=s0, output_final_state=True, mode="reference")
    check_all("full left", o, fin, o_l, fin_l, list(args.values()) + [s0["S"]], list(args) + ["initial_state[S]"],
              1e-6, ST_TOL)

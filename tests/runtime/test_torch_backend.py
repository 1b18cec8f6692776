"""The torch backend (CPU without Triton's interpreter): the chunked algorithm in plain torch,
forward and every gradient against the float64 reference."""
import pytest
import torch

import mixc
from mixc.derive.layout import chunk_supported, torch_chunk_supported
from mixc.dsl import library_names

from helpers import random_args, random_state

# the recurrent specs (sequence mixers have no chunked form: tests/ops/test_sequence_mixers.py)
CASES = [(n, {}) for n in library_names("recurrent")] + [("linear_attn", {"normalize": True}), ("based", {"use_norm": False}),
                                              ("delta_rule", {"use_qk_l2norm_in_kernel": True})]
CHUNKED = [(n, f) for n, f in CASES if torch_chunk_supported(mixc.load(n).plan(**f)) is None]


@pytest.mark.parametrize("name,flags", CHUNKED, ids=[n + "".join(f"-{k}" for k in f) for n, f in CHUNKED])
@pytest.mark.parametrize("C", [4, 64])
def test_torch_chunked_matches_reference(name, flags, C):
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=11, H=2, sizes={d.name: 3 + i for i, d in enumerate(op.ir.dims) if not d.alias_of},
                              dtype=torch.float64, requires_grad=True, seed=21)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    leaves = list(args.values()) + list(st.values())
    o, fin = op(**args, **flags, initial_state=st, output_final_state=True, mode="torch", chunk=C)
    ro, rfin = op(**args, **flags, initial_state=st, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-9)
    for k in rfin:
        torch.testing.assert_close(fin[k].double(), rfin[k], rtol=1e-6, atol=1e-6)   # states come back float32
    w = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    g = torch.autograd.grad((o * w).sum(), leaves, allow_unused=True)
    rg = torch.autograd.grad((ro * w).sum(), leaves, allow_unused=True)
    for a, b in zip(g, rg):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_torch_backend_varlen():
    op = mixc.load("gla")
    args, sizes = random_args(op.ir, B=1, T=10, H=2, dtype=torch.float64, seed=3)
    st = random_state(op.ir, 3, 2, sizes)
    cu = torch.tensor([0, 4, 4, 10])
    o, fin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="torch", chunk=3)
    ro, rfin = op(**args, initial_state=st, cu_seqlens=cu, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(fin["S"].double(), rfin["S"], rtol=1e-6, atol=1e-6)


# every construct the torch printer handles: head, a dim's size, norm, max over a dim, rename,
# fractional and negative powers, sqrt, the unary functions, a param with dims in another order
PRINTER_SPEC = """
mixer printer
  dims   K, V, J = K
  input  q[K], k[K], v[V], a[], x[V, K]
  param  w[V, K], c[K]
  option scale = 0.5
  let    kn = k / norm(k, K) * K ** -0.5
  let    g = -softplus(a) * (1 + head * 0.1) / (1 + abs(tanh(a)))
  let    gate = sigmoid(sum(x * w, V) + c) ** 1.5
  let    z = rename(kn, K -> J) * max(q, K) + elu(c) * 0.1 + relu(a) * silu(a) + sqrt(exp(a) + 1)
  state  S[K, V]
  update S = exp(g) * S + gate * kn * v
  output o = scale * (q @ S) + sum(z, J) * v + logsigmoid(a) * v
"""


def test_torch_printer_covers_every_construct():
    from mixc.pipeline import from_text
    op = from_text(PRINTER_SPEC, "printer.mix")
    assert chunk_supported(op.plan()) is None
    args, sizes = random_args(op.ir, B=2, T=9, H=3, sizes={"K": 4, "V": 3}, dtype=torch.float64,
                              requires_grad=True, seed=8)
    st = random_state(op.ir, 2, 3, sizes, requires_grad=True)
    leaves = list(args.values()) + list(st.values())
    o, fin = op(**args, initial_state=st, output_final_state=True, mode="torch", chunk=4)
    ro, rfin = op(**args, initial_state=st, output_final_state=True, mode="reference")
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fin["S"].double(), rfin["S"], rtol=1e-6, atol=1e-6)
    w = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad((o * w).sum(), leaves), torch.autograd.grad((ro * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("cu", [None, [0, 70, 70, 256]], ids=["batch", "varlen"])
def test_torch_backend_backward_is_linear_in_T(cu):
    """The chunk loop takes its chunks from one split per piece: the backward graph holds no
    per-chunk slice of a full-length tensor (each such slice's backward fills a full-length
    gradient: O(T^2 / C), fwd + bwd of gla took 8.7 s at T = 16384 instead of 1.4 s)."""
    op = mixc.load("gla")

    def full_length_slices(T):
        args, _ = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 4, "V": 4}, requires_grad=True, seed=3)
        kw = {"cu_seqlens": torch.tensor([0, T // 4, T // 4, T])} if cu else {}
        o, _ = op(**args, mode="torch", chunk=16, **kw)
        seen, todo, n = set(), [o.grad_fn], 0
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if type(fn).__name__ == "SliceBackward0" and fn._saved_dim == 1 and fn._saved_self_sym_sizes[1] == T:
                n += 1
            todo += [f for f, _ in fn.next_functions]
        return n

    assert full_length_slices(64) == full_length_slices(256) <= 4

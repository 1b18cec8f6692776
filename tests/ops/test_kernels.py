"""The generated kernels (chunked and recurrent forward, recurrent backward, step) of every
library spec, in Triton's interpreter, against the float64 reference. Tolerance as FlexAttention does it: the kernel's
error against float64 must stay within a small factor of the error of the same computation
done eagerly in the same dtype (the torch backend)."""
import pytest
import torch

import mixc
from mixc.derive.layout import chunk_supported
from mixc.dsl import library_names

from helpers import case_id, random_args, random_state  # noqa: F401
from kernel_checks import check_against_reference

# the recurrent specs: sequence mixers have no kernels (tests/ops/test_sequence_mixers.py)
CASES = [(n, {}) for n in library_names("recurrent")] + [
    ("linear_attn", {"normalize": True}), ("based", {"use_norm": False}),
    ("delta_rule", {"use_qk_l2norm_in_kernel": True}), ("gated_delta_rule", {"use_qk_l2norm_in_kernel": True}),
]
IDS = [n + "".join(f"-{k}" for k in f) for n, f in CASES]


def _positive(shape, gen):
    return torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.1


# normalized linear attention divides by scale q . sum k: positive features keep it from 0
DRAW = {("linear_attn", "normalize"): {"q": _positive, "k": _positive}}


def _draw(name, flags):
    return next((v for (n, f), v in DRAW.items() if n == name and flags.get(f)), None)


CHUNKED = [(n, f) for n, f in CASES if chunk_supported(mixc.load(n).plan(**f)) is None]
CHUNK_IDS = [n + "".join(f"-{k}" for k in f) for n, f in CHUNKED]


def _sizes(op, base=3):
    return {d.name: base + i for i, d in enumerate(op.ir.dims) if not d.alias_of}


@pytest.mark.parametrize("name,flags", CASES, ids=IDS)
def test_recurrent_matches_reference(name, flags):
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=9, H=3, sizes=_sizes(op), dtype=torch.float32, requires_grad=True, seed=1,
                              draw=_draw(name, flags))
    st = random_state(op.ir, 2, 3, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32)


@pytest.fixture(params=[1, 2], ids=["walk", "phases"])
def chunk_phases(request, monkeypatch):
    """The chunked kernels in one launch each (the walk over the chunks) or two (the walk for
    the states, then every chunk at once: the CUDA default), the two launches with a checkpoint
    every two chunks as on CUDA (the output kernel walks two chunks from each, the backward refills the
    states first: launch.checkpoint_every)."""
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_PHASES", request.param)
    if request.param == 2:
        monkeypatch.setattr(launch, "CHECKPOINT_EVERY", 2)
    return request.param


@pytest.mark.parametrize("name,flags", CHUNKED, ids=CHUNK_IDS)
def test_chunk_matches_reference(name, flags, chunk_phases):
    """Chunks of 16 over T = 21 (a partial last chunk), backward from the chunk checkpoints."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes=_sizes(op), dtype=torch.float32, requires_grad=True,
                              seed=6, draw=_draw(name, flags))
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, flags, args, st, torch.float32, mode="chunk", chunk=16)


def test_specs_without_a_chunked_kernel_say_why():
    op = mixc.load("mamba")
    args, _ = random_args(op.ir, B=1, T=3, H=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="mode='chunk': mixer 'mamba' has no chunked kernel .*elementwise decay"):
        op(**args, mode="chunk")


@pytest.mark.parametrize("name,mode", [("gla", "chunk"), ("mamba2", "chunk"), ("delta_rule", "recurrent"),
                                       ("mlstm", "chunk"), ("mlstm", "recurrent"), ("gated_delta_rule", "chunk"),
                                       ("rwkv7", "chunk"), ("mamba", "recurrent")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs(name, mode, dtype):
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=1, T=7, H=2, sizes=_sizes(op, 5), dtype=dtype, requires_grad=True, seed=2)
    st = random_state(op.ir, 1, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, dtype, mode=mode)


@pytest.mark.parametrize("T,CK", [(1, 4), (4, 4), (5, 4), (13, 32)], ids=lambda x: str(x))
def test_chunk_boundaries(T, CK):
    op = mixc.load("rwkv6")
    args, sizes = random_args(op.ir, B=2, T=T, H=2, sizes={"K": 6, "V": 5}, dtype=torch.float32,
                              requires_grad=True, seed=T)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, CK=CK)


@pytest.mark.parametrize("name,mode", [("gla", "chunk"), ("gla", "recurrent"), ("delta_rule", "recurrent"),
                                       ("based", "chunk"), ("rwkv6", "chunk"), ("gated_delta_rule", "chunk"),
                                       ("rwkv7", "chunk"), ("mamba", "recurrent")])
def test_cu_seqlens(name, mode, monkeypatch):
    """Packed sequences, one empty; the chunked ones in two launches per direction (the chunk
    programs find their sequence from the slot table), a sequence of 19 spanning two chunks."""
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load(name)
    lens = [3, 0, 19, 2] if mode == "chunk" else [3, 0, 6, 2]
    args, sizes = random_args(op.ir, B=1, T=sum(lens), H=2, sizes=_sizes(op, 4), dtype=torch.float32,
                              requires_grad=True, seed=3)
    st = random_state(op.ir, len(lens), 2, sizes, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    check_against_reference(op, {}, args, st, torch.float32, cu_seqlens=cu, mode=mode, chunk=16)


@pytest.mark.parametrize("name,flags", CASES, ids=IDS)
def test_step_matches_sequence(name, flags):
    """Decoding token by token with op.step equals one call over the sequence."""
    op = mixc.load(name)
    B, T, H = 2, 4, 2
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=_sizes(op), dtype=torch.float32, seed=4)
    st0 = random_state(op.ir, B, H, sizes)
    o_all, st_all = op(**args, **flags, initial_state=st0, output_final_state=True, mode="reference")
    st = st0
    names = {d.name for d in op.ir.inputs}
    for t in range(T):
        tok = {k: (v[:, t] if k in names else v) for k, v in args.items()}
        o, st = op.step(**tok, **flags, state=st)
        assert o.shape == o_all[:, t].shape
        torch.testing.assert_close(o.double(), o_all[:, t], rtol=1e-4, atol=1e-5)
    for k in st_all:
        torch.testing.assert_close(st[k].double(), st_all[k], rtol=1e-4, atol=1e-5)


def test_modes_and_dispatch(monkeypatch):
    op = mixc.load("simple_gla")
    args, _ = random_args(op.ir, B=1, T=3, H=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="mode: expected one of"):
        op(**args, mode="fast")
    with pytest.raises(ValueError, match=r"chunk: expected a power of two >= 16 \(a matmul block\), got 24"):
        op(**args, mode="chunk", chunk=24)
    with pytest.raises(ValueError, match="CK: expected a positive int .* got 0"):
        op(**args, mode="recurrent", CK=0)
    o_auto, _ = op(**args)
    o_chunk, _ = op(**args, mode="chunk")
    o_rec, _ = op(**args, mode="recurrent")
    torch.testing.assert_close(o_auto, o_chunk)
    torch.testing.assert_close(o_chunk, o_rec, rtol=1e-5, atol=1e-6)
    # without the interpreter, CPU tensors go to the torch backend
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    o_torch, _ = op(**args)
    torch.testing.assert_close(o_torch, o_rec, rtol=1e-5, atol=1e-6)
    from mixc.runtime.launch import KernelUnavailable
    with pytest.raises(KernelUnavailable, match="TRITON_INTERPRET=1"):
        op(**args, mode="recurrent")


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "torch", "reference"])
def test_empty_sequence(mode):
    """T = 0: no output rows, the final state is the initial one, its gradient passes through."""
    op = mixc.load("gla")
    args, sizes = random_args(op.ir, B=2, T=0, H=2, dtype=torch.float32, requires_grad=True)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    o, fin = op(**args, initial_state=st, output_final_state=True, mode=mode)
    assert o.shape == (2, 0, 2, 4)
    torch.testing.assert_close(fin["S"].double(), st["S"].double())
    (g,) = torch.autograd.grad(fin["S"].double().pow(2).sum(), [st["S"]])
    torch.testing.assert_close(g.double(), 2 * st["S"].double())

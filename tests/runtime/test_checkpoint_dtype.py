"""The chunked forward's checkpoints (the states at chunk starts that the output kernel and the backward
read) are stored in the inputs' dtype where that is bf16 or fp16, as fla stores its h (issue 16
item 3: half the checkpoint bytes); fp32 inputs keep fp32, MIXC_FP32_CHECKPOINTS=1 (or
launch.FP32_CHECKPOINTS) keeps fp32 for everyone, the registered op's fake says the same dtype
as its real call, and the gradients through bf16 checkpoints stay within bf16's tolerance."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mixc
from mixc.runtime import launch
from mixc.standalone.launcher import Launcher
from mixc.runtime.inputs import random_args


def test_backward_state_gradients_take_the_checkpoint_dtype(monkeypatch):
    """The walk of the two-launch backward hands dL/dS at each chunk's end to the tiles kernel in the
    checkpoints' dtype (bf16 here), and in fp32 under FP32_CHECKPOINTS."""
    op = mixc.load("simple_gla")
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 16, "V": 16}, dtype=torch.bfloat16,
                          requires_grad=True, seed=9)
    seen = []
    real = Launcher.backward

    def spy(self, bound, form, per_state, *a, **kw):
        def watch(s, *rest):
            bufs = per_state(s, *rest)
            seen.append((kw["launch"]["stage"], bufs["dh"].dtype))
            return bufs
        return real(self, bound, form, watch, *a, **kw)
    monkeypatch.setattr(Launcher, "backward", spy)
    for fp32, want in ((False, torch.bfloat16), (True, torch.float32)):
        monkeypatch.setattr(launch, "FP32_CHECKPOINTS", fp32)
        seen.clear()
        out, _ = op(**args, mode="chunk", chunk=16)
        out.float().square().sum().backward()
        assert seen == [("walk", want), ("tiles", want)], (fp32, seen)


def _call(op, args, f, C=16):
    m = op.ir
    return f([args[d.name] for d in m.inputs], [args[d.name] for d in m.params], [], [], None, True, True, True, C)


def _ckpt_dtypes(op, args, fake: bool):
    fwd, _, call = op.prepare()
    n = len(op._plan_for({}).kernel_ir.states)
    if not fake:
        return [c.dtype for c in _call(op, args, call)[1 + n:]]
    with FakeTensorMode() as mode:
        fargs = {k: mode.from_tensor(v) for k, v in args.items()}
        return [c.dtype for c in _call(op, fargs, fwd)[1 + n:]]


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checkpoints_take_the_inputs_half_dtype(name, dtype):
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 16, "V": 16}, dtype=dtype, seed=5)
    want = [dtype] * len(op._plan_for({}).kernel_ir.states)
    assert _ckpt_dtypes(op, args, fake=False) == want
    assert _ckpt_dtypes(op, args, fake=True) == want          # torch.compile traces the same dtype


def test_fp32_checkpoints_on_request(monkeypatch):
    op = mixc.load("simple_gla")
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 16, "V": 16}, dtype=torch.bfloat16, seed=6)
    monkeypatch.setattr(launch, "FP32_CHECKPOINTS", True)
    assert _ckpt_dtypes(op, args, fake=False) == [torch.float32]
    assert _ckpt_dtypes(op, args, fake=True) == [torch.float32]


def test_stabilizer_m_checkpoint_stays_fp32():
    """The stabilizer's m stays fp32 where the plan lets the other states be bf16 (rwkv4's
    normalized output keeps every state fp32 now: derive/layout.py half_states; the rule for
    m is checked with the plan's permission forced on)."""
    op = mixc.load("rwkv4")
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"V": 16}, dtype=torch.bfloat16, seed=7)
    plan = op._plan_for({})
    names = [s.name for s in plan.kernel_ir.states]
    assert not plan.layout.half_states
    assert set(_ckpt_dtypes(op, args, fake=False)) == {torch.float32}
    assert launch.checkpoint_dtype(True, torch.bfloat16, "_m", True) == torch.float32
    assert {launch.checkpoint_dtype(True, torch.bfloat16, n, True) for n in names if n != "_m"} == {torch.bfloat16}


@pytest.mark.parametrize("name,phases", [("simple_gla", 1), ("gated_delta_rule", 1), ("gla", 2)])
def test_gradients_through_bf16_checkpoints(name, phases, monkeypatch):
    """bf16 checkpoints against fp32 ones, both against the float64 reference: the extra error
    is the rounding of a state to bf16 (2^-8), well inside what bf16 inputs already cost. In two
    launches (phases = 2) the backward's dL/dS at chunk ends (the walk -> the tiles kernel) follows the
    same rule."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=48, H=2, sizes={"K": 16, "V": 16}, dtype=torch.bfloat16,
                          requires_grad=True, seed=8)
    ref_args = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in args.items()}
    ref, _ = op(**ref_args, mode="reference")
    # dO from its own generator: drawn from the global one it depended on the tests before it
    # in its worker, and one draw put gated_delta_rule's bf16 error at 0.038
    do = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(8))
    grads_ref = torch.autograd.grad(ref, [v for v in ref_args.values() if v.requires_grad], do)

    def grads(fp32):
        monkeypatch.setattr(launch, "FP32_CHECKPOINTS", fp32)
        out, _ = op(**args, mode="chunk", chunk=16)
        return [out] + list(torch.autograd.grad(out, [v for v in args.values() if v.requires_grad], do.bfloat16()))

    for fp32 in (True, False):
        got = grads(fp32)
        for g, r in zip(got, [ref] + list(grads_ref)):
            err = (g.double() - r).abs().max() / r.abs().max()
            assert err < 3e-2, (fp32, err)

"""The forward's checkpoints (the states at chunk starts, kept for the backward) are outputs of
the registered op but no gradient flows into them: the backward must not allocate a zero-filled
gradient of their size (issue 16 item 3), on the eager path nor through the registered op
(what torch.compile traces), and the gradients stay those of the float64 reference."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixc
from mixc.runtime.inputs import random_args

FILLS = ("zeros", "zero_", "fill", "full", "new_zeros")


class ZeroFills(TorchDispatchMode):
    """The shapes of every tensor a zero fill / full / fill_ produced while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(w in str(func) for w in FILLS) and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def _forward(op, args, path: str, C: int):
    """(o, checkpoint shapes) of the chunked forward, eagerly or through the registered op."""
    m = op.ir
    fwd, _, call = op.prepare()
    f = call if path == "eager" else fwd
    outs = f([args[d.name] for d in m.inputs], [args[d.name] for d in m.params], [], [], None, True, True, True, C)
    n = len(op._plan_for({}).kernel_ir.states)
    return outs[0], [tuple(c.shape) for c in outs[1 + n:]]


@pytest.mark.parametrize("path", ["eager", "registered"])
@pytest.mark.parametrize("spec", ["simple_gla-B1-T40-H2-K16", "gated_delta_rule-B1-T40-H2-K16"])
def test_backward_fills_no_checkpoint_sized_zeros(spec, path):
    name = spec.split("-")[0]
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=1, T=40, H=2, sizes={"K": 16, "V": 16}, seed=3, dtype=torch.float32,
                          requires_grad=True, bounded=True)     # bounded: a delta rule's state stays O(1)
    o, ckpt_shapes = _forward(op, args, path, 16)
    assert ckpt_shapes and all(s[0] > 1 for s in ckpt_shapes)          # states at 3 chunk starts were kept
    do = torch.randn_like(o)
    with ZeroFills() as z:
        torch.autograd.backward(o, do)        # the final state is an output too, its gradient unused
    assert not set(z.shapes) & set(ckpt_shapes), z.shapes
    ref_args = {k: v.detach().double().requires_grad_(True) for k, v in args.items()}
    ref, _ = op.reference(**ref_args)
    torch.autograd.backward(ref, do.double())
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    for k, v in args.items():
        torch.testing.assert_close(v.grad.double(), ref_args[k].grad, rtol=2e-3, atol=2e-4, msg=k)

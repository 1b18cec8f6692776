"""torch.compile(fullgraph=True) traces a model that calls a mixc op: no graph break, and the
compiled forward and backward equal the eager ones."""
import pytest
import torch

import mixc


class TinyMixer(torch.nn.Module):
    def __init__(self, op, d=8, H=2, K=4, V=3):
        super().__init__()
        self.op, self.H, self.K, self.V = op, H, K, V
        self.proj = torch.nn.Linear(d, H * (3 * K + V))

    def forward(self, x, state=None):
        B, T, _ = x.shape
        q, k, g, v = self.proj(x).view(B, T, self.H, -1).split([self.K, self.K, self.K, self.V], dim=-1)
        o, st = self.op(q=q, k=k, v=v, g=torch.nn.functional.logsigmoid(g), initial_state=state,
                        output_final_state=True, mode="recurrent")
        return o.sum(dim=(2, 3)), st


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
def test_fullgraph_compile_forward_and_backward(with_state):
    torch.manual_seed(0)
    model = TinyMixer(mixc.load("gla"))
    x = torch.randn(2, 5, 8)
    state = {"S": torch.randn(2, 2, 4, 3, requires_grad=True)} if with_state else None
    ref_o, ref_st = model(x, state)
    ref_loss = ref_o.pow(2).sum() + ref_st["S"].sum()
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()) + ([state["S"]] if state else []))

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    o, st = compiled(x, state)
    loss = o.pow(2).sum() + st["S"].sum()
    grads = torch.autograd.grad(loss, list(model.parameters()) + ([state["S"]] if state else []))
    torch.testing.assert_close(o, ref_o)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_custom_op_passes_opcheck():
    """torch.library.opcheck: schema, fake tensors and autograd registration are consistent."""
    op = mixc.load("simple_gla")
    from mixc.runtime.custom_op import ops_for
    fwd, bwd = ops_for(op.plan())
    from helpers import random_args
    args, _ = random_args(op.ir, B=1, T=3, H=2, sizes={"K": 3, "V": 2}, dtype=torch.float32, requires_grad=True)
    inputs = [args[d.name] for d in op.ir.inputs]
    for chunked, CK in ((False, 4), (True, 16)):
        torch.library.opcheck(fwd, (inputs, [], [], [0.5], None, True, True, chunked, CK),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compile_before_any_eager_call():
    torch.manual_seed(1)
    model = TinyMixer(mixc.load("gla"))          # load() prepares the default flags
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 4, 8)
    o, _ = compiled(x)
    o.sum().backward()
    torch.testing.assert_close(o, model(x)[0])

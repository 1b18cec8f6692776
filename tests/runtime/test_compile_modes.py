"""torch.compile(fullgraph=True) over an op in every mode on the CPU (issue 17): the cache is
filled by load()/prepare() outside the traced region, so tracing meets no file-system call;
the compiled forward and gradients equal the eager ones. Every mode runs by default (about
50 s of CPU, half that on the suite's two workers; mode="recurrent" is also
tests/runtime/test_compile.py)."""
import pytest
import torch

import mixc
from helpers import random_args

CASES = [("gla", "auto"), ("gla", "torch"), ("gla", "reference"), ("gla", "recurrent"), ("gla", "chunk"),
         ("s4d", "conv")]


@pytest.mark.parametrize("spec,mode", CASES, ids=lambda x: x)
def test_fullgraph_compile_in_every_mode(spec, mode):
    op = mixc.load(spec)                        # compiled before any eager call
    sizes = {d: 4 for d in op.ir.dim_names}
    args, _ = random_args(op.ir, B=1, T=6, H=2, sizes=sizes, dtype=torch.float32, requires_grad=True)

    def f(a):
        o, st = op(**a, output_final_state=True, mode=mode)
        return o.square().sum() + sum(s.sum() for s in st.values())

    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(args)
    grads = torch.autograd.grad(loss, list(args.values()))
    ref_loss = f(args)
    ref_grads = torch.autograd.grad(ref_loss, list(args.values()))
    torch.testing.assert_close(loss, ref_loss)
    for name, a, b in zip(args, grads, ref_grads):
        torch.testing.assert_close(a, b, msg=lambda m: f"d{name}: {m}")

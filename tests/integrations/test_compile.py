"""torch.compile of a patched model on the CPU (mode "torch": mixc's torch backend): the prefill
and a decode step each trace as one graph (fullgraph=True: no graph break in the model, the
adapter or the op) and give the eager patched model's logits. Every tiny model has two mixer
layers of one class: they share one copied forward, whose globals torch.compile must resolve
to the copy's, not to the modeling module's (before, the second layer ran the first's compiled
code without its function: NameError: __compiled_fn_...; or dynamo read transformers' core
function in place of mixc's)."""
import pytest
import torch
import transformers

from mixc.integrations import transformers as mixc_hf
from tests.integrations.hf_models import VOCAB, build

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|attention mask)")

# aot_eager traces and runs the graph without code generation (seconds); inductor generates and
# compiles C++ (minutes on two cores: slow). Measured: aot_eager equal to eager bit for bit,
# inductor within 2e-6 (logit scale ~7).
PARAMS = [pytest.param("mamba", "aot_eager", id="mamba-aot_eager")] + [
    pytest.param(n, b, id=f"{n}-{b}", marks=pytest.mark.slow)
    for n, b in (("rwkv", "aot_eager"), ("mamba2", "aot_eager"), ("qwen3_next", "aot_eager"), ("rwkv", "inductor"))]


def _continue(name, out):
    """The keyword that carries the model's recurrent state to the next call."""
    return {"state": out.state} if name == "rwkv" else {"cache": out.cache}


@pytest.mark.parametrize("name, backend", PARAMS)
def test_compiled_patched_model_equals_eager(name, backend):
    model = mixc_hf.patch(mixc_hf.torch_fallback(build(name)), mode="torch")
    batch = 1 if name == "rwkv" else 2          # transformers' RWKV decode: test_transformers._batch
    ids = torch.randint(3, VOCAB, (batch, 8), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        token = ref.logits[:, -1:].argmax(-1)
        ref_step = model(token, use_cache=True, **_continue(name, ref))
        out = compiled(ids, use_cache=True)
        step = compiled(token, use_cache=True, **_continue(name, out))
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5, msg="prefill logits")
    torch.testing.assert_close(step.logits, ref_step.logits, rtol=1e-5, atol=1e-5, msg="decode step logits")


def test_layers_of_a_class_share_one_patched_forward():
    model = mixc_hf.patch(build("mamba2"), mode="torch")
    layers = [m for n, m in model.named_modules() if n in mixc_hf.patched(model)]
    assert len(layers) == 2
    if "_kernel_funcs" in layers[0].__dict__:
        # the kernel route (transformers 5.25): the layers' private kernel functions share mixc's
        # forwards (the conv's wraps each layer's own original)
        for kname in ("mamba_chunk_scan_combined", "selective_state_update"):
            forwards = {layer._kernel_funcs[kname].forward.__func__ for layer in layers}
            assert len(forwards) == 1
            assert forwards.pop().__wrapped__.__module__ == "mixc.integrations.hf_cores"
        return
    forwards = {layer.forward.__func__ for layer in layers}
    assert len(forwards) == 1
    forward = forwards.pop()
    inner = getattr(forward, "__wrapped__", forward)
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    # its globals are a module's (found by name, as torch.compile looks them up), with mixc's core
    import sys
    assert sys.modules[inner.__globals__["__name__"]].__dict__ is inner.__globals__
    assert inner.__globals__["mamba2_chunk_scan"].__module__ == "mixc.integrations.hf_cores"

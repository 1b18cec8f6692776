"""The sum-of-outer-products class (mixc/classes/outer_sum.py): B_t = sum_m k_m v_m^T, M >= 2,
a scalar, per-key or no decay. Its chunked kernels and the torch backend's chunked form against
the float64 reference: outputs, final states, every gradient (the initial state's too), packed
sequences; with prev() of inputs among the pieces."""
import pytest
import torch

from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference
from mixc.pipeline import from_text

SPECS = {
    # GLA's per-key gate with a trapezoid over the keys and values
    "gla_trapezoid": """mixer gla_trapezoid
  dims   K, V
  input  q[K], k[K], v[V], g[K], lam[]
  state  S[K, V]
  update S = exp(g) * S + sigmoid(lam) * k * v + (1 - sigmoid(lam)) * exp(g) * prev(k) * prev(v)
  output o = q @ S
""",
    # no decay, three pieces, one of them subtracted
    "three": """mixer three
  dims   K, V
  input  q[K], k[K], v[V], k2[K], v2[V], b[]
  state  S[K, V]
  update S = S + k * v - b * k2 * v2 + prev(k) * v2
  output o = q @ S
""",
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def op(request):
    return from_text(SPECS[request.param], f"{request.param}.mix")


def test_the_class_and_its_chunked_form(op):
    plan = op.plan()
    assert plan.transition == "sum of outer products" and "chunk" in plan.forms


@pytest.mark.parametrize("mode", ["chunk", "torch"])
@pytest.mark.parametrize("B,T,H,K,V", [(2, 37, 2, 4, 3)], ids=[case_id(B=2, T=37, H=2, K=4, V=3)])
def test_against_the_reference_with_gradients(op, mode, B, T, H, K, V):
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": V}, dtype=torch.float32, requires_grad=True,
                              seed=1)
    st = random_state(op.ir, B, H, sizes, dtype=torch.float32, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode=mode, chunk=16 if mode == "chunk" else 8)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_sequences(op, mode):
    lens = [3, 0, 19, 2]
    args, sizes = random_args(op.ir, B=1, T=sum(lens), H=2, sizes={"K": 4, "V": 3}, dtype=torch.float32,
                              requires_grad=True, seed=3)
    st = random_state(op.ir, len(lens), 2, sizes, dtype=torch.float32, requires_grad=True)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    check_against_reference(op, {}, args, st, torch.float32, cu_seqlens=cu, mode=mode, chunk=16)


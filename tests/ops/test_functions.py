"""A spec calling a registry function (mixc/dsl/functions.py) in its feature maps, its decay's
input and its output, run through the kernels and the torch backend against the float64
reference, forward and every gradient: gelu by default (the function added as one registry
entry), every function under -m slow."""
import pytest
import torch

from mixc.dsl.functions import FUNCTIONS
from mixc.pipeline import from_text

from helpers import case_id, random_args, random_state
from kernel_checks import check_against_reference

SPEC = """
mixer uses_{fn}
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  let    a = sigmoid(g + 0.1 * {F}) ** 0.25
  state  S[K, V]
  update S = a * S + {Fk} * v
  output o = {Fq} @ S + {Fv}
"""


def spec(fn: str) -> str:
    """fn applied to q, k, v and g; where its domain is not the whole line (log, sqrt) to a
    point of its domain, lo + (hi - lo) * sigmoid(x)."""
    lo, hi = FUNCTIONS[fn].domain
    if lo < 0:
        call = fn + "({})"
    else:
        call = f"{fn}({lo} + {hi - lo} * sigmoid({{}}))"
    return SPEC.format(fn=fn, F=call.format("g"), Fk=call.format("k"), Fq=call.format("q"), Fv=call.format("v"))


NAMES = [pytest.param(n, marks=() if n == "gelu" else pytest.mark.slow) for n in FUNCTIONS]
DIMS = dict(B=2, T=8, H=2)


@pytest.mark.parametrize("fn", NAMES)
@pytest.mark.parametrize("mode", ["torch", "recurrent"], ids=lambda m: f"{m}-{case_id(**DIMS, K=4, V=3)}")
def test_a_spec_calling_the_function_matches_the_float64_reference(fn, mode):
    op = from_text(spec(fn), f"uses_{fn}.mix")
    dtype = torch.float64 if mode == "torch" else torch.float32
    args, sizes = random_args(op.ir, **DIMS, sizes={"K": 4, "V": 3}, dtype=dtype, requires_grad=True, seed=5)
    st = random_state(op.ir, DIMS["B"], DIMS["H"], sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, dtype, mode=mode)


"""An output nonlinear in a readout through a reduction over it (issue 30): sympy sees a node
(`max(abs(C @ S), P)`, `sum(exp(q @ Hk), M)`) as a symbol, so `_combine_kind` called
`(C @ S) / max(abs(C @ S), P)` and GSA's softmax readout linear in the readouts. The
recurrent kernels then split N into blocks and summed out(S_j) - out(0), with out(0) = 0/0:
NaN at N = 128 in recurrent mode and op.step. A linear node of readouts (a sum) still counts
as linear; the library's kinds are unchanged (tests/derive/test_classify.py)."""
import pytest
import torch

from mixc.derive.layout import split_dim
from mixc.pipeline import from_text

from helpers import random_args, random_state

CLIPPED = """
mixer clipped
  dims   N, P
  input  x[P], B[N], C[N], dt[]
  state  S[N, P]
  update S = exp(-softplus(dt)) * S + B * x
  output y = (C @ S) / max(abs(C @ S), P)
"""

GSA = """
mixer gsa
  dims   K, M, V
  input  q[K], k[K], v[V], g[M], s[M]
  state  Hk[K, M], Hv[M, V]
  update Hk = exp(g) * Hk + k * s
  update Hv = exp(g) * Hv + s * v
  output o = (exp(q @ Hk) / sum(exp(q @ Hk), M)) @ Hv
"""

# a sum over a readout is linear in it: N may still be split into blocks
SUMMED = """
mixer summed
  dims   N, P
  input  x[P], B[N], C[N], dt[]
  state  S[N, P]
  update S = exp(-softplus(dt)) * S + B * x
  output y = C @ S + 0.5 * sum(C @ S, P)
"""


@pytest.mark.parametrize("spec,kind,split", [(CLIPPED, "nonlinear", None), (GSA, "nonlinear", None),
                                              (SUMMED, "linear", "N")], ids=["clipped", "gsa", "summed"])
def test_a_reduction_over_a_readout_is_classified_by_what_it_does(spec, kind, split):
    plan = from_text(spec, "spec.mix").plan()
    assert plan.output.kind == kind
    assert split_dim(plan) == split


@pytest.mark.parametrize("spec", [CLIPPED, SUMMED], ids=["clipped", "summed"])
def test_recurrent_and_step_match_float64_at_N128(spec):
    """B2-T6-H2, N = 128 (the size at which the recurrent kernel split N into blocks), P = 4:
    the output of mode recurrent and of op.step from a random state within 1e-5 of float64
    (the clipped one was NaN)."""
    op = from_text(spec, "spec.mix")
    args, sizes = random_args(op.ir, B=2, T=6, H=2, sizes={"N": 128, "P": 4}, dtype=torch.float32, seed=31)
    st = random_state(op.ir, 2, 2, sizes)
    ref, _ = op(**{k: v.double() for k, v in args.items()}, initial_state={k: v.double() for k, v in st.items()},
                mode="reference")
    got, _ = op(**args, initial_state=st, mode="recurrent")
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    o, _ = op.step(**{k: v[:, 0] for k, v in args.items()}, state=st)
    torch.testing.assert_close(o.double(), ref[:, 0], rtol=1e-5, atol=1e-5)

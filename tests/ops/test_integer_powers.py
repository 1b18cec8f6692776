"""Integer powers of a base that may be negative (issue 30): `c ** p` for an integer p outside
1..4, and `x ** -1` (a Neg in the IR), were emitted as exp(p log c), NaN for c <= 0 in the
recurrent and chunked kernels, forward and gradient. They are products now (exp(p log |c|)
with c's sign past MAX_MULTIPLIED_POWER); an even power's log in a decay is p log |c|. The
torch backend and the reference (torch's `**`) were right all along: the kernels are diffed
against the float64 reference with bases of both signs."""
import pytest
import torch

from mixc.pipeline import from_text

from helpers import random_args, random_state
from kernel_checks import check_against_reference

# k, q ~ randn: k ** 5, q ** 7 take both signs; sigmoid(.) - 2 is in (-2, -1); 1.01 tanh(k) to
# the 65th is past the multiplied powers (the exp-log form with the sign); v ** 0 is 1; q ** (K - 1)
# is q ** 3 with an exponent known only at run time (the kernels take K as an argument)
POWERS = """
mixer powers
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  let    a = sigmoid(g)
  state  S[K, V]
  update S = a * S + (k ** 5 + 0.1 * k ** 6 + 0.1 * (sigmoid(k) - 2) ** -1 + 0.01 * (1.01 * tanh(k)) ** 65) * v
  output o = (q ** 7 + (sigmoid(q) - 2) ** -3 + 0.1 * q ** (K - 1)) @ S + 0.5 * v ** 0
"""

# the decay's base takes both signs; its square is in [0, 0.49]: the chunked forms take it
EVEN_DECAY = """
mixer even_decay
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  let    a = (0.5 * tanh(g) - 0.2) ** 2
  state  S[K, V]
  update S = a * S + k * v
  output o = q @ S
"""

DIMS = dict(B=2, T=20, H=2)


@pytest.mark.parametrize("spec", [POWERS, EVEN_DECAY], ids=["powers", "even_decay"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_integer_powers_of_negative_bases_match_float64(spec, mode):
    """B2-T20-H2-K4-V3, chunk 16 (a partial second chunk): output, final state and every
    gradient within the torch backend's error of float64 (were NaN)."""
    op = from_text(spec, "powers.mix")
    args, sizes = random_args(op.ir, **DIMS, sizes={"K": 4, "V": 3}, dtype=torch.float32, requires_grad=True,
                              seed=30)
    assert (args["k"] < 0).any() and (args["q"] < 0).any()
    st = random_state(op.ir, DIMS["B"], DIMS["H"], sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode=mode, chunk=16 if mode == "chunk" else None)


def test_a_negative_power_is_a_reciprocal_in_the_kernel_source():
    """`x ** -1` parses as x ** Neg(1): it is printed as a reciprocal, no log of the base."""
    from mixc.codegen.triton_expr import Emitter
    op = from_text(POWERS, "powers.mix")
    upd = op.ir.update("S").expr
    em = Emitter(op.ir, {"S": ("v_S", ("K", "V")), "prev S": ("v_S", ("K", "V")),
                         **{n: (f"v_{n}", op.ir.input(n).shape) for n in ("q", "k", "v", "g")}})
    em(upd)
    text = "\n".join(em.lines)
    # only the 65th power takes a log (the update has no run-time exponent), and of |1.01 tanh(k)|
    assert text.count("tl.log(") == text.count("tl.log(tl.abs(") == 1

"""Specs with declared ranges and gates shared by the tests of ranges (tests/dsl, tests/derive,
tests/runtime, tests/cli)."""

# HGRN-1 (Qin et al. 2023) as its paper writes the forget gate: a lower bound lb in [0, 1] per
# channel (here sigmoid of a raw input) and f = lb + (1 - lb) * sigmoid(fz). The sign prover took
# this decay for "not provably >= 0" and refused its chunked kernels (issue 32); written
# 1 - sigmoid(x) as sigmoid(-x) it passed.
HGRN1 = """
mixer hgrn1
  dims   D
  input  x[D], fz[D], lbx[D]
  let    lb = sigmoid(lbx)
  let    f = lb + (1 - lb) * sigmoid(fz)
  state  h[D]
  update h = f * h + (1 - f) * x
  output o = h
"""

# The same with the lower bound a param the caller promises to keep in [0, 1].
HGRN1_RANGED = """
mixer hgrn1_ranged
  dims   D
  input  x[D], fz[D]
  param  lb[D] in [0, 1]
  let    f = lb + (1 - lb) * sigmoid(fz)
  state  h[D]
  update h = f * h + (1 - f) * x
  output o = h
"""

# The lower bound without a range: nothing keeps f >= 0, so no chunked kernels.
HGRN1_UNRANGED = HGRN1_RANGED.replace("lb[D] in [0, 1]", "lb[D]").replace("hgrn1_ranged", "hgrn1_unranged")

# A delta rule with negative eigenvalues (beta in (0, 2), fla's allow_neg_eigval).
DELTA_NEG = """
mixer delta_neg
  dims   K, V
  input  q[K], k[K], v[V], beta[] in (0, 2)
  state  S[K, V]
  update S = S + beta * k * (v - k @ S)
  output o = q @ S
"""

# A stack of E = 3 states that no tensor sizes (`dims E = 3`), decayed by a gate scaled by E.
STACK = """
mixer stack
  dims   E = 3, K, V
  input  q[K], k[K], v[V], g[] in (-inf, 0]
  param  w[E]
  state  Z[E, K, V]
  update Z = exp(g * E) * Z + k * v
  output o = q @ (w @ Z)
"""

"""Specs shared by the stabilizer's tests."""

# an exponential gate on two prefix sums, read through prev() and the current state
EXPSUM = """
mixer expsum
  dims   K, V
  input  q[K], k[K], v[V], i[]
  state  S[K, V], z[K]
  update S = S + exp(i) * k * v
  update z = z + exp(i) * k
  output o = (q @ prev(S) + q @ S) / (abs(q @ z) + 1)
"""

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

# RWKV-4's WKV as a spec: the gate exp(k) is stabilized in the states a, b, and the output's
# own exp(u + k) joins their scale: the output is taken over M = max(m, u + k)
RWKV4 = """
mixer rwkv4
  dims   V
  input  k[], v[V]
  param  w[], u[]
  state  a[V], b[]
  update a = exp(-exp(w)) * a + exp(k) * v
  update b = exp(-exp(w)) * b + exp(k)
  output o = (prev(a) + exp(u + k) * v) / (prev(b) + exp(u + k))
"""

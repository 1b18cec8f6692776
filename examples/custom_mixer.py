"""Write a new mixer in a few lines, see what mixc derives, and run it.

    python examples/custom_mixer.py
"""
import torch

import mixc
from mixc.derive.explain import explain
from mixc.pipeline import from_text

SPEC = """
# A gated linear attention with a per-channel value gate and an output normalizer.
mixer my_gated_attn
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  option scale = K ** -0.5, eps = 1e-6
  let    phi_q = elu(q) + 1, phi_k = elu(k) + 1
  state  S[K, V], z[K]
  update S = exp(g) * S + phi_k * v
  update z = exp(g) * z + phi_k
  output o = (phi_q * scale) @ S / ((phi_q * scale) @ z + eps)
"""

op = from_text(SPEC, "my_gated_attn.mix")
print(explain(op.plan()))

B, T, H, K, V = 2, 32, 4, 16, 16
q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) + 2)
o, state = op.reference(q=q, k=k, v=v, g=g, output_final_state=True)
print("\noutput", tuple(o.shape), "states", {k: tuple(s.shape) for k, s in state.items()})

# A mistake is reported at its place, in the user's words:
try:
    from_text(SPEC.replace("phi_k * v", "phi_kk * v"), "my_gated_attn.mix")
except mixc.SpecError as err:
    print("\n" + str(err))

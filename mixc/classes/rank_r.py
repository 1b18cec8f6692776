"""The rank-r correction: S_t = diag(a_t) S_{t-1} + sum_{i=1..r} l_{t,i} (r_{t,i} . S_{t-1}) + B_t,
r >= 2 projection terms, each over exactly the key dims, with the decay a_t a scalar or over
the key dims: rank1.py's claim with r terms (DeltaProduct with r Householder steps per token,
written nested or expanded; derive/affine.py distributes and merges the terms, so r is the
number of distinct projections r_i).

Its parallel form is the generalized UT transform on chunks: the C tokens' r terms give C*r
unknown rows u_{t,i} = r~_{t,i} . X_{t-1}, and X_{t-1} sums over the earlier tokens' terms, so the
rows solve one [C*r, C*r] unit lower triangular system, block triangular in tokens with [r, r]
blocks (a token's r terms all read S_{t-1}: its diagonal block is 0). Those chunked kernels
are not generated yet: parallel_form is None, so the recurrent and step kernels (and the torch
backend's token loop) serve the class, and `mixc explain` says so."""
from __future__ import annotations

from .base import TransitionClass, UpdateShape


class RankR(TransitionClass):
    name = "rank-r correction"
    hardness = 5.5                          # between rank-1 (5) and general linear (6)
    parallel_form = None                    # the chunked kernels are not generated yet

    def claims(self, u: UpdateShape) -> bool:
        key = set(u.key_dims)
        return (len(u.projections) >= 2 and set(u.decay_dims) <= key
                and all(set(t.over) == key and set(t.proj_dims) <= key
                        and (t.scale_dims is None or set(t.scale_dims) <= key) for t in u.projections))

    def explain_chunk(self, st, s) -> list[str]:
        S, r = st.name, len(st.rank1)
        per_key = f" (a vector over {', '.join(st.decay_dims)})" if st.decay_dims else ""
        terms = "; ".join(f"l_{i + 1} = {s(t.left)}, r_{i + 1} = {s(t.right)}" for i, t in enumerate(st.rank1))
        return [f"transition: {S}_t = a_t {S}_{{t-1}} + sum_{{i=1..{r}}} l_i,t (r_i,t . {S}_{{t-1}}) + B_t, "
                f"rank r = {r}: a = {s(st.decay)}{per_key}; {terms}",
                f"the chunked form is the generalized UT transform: X_t = exp(-b_t) {S}_t, the C*r rows "
                f"u_(t,i) = r~_t,i . X_{{t-1}} of a chunk solve one [C*{r}, C*{r}] unit lower triangular "
                f"system (I - A) U = R^ {S}0 + A_rk V, block triangular in tokens with [{r}, {r}] blocks "
                f"A_(t,i),(s,j) = r~_t,i . l~_s,j for s < t (a token's terms all read {S}_{{t-1}})",
                "its chunked kernels are not generated yet: the recurrent and step kernels serve this "
                "class (mode='chunk' is refused; mode='auto' takes the recurrent kernels)"]


UNIT = RankR()

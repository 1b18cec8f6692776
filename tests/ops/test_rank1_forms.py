"""The rank-1 class's two chunk forms (mixc/classes/rank1.py): where the left is a scaled key
(l = c k: the delta rules, Comba, KDA) the chunk carries the corrected values N = V + c U and
has no L and no A_rl; any other left (RWKV-7's, a spec's own vector) keeps L, A_rl and U. Both
against the float64 reference, forward and every gradient, in two launches per direction and
in the one walk."""
import pytest
import torch

import mixc
from mixc import pipeline
from mixc.derive.explain import explain
from mixc.pipeline import from_text

from helpers import random_args, random_state, record_phases
from kernel_checks import check_against_reference

# a scalar decay and a left that is no scaled key (w, not k): the generic vector form, which no
# library spec takes since the delta rules' corrected values
OWN_LEFT = """
mixer own_left
  dims   K, V
  input  q[K], k[K], v[V], w[K], g[], beta[]
  state  S[K, V]
  update S = exp(g) * S + k * v - beta * w * (k @ S)
  output o = q @ S
"""


def _chunk_source(op) -> str:
    """The chunked kernels' text (from the forward's first stage kernel on)."""
    src = pipeline.render(op.plan())
    return src[src.index("_chunk_fwd_fused("):]


@pytest.mark.parametrize("name,scaled", [("delta_rule", True), ("gated_delta_rule", True), ("comba", True),
                                         ("kda", True), ("rwkv7", False), ("own_left", False)])
def test_the_corrected_values_where_the_left_is_a_scaled_key(name, scaled):
    op = from_text(OWN_LEFT, "own_left.mix") if name == "own_left" else mixc.load(name)
    st = op.plan().states[0]
    assert (st.ir_pieces.left_scale is not None) is scaled
    src = _chunk_source(op)
    # the scaled form: c's rows (_cc_), the matrix the solve takes diag(c) A_rk (_Mc_); no L
    assert ("_Mc_S" in src and "_cc_S" in src) is scaled
    assert ("_Arl_S" in src or "_Lc_S" in src) is not scaled
    assert ("l = c k with c = " in explain(op.plan())) is scaled


@pytest.mark.parametrize("phases", [2, 1], ids=["two-launches", "walk"])
def test_a_left_that_is_no_scaled_key_with_a_scalar_decay_matches_float64(phases, monkeypatch):
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
    op = from_text(OWN_LEFT, "own_left.mix")
    assert op.plan().states[0].transition == "rank-1 correction" and op.plan().layout.chunk_size == 64
    args, sizes = random_args(op.ir, B=2, T=21, H=2, sizes={"K": 8, "V": 24}, dtype=torch.float32,
                              requires_grad=True, seed=5)
    with torch.no_grad():                 # a contraction: |beta w . k| < 1 keeps S bounded
        args["beta"].mul_(0.3)
        args["g"].neg_().abs_().neg_()
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16)


@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", pytest.param("kda", marks=pytest.mark.slow),
                                  pytest.param("rwkv7", marks=pytest.mark.slow)])
def test_the_staged_inverse_matches_float64(name, monkeypatch):
    """launch.STAGE_SOLVE: the intra kernel stores each chunk's (I - M)^-1, the walk and the output kernel take
    U as one matmul with it (launches 4, 1, 2); the backward runs the intra kernel again and its walk
    takes U and dY = (I - M)^-T dU as matmuls with it (its _staged variant: no substitution on the
    reverse walk's dependent path). Against float64, forward and every gradient; an
    inf in one value: the outputs before its token as the computing forward's, NaN from it on in
    both (the intra kernel zeroes no row for a value, the walk and the output kernel do: rank1.py's chunk_setup)."""
    import mixc.runtime.launch as launch
    from mixc.standalone.launcher import Launcher
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    monkeypatch.setattr(launch, "STAGE_SOLVE", True)
    op = mixc.load(name)
    phases = record_phases(monkeypatch)
    kernels, real_kernel = [], Launcher.kernel

    def spy(self, form, device, stage=None, v=None):
        name_fn = real_kernel(self, form, device, stage, v)
        kernels.append(name_fn[0])
        return name_fn
    monkeypatch.setattr(Launcher, "kernel", spy)
    args, sizes = random_args(op.ir, B=2, T=20, H=2, sizes={"K": 8, "V": 16}, dtype=torch.float32,
                              requires_grad=True, seed=3)
    st = random_state(op.ir, 2, 2, sizes, requires_grad=True)
    check_against_reference(op, {}, args, st, torch.float32, mode="chunk", chunk=16)
    assert phases[:3] == ["intra", "walk", "output"]
    assert phases[3:] == ["intra"] and f"{name}_chunk_bwd_walk_staged" in kernels, (phases, kernels)
    assert f"{name}_chunk_bwd_walk" not in kernels
    bad = {k: v.detach().clone() for k, v in args.items()}
    bad["v"][1, 18, 0, 3] = float("inf")
    outs = {}
    for staged in (True, False):
        monkeypatch.setattr(launch, "STAGE_SOLVE", staged)
        outs[staged] = op(**bad, mode="chunk", chunk=16)[0]
    # U by one matmul with the inverse, or by substitution: equal up to fp32 rounding
    scale = outs[False][1, :18].abs().max().item()
    torch.testing.assert_close(outs[True][1, :18], outs[False][1, :18], rtol=1e-3, atol=1e-4 * scale)
    assert torch.isfinite(outs[True][1, :18]).all() and not torch.isfinite(outs[True][1, 18:, 0]).any()
    assert not torch.isfinite(outs[False][1, 18:, 0]).any()

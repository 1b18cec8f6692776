"""Where the chunked form may round its states and matmul operands to bf16 (derive/layout.py
half_states, half_matmuls), and specs without dims in chunk mode.

The first GPU run (2026-12-04, bench/results/2026-12-04-NVIDIA-H200) and the dry run found
aft_simple's chunked kernels in bf16 at 0.1 relative error in the output and 0.2-0.3 in the
gradients: its output num / den divides sums that cancel, and the chunk-end states were stored in
bf16. The bound here is FlexAttention's: the kernel's error against float64 within a small factor
of the same-dtype eager computation's (mode "torch" with the same bf16 inputs)."""
from __future__ import annotations

import pytest
import torch

import mixc
from mixc.dsl import library_names
from mixc.runtime import launch
from tests.helpers import case_id, random_args, random_state

FACTOR = 4.0


def _rel(a, b) -> float:
    return ((a.detach().double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _errors(op, kw, st, dtype, **call) -> dict:
    """Relative errors of op(**call) with inputs in dtype against the float64 reference on the
    same (rounded) values: output, final states, every input's gradient."""
    x = {k: v.to(dtype).detach().requires_grad_(True) for k, v in kw.items()}
    s0 = {k: v.float().detach().requires_grad_(True) for k, v in st.items()}
    o, fin = op(**x, initial_state=s0, output_final_state=True, **call)
    (o.float().square().sum() + sum(v.sum() for v in fin.values())).backward()
    r = {k: v.detach().double().requires_grad_(True) for k, v in x.items()}
    rs = {k: v.detach().double().requires_grad_(True) for k, v in s0.items()}
    ro, rfin = op.reference(**r, initial_state=rs, output_final_state=True)
    (ro.square().sum() + sum(v.sum() for v in rfin.values())).backward()
    out = {"o": _rel(o, ro)} | {f"state {k}": _rel(fin[k], rfin[k]) for k in rfin}
    return out | {f"d{k}": _rel(x[k].grad, r[k].grad) for k in x} | {f"d{k}0": _rel(s0[k].grad, rs[k].grad)
                                                                         for k in s0}


@pytest.mark.parametrize("name", library_names("recurrent"))
def test_half_precision_only_where_the_output_is_linear_in_the_readouts(name):
    plan = mixc.load(name).plan()
    if not plan.layout.chunked:
        pytest.skip(f"{name} has no chunked form")
    linear = plan.output.kind == "linear"
    assert plan.layout.half_matmuls == (linear or any(st.key_dims for st in plan.states))
    assert plan.layout.half_states == (linear and plan.transition != "rank-r correction")
    fp32 = launch.checkpoint_dtype(True, torch.bfloat16, "S", plan.layout.half_states) == torch.float32
    assert fp32 == (not plan.layout.half_states)


@pytest.mark.parametrize("B,T,H,D", [(1, 40, 2, 16)], ids=[case_id(B=1, T=40, H=2, D=16)])
def test_aft_simple_chunked_bf16_is_within_the_eager_error(B, T, H, D, monkeypatch):
    """Three chunks of 16 in two launches (the walk stores the chunk-start states, the output kernel and the
    backward read them): every error within 4x of mode "torch" in bf16 (before the fix the
    gradients were 25x off it)."""
    monkeypatch.setattr(launch, "CHUNK_PHASES", 2)
    op = mixc.load("aft_simple")
    kw, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={"D": D}, seed=3)
    st = random_state(op.ir, B, H, sizes)
    eager = _errors(op, kw, st, torch.bfloat16, mode="torch")
    chunk = _errors(op, kw, st, torch.bfloat16, mode="chunk", chunk=16)
    bad = {k: (f"{chunk[k]:.1e}", f"{eager[k]:.1e}") for k in chunk if chunk[k] > FACTOR * max(eager[k], 1e-3)}
    assert not bad, f"chunk bf16 error (kernel, eager) past {FACTOR}x the eager error: {bad}"


def test_a_spec_without_dims_runs_chunked(tmp_path):
    """RWKV-4's per-channel wkv as users write it (no dims, scalar states): chunk mode crashed in
    Launcher.key_block (max() of no blocks); now it equals float64 in the output and gradients."""
    path = tmp_path / "wkv.mix"
    path.write_text("mixer wkv\n  input  k[], v[]\n  state  a[], b[]\n  update a = a + exp(k) * v\n"
                    "  update b = b + exp(k)\n  output o = a / b\n")
    op = mixc.load(str(path))
    kw, sizes = random_args(op.ir, B=2, T=40, H=3, seed=5)
    st = random_state(op.ir, 2, 3, sizes)
    err = _errors(op, kw, st, torch.float32, mode="chunk", chunk=16)
    assert max(err.values()) < 1e-5, err

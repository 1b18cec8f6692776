"""bench/gpubench/time_model.py: the model's terms on launches whose answer is worked out by
hand, the chain of each kind of launch, and bench/time_model on the committed reports."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from gpubench import time_model as tm  # noqa: E402

DEV = tm.Device("toy", sms=10, bandwidth=1e12, peak_wgmma=1e15, peak_mma_sync=5e14, smem=100_000)
K = tm.Constants(L0_MIXC=3e-6, L0_FLA=1e-6, L_MMA=0.5e-6, L_ROW=0.1e-6, LAUNCH=2e-6)


def launch(grid, nbytes=0, flops=0.0, kernel="k"):
    return {"kind": "triton", "kernel": kernel, "grid": grid, "read": nbytes, "written": 0, "flops": flops}


@pytest.mark.parametrize("regs,warps,shared,want", [(64, 4, 0, 8), (255, 8, 0, 1), (64, 4, 40_000, 2), (32, 1, 0, 64)],
                         ids=["regs", "one-per-SM", "smem", "warps"])
def test_occupancy_is_the_tightest_of_registers_shared_memory_and_warps(regs, warps, shared, want):
    assert tm.occupancy(DEV, regs, warps, shared) == want


def test_a_streaming_launch_on_every_sm_takes_bytes_over_bandwidth():
    st = {"registers": 64, "num_warps": 4, "shared_bytes": 0, "tensor_cores": "wgmma"}
    t = tm.launch_time(DEV, K, launch([1000, 1, 1], nbytes=3_000_000), st, tm.Chain(1), "fla")
    assert t["t"] == pytest.approx(3e-6 + 2e-6)
    # the same bytes on 2 programs: 2 of 10 SMs pull them, a fifth of the bandwidth
    t2 = tm.launch_time(DEV, K, launch([2, 1, 1], nbytes=3_000_000), st, tm.Chain(1), "fla")
    assert t2["t_bytes"] == pytest.approx(15e-6)


def test_flops_on_mma_sync_count_at_its_own_peak():
    st = {"registers": 64, "num_warps": 4, "shared_bytes": 0}
    wg = tm.launch_time(DEV, K, launch([10, 1, 1], flops=1e10), {**st, "tensor_cores": "wgmma"}, tm.Chain(1), "fla")
    ms = tm.launch_time(DEV, K, launch([10, 1, 1], flops=1e10), {**st, "tensor_cores": "mma.sync"}, tm.Chain(1), "fla")
    assert wg["t_flops"] == pytest.approx(1e-5) and ms["t_flops"] == pytest.approx(2e-5)


def test_a_walk_waits_its_chain_per_wave_and_the_solve_lengthens_each_step():
    st = {"registers": 255, "num_warps": 8, "shared_bytes": 0, "tensor_cores": "wgmma"}      # one block per SM
    plain = tm.launch_time(DEV, K, launch([20, 1, 1], nbytes=1000), st, tm.Chain(100), "mixc")
    assert plain["waves"] == 2 and plain["t_chain"] == pytest.approx(2 * 100 * 3e-6)
    assert plain["t"] == pytest.approx(plain["t_chain"] + 2e-6)
    solve = tm.launch_time(DEV, K, launch([20, 1, 1], nbytes=1000), st, tm.Chain(100, 3, 63), "mixc")
    assert solve["t_chain"] == pytest.approx(2 * 100 * (3e-6 + 2 * 0.5e-6 + 63 * 0.1e-6))


@pytest.mark.parametrize("spec,impl,kernel,grid,want", [
    ("gla", "mixc", "gla_chunk_fwd_walk", [16, 2, 1], tm.Chain(128)),
    ("gla", "mixc", "gla_chunk_bwd_walk", [16, 2, 1], tm.Chain(128)),
    ("gla", "mixc", "gla_chunk_fwd_output", [512, 2, 1], tm.Chain(4)),
    ("gla", "mixc", "gla_chunk_fwd_refill", [512, 2, 1], tm.Chain(4)),
    ("gla", "mixc", "gla_chunk_bwd_tiles", [2048, 1, 1], tm.Chain(1)),
    ("delta_rule", "mixc", "delta_rule_chunk_fwd_walk", [16, 2, 1], tm.Chain(128, 3, 63)),
    # a tuner variant is its own kernel, named by its stage and then the variant
    ("gla", "mixc", "gla_chunk_fwd_output_rewalk_staged_keyblocks", [512, 2, 1], tm.Chain(4)),
    ("gla", "mixc", "gla_chunk_bwd_tiles_keyblocks", [2048, 1, 1], tm.Chain(1)),
    ("delta_rule", "mixc", "delta_rule_chunk_fwd_walk_staged", [16, 2, 1], tm.Chain(128, 3, 63)),
    # the backward's walk reading the staged inverse: dY as a matmul, no substitution
    ("delta_rule", "mixc", "delta_rule_chunk_bwd_walk_staged", [16, 2, 1], tm.Chain(128, 4)),
    ("delta_rule", "mixc", "delta_rule_chunk_bwd_walk", [16, 2, 1], tm.Chain(128, 3, 63)),
    # the names of the reports committed before one kernel per stage: by PHASE
    ("gla", "mixc", "gla_chunk_fwd[1]", [16, 2, 1], tm.Chain(128)),
    ("gla", "mixc", "gla_chunk_fwd[2]", [512, 2, 1], tm.Chain(4)),
    ("gla", "mixc", "gla_chunk_bwd[2]", [2048, 1, 1], tm.Chain(1)),
    ("gla", "fla", "chunk_fwd_kernel_h", [64, 1, 1], tm.Chain(128)),
    ("gated_delta_rule", "fla", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", [32, 1, 1], tm.Chain(128, 2)),
    ("gla", "fla", "chunk_gla_fwd_kernel_o", [256, 16, 1], tm.Chain(1)),
], ids=lambda x: x if isinstance(x, str) else None)
def test_chain_of_each_kind_of_launch_B1_T8192_H16(spec, impl, kernel, grid, want):
    assert tm.chain_of(spec, impl, launch(grid, kernel=kernel), 1, 8192, 16) == want


def test_a_launch_named_by_phase_finds_the_static_row_of_its_stage():
    """The calibration's traffic report names kernels by PHASE ([n]); the static report by stage
    and variant: the walk's registers must still be found (else the fit runs off its grid)."""
    static = [{"spec": "s", "impl": "mixc", "phase": "fwd", "kernel": "s_chunk_fwd_walk", "registers": 255,
               "num_warps": 8, "shared_bytes": 0, "tensor_cores": "wgmma"},
              {"spec": "s", "impl": "mixc", "phase": "fwd", "kernel": "s_chunk_fwd_output_rewalk", "registers": 32,
               "num_warps": 1, "shared_bytes": 0, "tensor_cores": "wgmma"}]
    result = {"spec": "s", "impl": "mixc", "launches": [
        {**launch([20, 1, 1], nbytes=1000, kernel="s_chunk_fwd[1]"), "phase": "fwd"},
        {**launch([20, 1, 1], nbytes=1000, kernel="s_chunk_fwd[2]"), "phase": "fwd"}]}
    rows = tm.op_time(DEV, K, result, static, 1, 8192, 16)["launches"]
    assert [r["occupancy"] for r in rows] == [1, 64]


def test_the_script_models_the_committed_reports_and_its_fit_is_within_its_stated_band(tmp_path):
    out = tmp_path / "tm.md"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "time_model"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    ratios = [float(line.rsplit("|", 2)[1]) for line in text.splitlines() if line.startswith("| H200 |")]
    assert len(ratios) == len(tm.CALIBRATION)
    assert all(0.75 <= r <= 1.33 for r in ratios), ratios        # the band docs and bench/README state
    assert "mixc 10.00 us" not in text, "the fit ran to its grid's edge: static rows not found"
    traffic = json.loads((ROOT / "bench/results/traffic-sm90/traffic_report.json").read_text())
    for spec in {r["spec"] for r in traffic["results"]}:
        assert f"| {spec} | " in text
    rows = [line for line in text.splitlines() if line.startswith("| delta_rule | ") and line.count("|") == 8]
    assert rows and float(rows[0].split("|")[4]) > 1, "mixc's walk with its solve models slower than fla's"


def test_the_staged_solve_section_prefers_the_inverse_before_the_walk(tmp_path):
    """The decision launch.STAGE_SOLVE's default follows (bench/README.md): on the committed
    staged reports the delta rules' forward models faster with the inverse staged, and the row
    latency at which they would tie is far below two cross-warp reductions (~0.1 us)."""
    out = tmp_path / "tm.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "time_model"), "--out", str(out)], check=True,
                   capture_output=True, timeout=120)
    rows = [line.split("|") for line in out.read_text().split("## The delta rules' solve")[1].split("\n## ")[0].splitlines()
            if line.startswith("| delta_rule |") or line.startswith("| gated_delta_rule |")]
    assert len(rows) == 2
    for r in rows:
        walk, staged, tie = float(r[2]), float(r[3]), float(r[5])
        assert staged < walk and tie < 0.05


def test_the_traffic_report_prints_the_modeled_time_beside_its_bytes(tmp_path):
    """bench/traffic_report --render: the committed report's markdown again, with each op call's
    modeled time for mixc and fla side by side, the same numbers bench/time_model gives."""
    (tmp_path / "traffic_report.json").write_text((ROOT / "bench/results/traffic-sm90/traffic_report.json").read_text())
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "traffic_report"), "--render", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "traffic_report.md").read_text()
    section = md.split("Modeled time")[1].split("\n\n| op | impl | pass")[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ") and "---" not in line}
    traffic = json.loads((tmp_path / "traffic_report.json").read_text())
    assert set(rows) - {"op"} == {r["spec"] for r in traffic["results"]}
    tm_out = tmp_path / "tm.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "time_model"), "--out", str(tm_out)], check=True,
                   capture_output=True, timeout=120)
    for spec, line in rows.items():
        if spec != "op":
            assert line in tm_out.read_text(), f"{spec}: the traffic report's modeled row is the time model's"

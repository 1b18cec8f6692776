"""The examples run as written."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_custom_mixer_example():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_mixer.py")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "class: key-diagonal decay" in p.stdout
    assert "output (2, 32, 4, 16)" in p.stdout
    assert "unknown name 'phi_kk' (did you mean 'phi_k'?)" in p.stdout


def test_readme_main_job(tmp_path):
    """README's first command after the install: explain, compile, run the kernels."""
    import os
    import re
    first = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    job = first.split("pip install -e '.[test]' && ", 1)[1]
    assert job.startswith("mixc explain gla")
    env = dict(os.environ, TRITON_INTERPRET="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    p = subprocess.run(job, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "build" / "gla.py").is_file()
    err = float(re.search(r"max relative error vs the float64 reference (\S+)", p.stdout).group(1))
    assert err < 1e-4


@pytest.mark.slow
def test_gpu_check_dry_run_every_spec(tmp_path):
    """The correctness section of bench/gpu_check for every library spec with a recurrence, in
    every mode it checks, fp32 and bf16, under the interpreter: what a GPU run starts with (round
    three found 8 failing rows: aft_simple and gated_delta_product in bf16)."""
    import json
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check"), "--dry-run", "--sections", "correctness",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=3000)
    res = json.loads((tmp_path / "results.json").read_text())
    bad = [(r["spec"], r["mode"], r["dtype"], r.get("error", "")[:200]) for r in res["correctness"] if not r["ok"]]
    assert not bad, bad
    from mixc.dsl import library_names
    assert {r["spec"] for r in res["correctness"]} == set(library_names("recurrent"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_gpu_check_dry_run(tmp_path):
    """bench/gpu_check runs end to end on the CPU (interpreter, tiny shapes, two phase-1
    processes) and writes its JSON: correctness at every chunk size the autotuner may pick, in
    one launch per direction and two, with tile blocks of 16, a checkpoint every two chunks, key
    blocks of 16 (one block at the dry run's D = 16: on a GPU, D = 32, two), the
    warm-up tasks, fla's shapes and the sweep (fla recorded as not run, with the reason), decode
    (eager, the reason recorded), the plots and the table."""
    import json
    specs = ["simple_gla", "gla", "delta_rule"]
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check"), "--dry-run", "--specs", "simple_gla",
                        "--timing-specs", *specs, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["mode"], r["dtype"], r["ok"]) for r in res["correctness"]] == [
        ("recurrent", "float32", True), ("recurrent", "bfloat16", True),
        ("chunk", "float32", True), ("chunk", "bfloat16", True),
        ("chunk C=32", "float32", True), ("chunk C=32", "bfloat16", True),
        ("chunk walk", "float32", True), ("chunk walk", "bfloat16", True),
        ("chunk tile16", "float32", True), ("chunk tile16", "bfloat16", True),
        ("chunk ckpt2", "float32", True), ("chunk ckpt2", "bfloat16", True),
        ("chunk keyblock16", "float32", True), ("chunk keyblock16", "bfloat16", True)]
    assert res["warmup"] and not [w for w in res["warmup"] if "error" in w]
    assert {w["task"]["kind"] for w in res["warmup"]} == {"warm_mixc", "warm_decode"}
    timed = [r for r in res["timing"] if "ms" in r]
    assert {(r["section"], r["spec"], r["impl"], r["pass"]) for r in timed} == {
        (sec, s, "mixc", p) for sec in ("fla_set", "sweep") for s in specs for p in ("fwd", "fwd_bwd")} | {
        (sec, "attention", "sdpa", p) for sec in ("fla_set", "sweep") for p in ("fwd", "fwd_bwd")} | {
        (sec, "delta_rule", "mixc staged solve", p) for sec in ("fla_set", "sweep") for p in ("fwd", "fwd_bwd")}
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["floor_x"] > 0 for r in timed)
    assert all("ratio_sdpa" in r for r in timed if r["impl"] == "mixc")
    assert {r["T"] for r in timed if r["section"] == "sweep"} == {32, 128}
    fla_rows = [r for r in res["timing"] if r["impl"] == "fla"]
    assert fla_rows and all("skipped" in r for r in fla_rows)
    assert res["fla"]                                         # why fla did not run, in words
    dec = [r for r in res["decode"] if "ms" in r]
    assert {r["spec"] for r in dec if r["impl"] == "mixc"} == set(specs)
    assert sorted(r["context"] for r in dec if r["impl"] == "sdpa") == [16, 64]
    assert all(r["graph"] is False and "CUDA graphs" in r["note"] for r in dec)
    assert "correctness: 14 passed, 0 failed" in p.stdout and "decode (one step" in p.stdout
    plots = {x.name for x in tmp_path.glob("*.png")}
    try:
        import matplotlib  # noqa: F401
        assert plots == {"timing.png", "sweep.png", "decode.png"}
    except ImportError:
        assert res["plots"] == "matplotlib not importable"

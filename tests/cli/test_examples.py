"""The examples run as written."""
import subprocess
import sys
from pathlib import Path

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


def test_gpu_check_dry_run(tmp_path):
    """bench/gpu_check runs end to end on the CPU (interpreter, tiny shapes) and writes its JSON."""
    import json
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check"), "--dry-run", "--specs", "simple_gla",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["mode"], r["dtype"], r["ok"]) for r in res["correctness"]] == [
        ("recurrent", "float32", True), ("recurrent", "bfloat16", True),
        ("chunk", "float32", True), ("chunk", "bfloat16", True)]
    assert res["timing"] and all("fwd_ms" in r for r in res["timing"])

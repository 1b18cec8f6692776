"""The documented launch: torchrun with 2 CPU processes (gloo) runs examples/context_parallel.py."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_context_parallel_example():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "examples" / "context_parallel.py"), "--T", "48"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    # numbers, not \S+: a line of the other rank written next to this one must not be swallowed
    num = r"([0-9.]+e[+-]\d+)"
    lines = re.findall(rf"rank (\d)/2: tokens (\d+)\.\.(\d+), output error {num}, input gradient error {num}", p.stdout)
    assert sorted((r, a, b) for r, a, b, _, _ in lines) == [("0", "0", "24"), ("1", "24", "48")], p.stdout
    # states travel between ranks in float32 (the op's state dtype): float64 inputs agree to ~1e-8
    assert all(float(e) < 1e-6 and float(g) < 1e-6 for *_, e, g in lines), p.stdout

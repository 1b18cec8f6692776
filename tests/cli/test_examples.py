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

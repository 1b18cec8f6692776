"""The mixc command line: list, check, explain, run, --dump; errors print and exit 1."""
import json
import subprocess
import sys

import pytest

from mixc.cli import main
from mixc.dsl import library_names


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    for name in library_names():
        assert name in out
    assert "key-diagonal decay" in out and "rank-1 correction" in out


def test_explain_gla(capsys):
    code, out, _ = run(capsys, "explain", "gla")
    assert code == 0
    assert "class: key-diagonal decay" in out
    assert "S_t = (exp(g)) * S_{t-1} + (k*v)" in out
    assert "log a_t = g" in out
    assert "S_C = exp(b_C) * S0 + (K * exp(b_C - b))^T V" in out
    assert "dS_{t-1} = (exp(g)) * dS_t" in out


def test_explain_delta_shows_the_triangular_solve(capsys):
    code, out, _ = run(capsys, "explain", "delta_rule")
    assert code == 0
    assert "T   = (I - tril(R L^T, -1))^-1" in out and "l = -beta*k, r = k" in out


@pytest.mark.parametrize("name", library_names())
def test_check_and_explain_every_library_spec(capsys, name):
    code, out, _ = run(capsys, "check", name)
    assert code == 0 and out.startswith(f"ok: {name}")
    code, out, _ = run(capsys, "explain", name)
    assert code == 0 and "recurrent form" in out and "backward" in out


def test_dumps(capsys):
    code, out, _ = run(capsys, "check", "mamba2", "--dump", "ir")
    assert code == 0 and "update S = exp(delta * A) * S + B * (delta * x)" in out
    code, out, _ = run(capsys, "explain", "mamba2", "--dump", "plan")
    plan = json.loads(out)
    assert plan["class"] == "scalar decay" and plan["states"][0]["log_decay"] == "A*softplus(dt + dt_bias)"
    code, out, _ = run(capsys, "check", "linear_attn", "--set", "normalize=true", "--dump", "plan")
    assert json.loads(out)["output"]["kind"] == "normalized"


def test_run(capsys):
    code, out, _ = run(capsys, "run", "simple_gla", "--T", "12", "--dim", "K=8")
    assert code == 0 and "output o: shape [2, 12, 4, 16]" in out and "finite True" in out


def test_spec_error_exits_1_with_position(tmp_path, capsys):
    bad = tmp_path / "bad.mix"
    bad.write_text("mixer bad\n  dims K, V\n  input q[K], k[K], v[V]\n  state S[K, V]\n"
                   "  update S = S + kk * v\n  output o = q @ S\n")
    code, out, err = run(capsys, "check", str(bad))
    assert code == 1 and out == ""
    assert f"{bad}:5:18: error: unknown name 'kk' (did you mean 'k'?)" in err
    assert "Traceback" not in err


def test_unknown_library_name(capsys):
    code, _, err = run(capsys, "explain", "glaa")
    assert code == 1 and "no library spec named 'glaa' (did you mean 'gla'?)" in err


def test_console_script_exit_code(tmp_path):
    bad = tmp_path / "nl.mix"
    bad.write_text("mixer x\n  dims K\n  input q[K]\n  state S[K]\n  update S = S * S + q\n  output o = S\n")
    p = subprocess.run([sys.executable, "-m", "mixc.cli", "check", str(bad)], capture_output=True, text=True)
    assert p.returncode == 1
    assert "the update of S is not linear in S: found S * S" in p.stderr
    assert "Traceback" not in p.stderr

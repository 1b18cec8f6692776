"""The command line never shows a traceback for a user's mistake or an OS error: bad numbers are
refused by argparse (exit 2), impossible runs, unknown dims and unwritable outputs print one
`error:` line (exit 1) before any work, a closed pipe exits quietly (141), Ctrl-C exits 130.
`mixc run` checks its errors against --tol on inputs that keep every library recurrence
bounded, and exits 1 when a check fails or a value is not finite."""
import errno
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from mixc import bench, recall
from mixc.cli import main
from mixc.dsl import library_names


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


@pytest.mark.parametrize("argv,message", [
    (["run", "gla", "--T", "0"], "argument --T: expected a whole number >= 1, got '0'"),
    (["run", "gla", "--B", "-1"], "argument --B: expected a whole number >= 1, got '-1'"),
    (["run", "gla", "--H", "two"], "argument --H: expected a whole number >= 1, got 'two'"),
    (["run", "gla", "--tol", "-1"], "argument --tol: expected a finite number > 0, got '-1'"),
    (["bench", "--D", "0"], "argument --D: expected a whole number >= 1, got '0'"),
    (["bench", "--T", "64,0"], "argument --T: expected comma-separated whole numbers >= 1, got '64,0' ('0')"),
    (["recall", "--lengths", "0"], "argument --lengths: expected comma-separated whole numbers >= 1, got '0'"),
    (["recall", "--widths", ""], "argument --widths: expected comma-separated whole numbers >= 1, got ''"),
    (["recall", "--steps", "0"], "argument --steps: expected a whole number >= 1, got '0'"),
], ids=["run-T0", "run-B-1", "run-Htwo", "run-tol-1", "bench-D0", "bench-T0", "recall-lengths0", "recall-widths",
        "recall-steps0"])
def test_bad_numbers_are_refused_by_argparse(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


def test_recall_lengths_too_short_for_their_pairs(capsys, monkeypatch):
    monkeypatch.setattr(recall, "run", lambda *a, **k: pytest.fail("trained before checking"))
    code, _, err = run(capsys, "recall", "--specs", "gla", "--lengths", "2")
    assert code == 1 and "error: --lengths 2: 1 key-value pair (--kv-per-token 0.25) and their queries need " \
                          "sequences of at least 4 tokens" in err


def test_run_refuses_sizes_that_do_not_fit_in_memory(capsys):
    t0 = time.perf_counter()
    code, out, err = run(capsys, "run", "gla", "--T", str(10 ** 12))
    assert code == 1 and out == "" and time.perf_counter() - t0 < 5
    assert "error: --B 2 --T 1000000000000 --H 4 K=16 V=16: this run would need about " in err
    assert "more than half of this machine's" in err and "use a smaller --T, --B, --H or --dim" in err


def test_run_refuses_a_dim_the_spec_does_not_have(capsys):
    code, _, err = run(capsys, "run", "gla", "--dim", "Q=4")
    assert code == 1 and err.strip() == "error: --dim Q=4: spec 'gla' has dims K, V"


def test_run_mode_chunk_without_the_interpreter_is_one_line(capsys, monkeypatch):
    import mixc.runtime.launch as launch
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    code, _, err = run(capsys, "run", "gla", "--mode", "chunk", "--T", "8", "--dim", "K=8")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: Triton kernels run on CPU tensors only in Triton's interpreter")


@pytest.mark.parametrize("where", ["onto-a-file", "under-a-file"])
def test_compile_output_onto_a_file(capsys, tmp_path, where):
    f = tmp_path / "f"
    f.write_text("x")
    target = f if where == "onto-a-file" else f / "sub"
    code, out, err = run(capsys, "compile", "gla", "-o", str(target))
    assert code == 1 and out == ""
    assert err.strip() in (f"error: {f}: exists and is not a folder", f"error: Not a directory: {target}",
                           f"error: Not a directory: {target / 'gla.py'}")


def test_check_an_unreadable_file(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "secret.mix"
    spec.write_text("mixer x\n")
    if os.geteuid() == 0:           # root reads any file: the OS refuses the same way
        import pathlib
        def refuse(self, *a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    else:
        spec.chmod(0)
    code, out, err = run(capsys, "check", str(spec))
    assert code == 1 and out == "" and err.strip() == f"error: Permission denied: {spec}"


@pytest.mark.parametrize("cmd", ["bench", "recall"])
def test_an_output_folder_that_is_a_file_is_refused_before_the_work(capsys, tmp_path, monkeypatch, cmd):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("benchmarked before checking -o"))
    monkeypatch.setattr(recall, "run", lambda *a, **k: pytest.fail("trained before checking -o"))
    f = tmp_path / "f"
    f.write_text("x")
    extra = ["--specs", "gla"] if cmd == "recall" else []
    code, out, err = run(capsys, cmd, *extra, "-o", str(f))
    assert code == 1 and err.strip() == f"error: the output must be a folder, not a file: {f}"


class _Stdout(io.StringIO):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def flush(self):
        raise self.exc


def test_a_closed_pipe_exits_quietly_and_a_full_disk_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Stdout(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert main(["check", "gla"]) == 141
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys, "stdout", _Stdout(OSError(errno.ENOSPC, "No space left on device")))
    assert main(["check", "gla"]) == 1
    assert capsys.readouterr().err == "error: No space left on device\n"


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch):
    import mixc.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_check", interrupted)
    assert main(["check", "gla"]) == 130
    assert capsys.readouterr().err == "mixc: interrupted\n"


@pytest.mark.slow          # three fresh interpreters (~10 s on 2 cores); the in-process tests above run by default
def test_real_pipe_full_disk_and_sigint():
    cmd = [sys.executable, "-m", "mixc.cli"]
    p = subprocess.run(" ".join(cmd + ["compile", "gla", "--dump", "source"]) + " | head -c 10", shell=True,
                       capture_output=True, text=True, timeout=300)
    assert p.stdout == '"""Generat' and p.stderr == ""
    with open("/dev/full", "w") as full:
        p = subprocess.run(cmd + ["compile", "gla", "--dump", "source"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300)
    assert p.returncode == 1 and p.stderr == "error: No space left on device\n"
    # SIGINT's default disposition in the child: a suite started in the background by a
    # non-interactive shell (`pytest ... &`) ignores SIGINT, and Python then installs no
    # KeyboardInterrupt handler in what it starts (the mixc run ran on, orphaned, for minutes)
    p = subprocess.Popen(cmd + ["run", "based", "--T", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, TRITON_INTERPRET="0"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(8)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()            # never leave it running
    assert p.returncode == 130 and err == "mixc: interrupted\n"


# ---- mixc run: tolerance, bounded inputs, exit status ------------------------------------------

def _small(name):
    import mixc
    op = mixc.load(name)
    return [x for d in op.ir.dims if not d.alias_of for x in ("--dim", f"{d.name}=8")]


@pytest.mark.parametrize("name", library_names())
def test_run_passes_for_every_library_spec(capsys, name):
    code, out, err = run(capsys, "run", name, "--mode", "torch", "--B", "1", "--T", "16", "--H", "2", *_small(name))
    assert code == 0 and "ok: every error within --tol 0.001" in out, out + err


@pytest.mark.parametrize("name", ["rwkv7", "delta_rule"])
def test_the_reported_nans_at_T128(capsys, name):
    # were nan: |S| = 2e32 with independent normal keys (delta rule) and a, b (RWKV-7)
    code, out, err = run(capsys, "run", name, "--mode", "torch", "--B", "1", "--T", "128", "--H", "1")
    assert code == 0 and "nan" not in out, out + err


def test_run_fails_when_an_error_exceeds_tol(capsys):
    code, out, err = run(capsys, "run", "gla", "--mode", "torch", "--T", "8", "--dim", "K=8", "--tol", "1e-12")
    assert code == 1 and "FAIL: output o: relative error" in err and "> --tol 1e-12" in err


def test_run_fails_on_values_that_are_not_finite(capsys, tmp_path):
    spec = tmp_path / "grow.mix"          # 4^T overflows float32 at T = 64, not float64
    spec.write_text("mixer grow\n  dims K, V\n  input q[K], k[K], v[V]\n  state S[K, V]\n"
                    "  update S = 4 * S + k * v\n  output o = q @ S\n")
    code, out, err = run(capsys, "run", str(spec), "--mode", "torch", "--T", "72", "--dim", "K=4", "--dim", "V=4")
    assert code == 1 and "FAIL: output o is not finite" in err


@pytest.mark.slow         # every library spec at T = 128 in its default mode, as a user runs it (~2 min)
@pytest.mark.parametrize("name", library_names())
def test_mixc_run_T128_default_mode(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "mixc.cli", "run", name, "--T", "128"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0 and "ok: every error within" in p.stdout, p.stdout + p.stderr

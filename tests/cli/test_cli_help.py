"""The CLI a person meets: `mixc --version`, every option's help with its default, the
remaining-time text of `mixc recall`'s progress (never negative), its progress lines, the hint
for the plots (mixc installs from its repository), and the plots' layout (the recall legend
outside the panels, the fla panel of `mixc bench`)."""
import argparse
import io
import re
from pathlib import Path

import pytest

import mixc
from mixc import recall
from mixc.argtypes import PLOT_HINT
from mixc.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())          # argparse's wrapping undone


def _option_help(out: str, option: str) -> str:
    """An option's entry in the options list of a help text (not the usage line)."""
    return out.split("options:", 1)[1].split(f" {option} ", 1)[1].split(" --", 1)[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mixc {mixc.__version__}"


@pytest.mark.parametrize("option, text", [
    ("--B", "batch size (default: 2)"), ("--T", "sequence length (default: 64)"), ("--H", "heads (default: 4)"),
    ("--seed", "seed of the random inputs (default: 0)"), ("--set", "set a flag option"),
    ("--tol", "(default: 0.001)"), ("--mode", "(default: auto)")])
def test_run_help_says_each_option_and_its_default(capsys, option, text):
    out = _help(capsys, "run")
    assert text in _option_help(out, option)


@pytest.mark.parametrize("option, text", [
    ("--batch", "sequences per training step (default: 32)"), ("--lr", "(default: 0.01)"),
    ("--vocab", "(default: 64)"), ("--layers", "layers of each model (default: 2)"),
    ("--eval", "held-out sequences each model is scored on (default: 512)"), ("--steps", "(default: 400)"),
    ("--lengths", "(default: 32,64)"), ("--specs", "(default: linear_attn, retention,")])
def test_recall_help_says_each_option_and_its_default(capsys, option, text):
    out = _help(capsys, "recall")
    assert text in _option_help(out, option)


def test_every_option_has_help_and_shows_its_default():
    """Every option of every command: a help text, and its default in it where it has one."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare, hidden = [], []
    for name, parser in sub.choices.items():
        fmt = parser._get_formatter()
        for a in parser._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            if not a.help:
                bare.append(f"{name} {a.option_strings[-1]}")
            elif a.default not in (None, False) and "default" not in fmt._get_help_string(a):
                hidden.append(f"{name} {a.option_strings[-1]}")
    assert not bare, f"options without help: {bare}"
    assert not hidden, f"options whose help hides the default: {hidden}"


def test_bench_help_and_the_readme_command_list(capsys):
    out = _help(capsys, "bench")
    assert "fla" in out and "(default: 256,1024,4096,16384)" in out
    readme = (ROOT / "README.md").read_text()
    commands = readme.split("Commands (", 1)[1].split("\n\n", 1)[0]
    for cmd in ("list", "check", "explain", "compile", "run", "bench", "recall", "--version"):
        assert f"mixc {cmd}" in commands, cmd


@pytest.mark.parametrize("seconds, text", [
    (None, "time left: ?"), (float("nan"), "time left: ?"), (-0.0, "~0 s left"), (-1e-9, "~0 s left"),
    (-30.0, "~0 s left"), (0.0, "~0 s left"), (42.4, "~42 s left"), (59.7, "~1.0 min left"),
    (210.0, "~3.5 min left"), (3 * 3600.0, "~3.0 h left")])
def test_eta_text(seconds, text):
    assert recall.eta_text(seconds) == text


def test_time_left_is_never_negative():
    assert recall.time_left(10.0, 0.0) is None                     # no progress yet: unknown
    assert recall.time_left(10.0, 0.5) == 10.0
    assert recall.time_left(10.0, 0.75, start=0.5) == 10.0         # the pace from the first step
    for frac in (1.0, 1.0 + 1e-12, 1.3):                           # the weights' sum may round past 1
        assert recall.time_left(10.0, frac) == 0.0
        assert "-" not in recall.eta_text(recall.time_left(10.0, frac))
    for s in (-0.0, -1e-12, 0.0, 1e-3):
        assert "-" not in recall.duration_text(s)


def test_progress_lines_in_a_log():
    """Not a terminal: a header, a line with each running model's step and the time left every
    `every` seconds, a line per finished run."""
    stream = io.StringIO()
    bar = recall.Progress([1.0, 3.0], 4, stream, labels=["a T=8 d=8", "b T=8 d=8"], every=0.0)
    bar.header(2)
    bar.step(0, 1, 2.5)
    bar.step(1, 2, 2.0)
    bar.step(1, 4, 1.5)
    bar.finish_run({"spec": "b", "seq_len": 8, "width": 8, "accuracy": 0.5, "state_size": 64, "train_s": 1.0}, 1)
    bar.step(1, 4, 1.5)                                            # a late message of a finished run: ignored
    lines = stream.getvalue().splitlines()
    assert lines[0] == "training 2 models, 4 steps each, 2 at a time"
    assert "time left: ?" in lines[1] and "a T=8 d=8 step 1/4 loss 2.500" in lines[1]
    assert "a T=8 d=8 step 1/4" in lines[2] and "b T=8 d=8 step 2/4 loss 2.000" in lines[2]
    assert re.search(r"~\d+ s left", lines[3])
    assert "| 1/2 b T=8 d=8: accuracy 0.500" in lines[4] and len(lines) == 5
    assert not any(re.search(r"~-", line) for line in lines)


def test_the_plot_hint_says_how_mixc_is_installed(tmp_path, capsys, monkeypatch):
    assert PLOT_HINT.startswith("pip install -e '.[bench]'")
    monkeypatch.setattr(recall, "plot", lambda rows, path: False)
    rows = [{"spec": "x", "seq_len": 8, "width": 8, "kv_pairs": 1, "state_size": 64, "accuracy": 0.5,
             "train_s": 1.0}]
    recall.write(rows, recall.RecallConfig(), tmp_path, 1.0)
    assert f"no plot: matplotlib is not installed; {PLOT_HINT}" in capsys.readouterr().out
    sources = [*(ROOT / "mixc").rglob("*.py"), *(ROOT / "examples").glob("*.py"), ROOT / "README.md",
               *(ROOT / "docs").glob("*.md")]
    assert not [str(p) for p in sources if "mixc[bench]" in p.read_text()], "a hint to install mixc from an index"


def test_bench_says_the_hint_and_explains_the_fla_columns(tmp_path, capsys, monkeypatch):
    from mixc import bench
    result = {"machine": {}, "spec": "gla", "rows": [
        {"impl": "torch_chunked", "T": 64, "H": 2, "D": 8, "backward": False, "ms": 1.0, "peak_mib": 1.0}],
        "compile": {"spec": "gla", "spec_to_source_ms": 1.0, "source_to_first_call_ms": 1.0}}
    fla = {"fla": "fla 0.6.0", "rows": [
        {"spec": "simple_gla", "T": 64, "B": 1, "backward": False, "mixc_ms": 1.0, "fla_ms": 2.0, "ratio": 0.5,
         "ratio_q1": 0.4, "ratio_q3": 0.6, "max_rel_diff": 1e-7, "mixc_faults": 3, "fla_faults": 5, "load": 1.2}]}
    monkeypatch.setattr(bench, "run", lambda *a, **k: result)
    monkeypatch.setattr(bench, "side_by_side", lambda *a, **k: fla)
    monkeypatch.setattr(bench, "plot", lambda *a, **k: False)
    args = build_parser().parse_args(["bench", "--T", "64", "-o", str(tmp_path)])
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "faults m/f" in out and "minor page faults per call, mixc / fla" in out
    assert "load average" in out and f"no plot: matplotlib is not installed; {PLOT_HINT}" in out
    assert (tmp_path / "cpu_bench_fla.json").is_file()


def test_recall_legend_is_outside_the_panels():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [{"spec": s, "seq_len": T, "width": d, "kv_pairs": T // 8, "state_size": d * 16, "accuracy": a}
            for s, a in (("x", 0.05), ("y", 0.95), ("z", 0.5)) for T in (64, 128) for d in (32, 64)]
    fig = recall.figure(rows, plt)
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["x", "y", "z"]
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent()), "the legend covers a panel"
    plt.close(fig)


def test_bench_plot_has_the_fla_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mixc import bench
    result = {"rows": [{"impl": i, "T": T, "backward": True, "ms": T / 10, "peak_mib": 1.0}
                       for i in bench.IMPLS for T in (64, 128)]}
    fla = {"fla": "fla 0.6.0", "rows": [{"spec": s, "T": T, "backward": b, "ratio": 0.5}
                                        for s in ("simple_gla", "delta_rule") for T in (64, 128) for b in (False, True)]}
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert bench.plot(result, tmp_path / "b.png", fla) and (tmp_path / "b.png").stat().st_size > 1000
    assert len(figs[0].axes) == 3 and figs[0].axes[2].get_ylabel() == "mixc ms / fla ms"
    assert len(figs[0].axes[2].get_lines()) == 4 + 1                  # 2 specs x 2 passes, and the line at 1
    assert bench.plot(result, tmp_path / "c.png", None)
    assert len(figs[1].axes) == 2                                      # without fla: time and memory

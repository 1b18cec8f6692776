"""The MQAR data, `mixc recall` end to end on a tiny grid, and the tiny LM example."""
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixc import cli
from mixc.recall import IGNORE, RecallConfig, mqar, stack, table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dense", [False, True], ids=["zoology", "dense"])
def test_mqar_answers_are_the_values_of_the_keys(dense):
    B, T, n, V = 16, 40, 5, 32
    x, y = mqar(B, T, n, V, torch.Generator().manual_seed(0), dense=dense)
    assert x.shape == y.shape == (B, T) and x.dtype == torch.long
    for b in range(B):
        keys, values = x[b, 0:2 * n:2].tolist(), x[b, 1:2 * n:2].tolist()
        assert len(set(keys)) == n and len(set(values)) == n
        assert all(1 <= k < V // 2 for k in keys) and all(V // 2 <= v < V for v in values)
        pairs = dict(zip(keys, values))
        asked = (y[b] != IGNORE).nonzero().flatten().tolist()
        assert all(p >= 2 * n for p in asked)                        # queries only after the context
        for p in asked:
            assert y[b, p].item() == pairs[x[b, p].item()] == x[b, p + 1].item()
        if dense:
            assert len(asked) == (T - 2 * n) // 2
        else:
            assert sorted(x[b, asked].tolist()) == sorted(keys)        # each key asked once
            rest = [t for t in range(2 * n, T) if t not in asked and t - 1 not in asked]
            assert all(x[b, t].item() == 0 for t in rest)             # filler


def test_mqar_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="num_kv_pairs"):
        mqar(2, 64, 16, 32)
    with pytest.raises(ValueError, match="seq_len"):
        mqar(2, 16, 5, 64)


def test_stack_and_config():
    assert stack("gla", 3) == ["gla"] * 3
    assert stack("gla+attention", 4) == ["gla", "attention", "gla", "attention"]
    assert RecallConfig().kv_pairs(64) == 16 and RecallConfig(kv_per_token=1 / 16).kv_pairs(128) == 8
    rows = [{"spec": "a", "seq_len": 16, "width": 8, "kv_pairs": 2, "accuracy": 0.5, "state_size": 20000}]
    assert "| a | 0.500 (20K) |" in table(rows)


def test_recall_command_end_to_end(tmp_path, capsys, monkeypatch):
    """A tiny grid through the CLI, two models trained at once in worker processes: a
    recurrent spec and a hybrid, files written, the plot skipped with a message when
    matplotlib cannot be imported."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)               # as if not installed
    monkeypatch.setattr("mixc.recall.LOG_EVERY", 0.0)                  # a progress line at every message
    out = tmp_path / "res"
    rc = cli.main(["recall", "--specs", "retention,retention+attention", "--lengths", "16", "--widths", "16",
                   "--steps", "3", "--batch", "4", "--eval", "8", "--vocab", "16", "--kv-per-token", "0.125",
                   "--jobs", "2", "-o", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "no plot: matplotlib is not installed" in captured.out
    assert "| 1/2 retention" in captured.err and "| 2/2 retention" in captured.err    # the progress lines
    # the workers' steps reach the parent's progress lines (a worker sends its first step at once)
    assert re.search(r"\| [01]/2 done \| .*T=16 d=16 step [123]/3 loss", captured.err), captured.err
    assert "training 2 models, 3 steps each, 2 at a time" in captured.err
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["spec"], r["layers"]) for r in rows] == [("retention", "retention/retention"),
                                                        ("retention+attention", "retention/attention")]
    for r in rows:
        assert 0 <= float(r["accuracy"]) <= 1 and int(r["kv_pairs"]) == 2
    # retention's state: 2 layers x H=1 x 16 x 16; the hybrid's attention layer caches 16 keys and values
    assert int(rows[0]["state_size"]) == 2 * 16 * 16
    assert int(rows[1]["state_size"]) == 16 * 16 + 16 * (16 + 16)
    assert "| retention+attention |" in (out / "results.md").read_text()
    assert json.loads((out / "config.json").read_text())["steps"] == 3
    assert not (out / "recall.png").exists()


def test_recall_command_rejects_unknown_specs(capsys):
    assert cli.main(["recall", "--specs", "gla+nosuch", "--steps", "1"]) == 1
    assert "no spec named nosuch" in capsys.readouterr().err


def test_recall_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from mixc.recall import plot
    rows = [{"spec": s, "seq_len": T, "width": d, "kv_pairs": T // 8, "state_size": d * 16, "accuracy": a}
            for s, a in (("x", 0.3), ("y", 0.9)) for T in (64, 128) for d in (32, 64)]
    assert plot(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000


def test_train_tiny_lm_example(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny_lm.py"), "--steps", "4", "--width", "16",
                        "--context", "16", "--batch", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "step    4  train loss" in p.stdout and "sample: 'The keeper " in p.stdout
    rows = list(csv.reader(open(tmp_path / "loss.csv")))
    assert rows[0] == ["step", "train_loss", "heldout_loss"] and len(rows) == 5


def test_recall_example_help():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "recall.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--specs" in p.stdout


def test_recall_run_in_process(tmp_path):
    """run() with one job trains in this process, the progress line per run on the stream."""
    import io
    from mixc.recall import run
    stream = io.StringIO()
    cfg = RecallConfig(specs=("hgrn",), lengths=(16,), widths=(16,), steps=2, batch=2, eval_sequences=4,
                       vocab_size=16, kv_per_token=1 / 8)
    rows = run(cfg, tmp_path, stream=stream)
    assert len(rows) == 1 and rows[0]["layers"] == "hgrn/hgrn" and rows[0]["state_size"] == 2 * 16
    assert "| 1/1 hgrn T=16 d=16: accuracy" in stream.getvalue()
    assert (tmp_path / "results.csv").is_file()


def test_recall_arguments_to_config():
    from mixc.recall import config_from_args
    a = cli.build_parser().parse_args(["recall", "--specs", "gla,attention", "--lengths", "32,64", "--queries", "once",
                                       "--fixed-pairs", "--jobs", "1"])
    cfg = config_from_args(a)
    assert cfg.specs == ("gla", "attention") and cfg.lengths == (32, 64) and cfg.jobs == 1
    assert not cfg.dense and not cfg.mixed
    d = config_from_args(cli.build_parser().parse_args(["recall"]))
    assert d == RecallConfig(jobs=d.jobs)                                # the CLI's defaults are the config's

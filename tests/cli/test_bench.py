"""`mixc bench` (CPU ratios measured in one run): a tiny run writes its JSON and table, and
the quadratic form it compares against is GLA itself."""
import json

import torch

from mixc import bench
from mixc.cli import main


def test_the_quadratic_form_is_gla():
    op, args = bench._inputs(T=37, H=2, D=8)
    want, _ = op(**{k: v.double() for k, v in args.items()}, mode="reference")
    got = bench._quadratic(*(args[n].double() for n in "qkvg"), 8 ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_bench_writes_json_and_a_table(tmp_path, capsys):
    assert main(["bench", "--T", "32,64", "--max-reference-T", "32", "--forward-only", "--no-fla", "-o",
                 str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_bench.json").read_text())
    impls = {(r["impl"], r["T"]) for r in result["rows"]}
    assert impls == {("torch_chunked", 32), ("torch_chunked", 64), ("reference", 32), ("quadratic", 32),
                     ("quadratic", 64)}
    assert all(r["ms"] > 0 for r in result["rows"]) and result["compile"]["spec_to_source_ms"] > 0
    out = capsys.readouterr().out
    assert "torch_chunked" in out and "compile (gla)" in out

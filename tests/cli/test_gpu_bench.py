"""bench/gpubench: the FLOP and byte formulas, fla's call conventions (mamba2 through fla's
simple_gla path, checked against mixc's own reference), the wheels folder, and the static
report on one op (sm_90, no GPU)."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import mixc
from mixc.runtime.inputs import random_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpubench import fla_ops, wheels  # noqa: E402
from gpubench import formulas as Fm  # noqa: E402


def test_formulas():
    K = V = 128
    assert Fm.chunk_flops("gla", K, V) == {"fwd": 2 * 64 * 256 + 4 * K * V, "fwd_bwd": 8 * 64 * K + 6 * 64 * V + 12 * K * V}
    d = Fm.chunk_flops("delta_rule", K, V)
    assert d["fwd"] > Fm.chunk_flops("gla", K, V)["fwd"] and d["fwd_bwd"] > 2 * d["fwd"]
    n_in, n_out = Fm.io_elements(mixc.load("simple_gla").ir, {"K": K, "V": V})
    assert (n_in, n_out) == (3 * 128 + 1, 128)
    assert Fm.floor_bytes(2 * K + V, V)["fwd"] == 4 * (K + V)              # q, k, v, o in bf16
    assert Fm.floor_bytes(n_in, n_out)["fwd_bwd"] == 2 * (3 * n_in + 2 * n_out)
    assert Fm.sdpa_flops(1023, 64, 64)["fwd"] * 1024 == 1024 * 1024 * 128  # B H T^2 (K+V) / 2, causal, at T+1
    assert Fm.floor_multiple(1e9, 1.0, 1e12) == pytest.approx(1.0)
    assert Fm.tflops(1e12, 1000.0) == pytest.approx(1.0)


def _stand_in_simple_gla(q, k, v, g=None, g_gamma=None, scale=None):
    """fla's chunk_simple_gla computed by mixc's float64 reference of simple_gla."""
    if g is None:
        g = torch.zeros(q.shape[:3], dtype=q.dtype) + (g_gamma if g_gamma is not None else 0)
    op = mixc.load("simple_gla")
    return op.reference(q=q, k=k, v=v, g=g, scale=q.shape[-1] ** -0.5 if scale is None else scale)


def test_mamba2_through_fla_simple_gla_path_equals_mixc_mamba2():
    op = mixc.load("mamba2")
    kw, _ = random_args(op.ir, B=2, T=9, H=3, sizes={"N": 4, "P": 5}, seed=3)
    got = fla_ops.call("mamba2", {"chunk_simple_gla": _stand_in_simple_gla}, kw)
    want, _ = op.reference(**kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _recorders(table: dict) -> tuple[dict, dict]:
    """Stand-ins for fla's functions of `table` that record their arguments in `seen` (name ->
    (args, keywords)) and return (the first argument, the initial state keyword or None)."""
    seen = {}

    def rec(name):
        def f(*args, **kw):
            seen[name] = (args, kw)
            return (args[0], kw.get("initial_state"))
        return f
    return seen, {name: rec(name) for _, name in table.values()}


def test_fla_argument_order():
    seen, fns = _recorders(fla_ops.FLA_NAMES)
    for spec in fla_ops.SPECS:
        if spec == "mamba2":
            continue
        op = mixc.load(spec)
        kw, _ = random_args(op.ir, B=1, T=2, H=1, sizes={"K": 4, "V": 4})
        fla_ops.call(spec, fns, kw)
        args, extra = seen[fla_ops.FLA_NAMES[spec][1]]
        names = [next(n for n, t in kw.items() if t is a) for a in args]
        assert names == {"linear_attn": ["q", "k", "v"], "retention": ["q", "k", "v"],
                         "simple_gla": ["q", "k", "v"], "gla": ["q", "k", "v"],
                         "delta_rule": ["q", "k", "v", "beta"], "gated_delta_rule": ["q", "k", "v", "g", "beta"],
                         "rwkv6": ["r", "k", "v", "w", "u"]}[spec], spec
        assert extra == ({"normalize": False} if spec == "linear_attn" else
                         {"g": kw["g"]} if spec in ("simple_gla", "gla") else {})


def test_fla_decode_argument_order():
    """fla's fused recurrent kernels at T = 1: mixc's inputs in fla's order, the state in and out."""
    seen, fns = _recorders(fla_ops.FLA_DECODE)
    for spec in fla_ops.SPECS:
        if spec == "mamba2":
            continue
        op = mixc.load(spec)
        kw, _ = random_args(op.ir, B=2, T=1, H=1, sizes={"K": 4, "V": 4})
        S = torch.randn(2, 1, 4, 4)
        fla_ops.call_step(spec, fns, kw, S)
        args, extra = seen[fla_ops.FLA_DECODE[spec][1]]
        names = [next(n for n, t in kw.items() if t is a) for a in args]
        assert names == {"linear_attn": ["q", "k", "v"], "retention": ["q", "k", "v"],
                         "simple_gla": ["q", "k", "v"], "gla": ["q", "k", "v"],
                         "delta_rule": ["q", "k", "v", "beta"], "gated_delta_rule": ["q", "k", "v"],
                         "rwkv6": ["r", "k", "v", "w", "u"]}[spec], spec
        assert extra.pop("initial_state") is S and extra.pop("output_final_state") is True
        assert extra == ({"normalize": False} if spec == "linear_attn" else {"g": kw["g"]} if spec == "simple_gla"
                         else {"gk": kw["g"]} if spec == "gla" else {"g": kw["g"], "beta": kw["beta"]}
                         if spec == "gated_delta_rule" else {}), spec


def test_mamba2_decode_through_fla_simple_gla_path_equals_mixc_step():
    """mamba2's decode step through fla's fused_recurrent_simple_gla (a stand-in computing
    simple_gla's float64 reference from the state) equals mixc's own reference step."""
    def stand_in(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
        o, st = mixc.load("simple_gla").reference(q=q, k=k, v=v, g=g, scale=scale,
                                                  initial_state={"S": initial_state}, output_final_state=True)
        return o, st["S"]                        # fla returns the state as a tensor

    op = mixc.load("mamba2")
    kw, _ = random_args(op.ir, B=2, T=1, H=3, sizes={"N": 4, "P": 5}, seed=5)
    S = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    o, new = fla_ops.call_step("mamba2", {"fused_recurrent_simple_gla": stand_in}, kw, S)
    want, want_state = op.reference(**kw, initial_state={"S": S}, output_final_state=True)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(new, want_state["S"], rtol=1e-10, atol=1e-10)


def test_wheels_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert wheels.activate(tmp_path / "none")["wheels"] == []
    whl = tmp_path / "w" / "mixc_fake_pkg-1.0-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("mixc_fake_pkg/__init__.py", "VALUE = 7\n")
    (tmp_path / "w" / "flash_linear_attention-0.6.0-py3-none-any.whl").write_bytes(b"not read")
    info = wheels.activate(tmp_path / "w")
    assert info["wheels"] == [whl.name] and sys.path[-1] == info["site"]
    import mixc_fake_pkg
    assert mixc_fake_pkg.VALUE == 7


@pytest.mark.slow
def test_static_report_one_op(tmp_path):
    """mixc's chunked kernels of simple_gla (and fla's, where bench/wheels holds fla) compiled
    for sm_90 through the stand-in driver; tensor cores in every chunked kernel of mixc."""
    have_fla = any((ROOT / "bench" / "wheels").glob("fla_core-*.whl"))
    impls = ["mixc", "fla"] if have_fla else ["mixc"]
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "static_report"), "--specs", "simple_gla", "--dim", "16",
                        "--H", "2", "--T", "64", "--out", str(tmp_path), "--impls", *impls],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads((tmp_path / "static_report.json").read_text())["rows"]
    mine = [r for r in rows if r["impl"] == "mixc"]
    # the untuned CUDA launch: two launches per direction (the walk, then the output or tiles kernel)
    assert {(r["phase"], r["kernel"]) for r in mine} == {
        ("fwd", "simple_gla_chunk_fwd_walk"), ("fwd", "simple_gla_chunk_fwd_output"),
        ("bwd", "simple_gla_chunk_bwd_walk"), ("bwd", "simple_gla_chunk_bwd_tiles")}
    # tensor cores in every kernel (at K = V = 16 the walk's small products take mma.sync)
    assert all(r["tensor_cores"] in ("wgmma", "mma.sync") and r["registers"] and r["shared_bytes"] > 0 for r in mine)
    assert all(r["tensor_cores"] == "wgmma" for r in mine if not r["kernel"].endswith("_walk"))
    if have_fla:
        theirs = [r for r in rows if r["impl"] == "fla"]
        assert {"chunk_fwd_kernel_h", "chunk_fwd_kernel_o", "chunk_bwd_kernel_dh"} <= {r["kernel"] for r in theirs}
    assert "| simple_gla |" in (tmp_path / "static_report.md").read_text()


def test_table_and_plots_of_a_gpu_shaped_result(tmp_path):
    """The table and plots of a result as a GPU run writes it (fla and both SDPA backends
    timed, ratios filled, decode in graphs), from synthetic numbers."""
    from gpubench import report
    rows = []
    for section, shapes in (("fla_set", [(4, 2048, 16, 128), (8, 1024, 8, 64)]),
                            ("sweep", [(128, 512, 16, 64), (1, 65536, 16, 64)])):
        for (B, T, H, D) in shapes:
            base = {"section": section, "B": B, "T": T, "H": H, "D": D}
            for p, f in (("fwd", 1.0), ("fwd_bwd", 3.0)):
                for impl in ("sdpa_flash", "sdpa_cudnn"):
                    rows.append(dict(base, spec="attention", impl=impl, **{"pass": p, "ms": f, "tflops": 100.0,
                                                                           "floor_x": 5.0}))
                for spec in ("gla", "mamba2"):
                    rows.append(dict(base, spec=spec, impl="mixc", C=16, **{"pass": p, "ms": 2 * f, "tflops": 50.0,
                                     "floor_x": 10.0, "ratio_fla": 2.0, "ratio_sdpa": 2.0}))
                    rows.append(dict(base, spec=spec, impl="fla", **{"pass": p, "ms": f, "tflops": 100.0,
                                     "floor_x": 5.0, "ratio_fla": 2.0, "ratio_sdpa": 1.0}))
    rows.append({"section": "fla_set", "B": 8, "T": 2048, "H": 32, "D": 256, "spec": "gla", "impl": "mixc",
                 "error": "OutOfResources: shared memory"})
    dec = [{"section": "decode", "spec": "gla", "impl": impl, "B": 64, "H": 16, "D": 128, "context": None,
            "ms": ms, "graph": True, "note": None, "tflops": 1.0, "floor_x": 3.0, "ratio_fla": 2.0}
           for impl, ms in (("mixc", 0.05), ("fla", 0.025))]
    dec += [{"section": "decode", "spec": "attention", "impl": "sdpa_flash", "B": 64, "H": 16, "D": 128,
             "context": L, "ms": L / 1e4, "graph": True, "note": None, "tflops": 1.0, "floor_x": 1.5}
            for L in (1024, 65536)]
    res = {"device": "NVIDIA-H200", "dtype": "bf16", "correctness": [{"spec": "gla", "mode": "chunk",
                                                                      "dtype": "bfloat16", "ok": True}],
           "timing": rows, "decode": dec, "skipped": [{"section": "sweep", "shape": (2, 32768, 16, 128),
                                                       "why": "time budget"}]}
    text = report.table(res)
    assert "correctness: 1 passed, 0 failed" in text
    line = next(x for x in text.splitlines() if x.startswith("gla") and " mixc " in x and " fwd_bwd" in x)
    assert line.split()[-3:] == ["2", "2", "10"]              # x fla, x SDPA, x floor (geometric means)
    assert "OutOfResources" in text and "time budget" in text
    assert "x SDPA@1024: 0.488" in text and "CUDA graph" in text and "x fla: 2" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert report.plots(res, tmp_path) == ["timing.png", "sweep.png", "decode.png"]

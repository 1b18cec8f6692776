"""bench/gpubench/traffic.py and ttir_flops.py: the byte and FLOP counts of the traffic report
on a toy kernel whose traffic is known, compiled for sm_90 through the stand-in driver (a
process of its own), and fla's Hopper block sizes under that driver (device index 0)."""
import json

import pytest
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TOY = '''
import triton
import triton.language as tl


@triton.jit
def toy(x, y, z, w, n, BLOCK: tl.constexpr):
    """x [G, n, B, B] loaded through a loop-carried pointer, a dot per trip (and one more in
    program 0); y [G, B] stored through a tensor descriptor; z [B] atomically added (read and
    written); w passed and never touched."""
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    p = x + pid * n * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :]
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for i in range(n):
        a = tl.load(p)
        acc += tl.dot(a, a)
        p += BLOCK * BLOCK
    if pid == 0:
        acc += tl.dot(acc, acc)
    d = tl.make_tensor_descriptor(y, shape=[n * 0 + 4096, BLOCK], strides=[BLOCK, 1], block_shape=[1, BLOCK])
    d.store([pid, 0], tl.sum(acc, 0)[None, :])
    tl.atomic_add(z + r, tl.sum(acc, 1))
'''

DRIVER = '''
import json, sys
sys.path[:0] = [{bench!r}, {tmp!r}]
from gpubench import fakecuda
fakecuda.install()
import torch
from gpubench.traffic import launches_of, torch_traffic_mode
from toy_kernel import toy
G, n, B = 3, 5, 16
x, y, z, w = torch.randn(G, n, B, B), torch.empty(G, B), torch.randn(B), torch.randn(7)
with torch_traffic_mode(fakecuda.RECORDS, fakecuda.PHASE):
    fakecuda.PHASE["name"] = "fwd"
    x2 = (x.view(-1) * 2).view(x.shape)        # a torch op between kernels; the views move nothing
    toy[(G,)](x2, y, z, w, n, BLOCK=B)
    torch.zeros_like(z)                        # writes z's size, reads nothing
out = {{"launches": launches_of(fakecuda.RECORDS), "nbytes": [t.numel() * 4 for t in (x, y, z, w)]}}
try:
    import fla.utils.hardware as hw
    before = hw.check_shared_mem("hopper", None)
    hw.check_shared_mem.cache_clear()
    fakecuda.fla_on_device_0()
    out["fla_hopper"] = [before, hw.check_shared_mem("hopper", None), hw.check_shared_mem("hopper", 0)]
except ImportError:
    pass
print("@@" + json.dumps(out))
'''


def test_toy_kernel_traffic_and_flops(tmp_path):
    (tmp_path / "toy_kernel.py").write_text(textwrap.dedent(TOY))
    code = DRIVER.format(bench=str(ROOT / "bench"), tmp=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="0"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("@@"))[2:])
    xb, yb, zb, _ = out["nbytes"]
    mul, kernel, zeros = out["launches"]
    assert (zeros["kernel"], zeros["read"], zeros["written"]) == ("torch zeros_like", 0, zb)
    assert (mul["kind"], mul["kernel"], mul["read"], mul["written"]) == ("torch", "torch mul", xb, xb)
    assert kernel["kernel"] == "toy" and kernel["grid"] == [3, 1, 1]
    assert (sorted(kernel["reads"]), sorted(kernel["writes"])) == (["x", "z"], ["y", "z"])     # w: untouched
    assert (kernel["read"], kernel["written"]) == (xb + zb, yb + zb)
    dot = 2 * 16 ** 3
    assert kernel["flops"] == 3 * 5 * dot + dot         # n trips in each of 3 programs, one more in program 0
    if "fla_hopper" in out:     # fla's check_shared_mem(arch, tensor.device.index): a CPU tensor's index is None
        assert out["fla_hopper"] == [False, True, True]


@pytest.mark.slow
def test_the_reports_compile_mixcs_kernels_through_the_stand_in_driver(tmp_path):
    """bench/static_report and bench/traffic_report on one op, mixc only: every launch compiled
    for sm_90 through the stand-in driver, no row an error (the launcher's device check refused
    the CPU tensors that stand in for CUDA and every mixc row read 'KernelUnavailable' once)."""
    for script in ("static_report", "traffic_report"):
        out = tmp_path / script
        p = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--specs", "linear_attn", "--impls", "mixc",
                            "--dim", "32", "--T", "256", "--H", "2", "--jobs", "1", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (script, p.stdout[-2000:], p.stderr[-2000:])
        rows = json.loads(next(out.glob("*.json")).read_text())
        rows = rows.get("rows") or rows.get("results")
        assert rows and not any("error" in r for r in rows), rows

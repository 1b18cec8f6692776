"""Every generated kernel of every library spec compiles for sm_90 and sm_80 with the real
Triton compiler (no GPU needed), in a process without the interpreter."""
import json
import os
import subprocess
import sys

from mixc.dsl import library_names


def test_every_kernel_compiles_for_sm90_and_sm80(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.codegen.aot", *library_names()],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout)
    got = {(r["spec"], r["kernel"], r["arch"]) for r in reports}
    want = {(n, k, a) for n in library_names() for k in ("recurrent_fwd", "recurrent_bwd")
            for a in ("sm_90", "sm_80")}
    assert got == want
    for r in reports:
        assert r["cubin_bytes"] > 0
        assert r["shared_bytes"] <= 227 * 1024, r

"""Every generated kernel of every library spec compiles for sm_90 and sm_80 with the real
Triton compiler (no GPU needed), in a process without the interpreter."""
import json
import os
import subprocess
import sys

import pytest

import mixc
from mixc.derive.layout import chunk_supported
from mixc.dsl import library_names


ARCHS = [pytest.param(("sm_90",), ("walk", "output", "tiles", "intra"), id="sm90"),
         pytest.param(("sm_90", "sm_80"), ("fused", "walk", "output", "refill", "intra", "tiles"),
                      id="sm90-sm80-every-stage", marks=pytest.mark.slow)]
FORWARD = {"fused", "walk", "output", "refill", "intra"}
BACKWARD = {"fused", "walk", "tiles"}


@pytest.mark.parametrize("archs,stages", ARCHS)
def test_every_kernel_compiles(tmp_path, archs, stages):
    """The default run: sm_90 (the H100/H200 we benchmark on), the chunked kernels of the two
    launches each direction takes on CUDA by default (walk and output, walk and tiles) and the
    forward's intra kernel where the spec stages its intra-chunk matrices (the key-diagonal
    ones). Behind -m slow: sm_80 too, the fused kernels (the walk alone, the tuner's other
    choice) and the forward's refill (the backward's refill of the states between checkpoints:
    the output kernel's walk storing states instead of outputs; simple_gla's compiles in the
    default run, tests/cli/test_cli.py); about 6 minutes on 2 cores."""
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    arch_args = [x for a in archs for x in ("--arch", a[3:])]
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", *arch_args,
                        "--stages", ",".join(stages), *library_names()],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout)
    got = {(r["spec"], r["kernel"], r["arch"]) for r in reports}
    # sequence mixers (conv, mix, attend) are computed by torch: aot compiles nothing for them
    sequence = set(library_names("sequence"))
    assert sequence == {"aft_conv", "aft_full", "attention", "gmlp", "hyena", "mlp_mixer", "swa"}
    assert not {r["spec"] for r in reports} & sequence
    recurrent = library_names("recurrent")
    chunked = {n for n in recurrent if chunk_supported(mixc.load(n).plan()) is None}
    want = {(n, k, a) for n in recurrent for k in ("recurrent_fwd", "recurrent_bwd") for a in archs}
    staged = {n for n in chunked if mixc.load(n).plan().layout.intra_matrices}
    # the key-diagonal readouts' A, and the rank-1 setup's inverse (launch.STAGE_SOLVE)
    assert staged == {"gla", "hgrn2", "rwkv6", "s4d", "rwkv5", "delta_rule", "gated_delta_rule", "comba", "kda", "rwkv7"}
    want |= {(n, f"chunk_{d}_{s}", a) for n in chunked for d in ("fwd", "bwd") for s in stages for a in archs
             if s in (FORWARD if d == "fwd" else BACKWARD) and (s != "intra" or n in staged)}
    # a 2x2 block-affine system's own chunked kernels (runtime/system_kernels.py: not generated per spec)
    systems = {n for n in recurrent if mixc.load(n).plan().systems and "chunk" in mixc.load(n).plan().forms}
    assert systems == {"titans"}
    want |= {(n, f"system_chunk_{d}", a) for n in systems for d in ("fwd", "bwd") for a in archs}
    assert got == want
    # every class but the elementwise one (mamba) and the block-affine system (titans: the system's
    # own kernels above, see docs/design-notes.md); rank-r (gated_delta_product) is chunked too
    assert set(recurrent) - chunked == {"mamba", "titans"}
    # the rank-1 intra kernel of a per-key decay has no matmul: its A is a [C, C, K] sum, its inverse
    # a substitution
    per_key = {n for n in staged if mixc.load(n).plan().states[0].decay_dims and n not in ("gla", "hgrn2", "rwkv6", "rwkv5", "s4d")}
    assert per_key == {"kda", "rwkv7"}
    for r in reports:
        assert r["cubin_bytes"] > 0
        assert r["shared_bytes"] <= 227 * 1024, r
        if r["kernel"].startswith("chunk_") and (r["spec"], r["kernel"]) not in {(n, "chunk_fwd_intra") for n in per_key}:
            # the matmuls run on tensor cores
            assert r["tensor_cores"] in (("wgmma", "mma.sync") if r["arch"] == "sm_90" else ("mma.sync",)), r
    # at least the scalar-decay and prefix-sum chunks reach Hopper's wgmma
    assert {r["spec"] for r in reports if r["tensor_cores"] == "wgmma"} >= {"simple_gla", "mamba2", "linear_attn"}


KEY_SPLIT = ["gla", "rwkv6", "gated_delta_rule", "kda", "simple_gla", "mamba2"]
KEY_WALK = ["gla", "rwkv6"]
KEY_WALK_REST = ["hgrn2", "s4d"]
KEY_SPLIT_REST = ["hgrn2", "s4d", "delta_rule", "comba", "rwkv7", "retention", "lightning_attn", "mlstm",
                  "linear_transformer", "performer"]


@pytest.mark.parametrize("specs,forms", [
    pytest.param(KEY_SPLIT, ("fwd", "bwd"), id="classes"),
    pytest.param(KEY_SPLIT_REST, ("fwd",), id="the-rest", marks=pytest.mark.slow),
    pytest.param(["hgrn2", "retention", "lightning_attn"], ("bwd",), id="the-rest-bwd", marks=pytest.mark.slow)])
def test_the_forward_key_loop_compiles(tmp_path, specs, forms):
    """The chunked forward's output and intra kernels and the backward's tiles kernel with their loops over key
    blocks (codegen/key_split.py: KEY_BLOCK 16 of a key dim of 64, one chunk a program) compile
    for sm_90 with the real Triton
    compiler, whose loops keep a variable's type (the interpreter does not check it), on tensor
    cores, within shared memory. Every library spec the pass splits (tests/codegen/
    test_key_split.py), as the launch policy runs them on a GPU where a program takes one chunk:
    one of each class in the default run (a staged key-diagonal A: gla; its prev readout: rwkv6;
    rank-1 with a scalar and a per-key decay; the scalar decay, Mamba-2's; their backwards, split
    or not), the rest behind -m slow (30 s; performer's backward at 64 compiles for minutes
    with or without the loop, left out)."""
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", "--arch", "90", "--size", "64",
                        "--forms", ",".join(f"chunk_{d}" for d in forms), "--stages", "output,intra,tiles", "--key-block", "16",
                        *specs],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout)
    # the key-diagonal readouts' A, the rank-1 setup's inverse (launch.STAGE_SOLVE)
    staged = {"gla", "rwkv6", "rwkv5", "hgrn2", "s4d", "gated_delta_rule", "kda", "delta_rule", "comba", "rwkv7"} & set(specs)
    assert {(r["spec"], r["kernel"]) for r in reports} == \
        {(n, "chunk_fwd_output" if d == "fwd" else "chunk_bwd_tiles") for n in specs for d in forms} | \
        {(n, "chunk_fwd_intra") for n in staged if "fwd" in forms}
    for r in reports:
        assert r["cubin_bytes"] > 0 and r["shared_bytes"] <= 227 * 1024, r
        # kda's and rwkv7's intra kernels have no matmul (a per-key rank-1 decay: A a [C, C, K] sum, as
        # test_every_kernel_compiles finds: its per_key)
        assert r["tensor_cores"] in ("wgmma", "mma.sync") or \
            (r["spec"], r["kernel"]) in {("kda", "chunk_fwd_intra"), ("rwkv7", "chunk_fwd_intra")}, r


@pytest.mark.parametrize("specs", [pytest.param(KEY_WALK, id="classes"),
                                   pytest.param(KEY_WALK_REST, id="the-rest", marks=pytest.mark.slow)])
def test_the_static_key_walk_compiles(tmp_path, specs):
    """The chunked forward's output kernel walking two chunks a program with its state in static key
    blocks (codegen/key_walk.py: KEY_BLOCK 16 of a key dim of 64, four of its eight copies, each carried
    through the chunk loop under its constexpr test) compiles for sm_90 with the real compiler
    (a loop-carried value must keep its type and exist before the loop: the interpreter checks
    neither), on tensor cores, within shared memory."""
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", "--arch", "90", "--size", "64",
                        "--forms", "chunk_fwd", "--stages", "output", "--key-block", "16", "--ckpt-every", "2", *specs],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout)
    assert {(r["spec"], r["kernel"]) for r in reports} == {(n, "chunk_fwd_output") for n in specs}
    for r in reports:
        assert r["cubin_bytes"] > 0 and r["shared_bytes"] <= 227 * 1024, r
        assert r["tensor_cores"] in ("wgmma", "mma.sync"), r


def test_the_staged_rank1_inverse_compiles(tmp_path):
    """launch.STAGE_SOLVE's path (on by default at run time; the other compiles take the solve in
    the walk, so both paths compile):
    the intra kernel storing each chunk's inverse, the walk and the output kernel (its key loop:
    KEY_BLOCK 16 of 64) taking U by one matmul with it, and the backward's walk taking U and
    dY = (I - M)^-T dU by matmuls with it (its _staged variant), for sm_90 with the real compiler, on
    tensor cores; the per-key decay's intra kernel (KDA) has no matmul."""
    env = dict(os.environ, TRITON_INTERPRET="0", MIXC_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mixc.tools.aot", "--arch", "90", "--size", "64",
                        "--forms", "chunk_fwd,chunk_bwd", "--stages", "walk,output,intra", "--key-block", "16",
                        "--stage-solve", "gated_delta_rule", "kda"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout)
    assert {(r["spec"], r["kernel"]) for r in reports} == {
        (n, f"chunk_fwd_{s}") for n in ("gated_delta_rule", "kda") for s in ("walk", "output", "intra")} | {
        (n, "chunk_bwd_walk") for n in ("gated_delta_rule", "kda")}
    for r in reports:
        assert r["cubin_bytes"] > 0 and r["shared_bytes"] <= 227 * 1024, r
        assert r["tensor_cores"] in ("wgmma", "mma.sync") or (r["spec"], r["kernel"]) == ("kda", "chunk_fwd_intra"), r

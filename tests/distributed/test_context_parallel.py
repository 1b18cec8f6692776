"""Context parallelism on the CPU: 2 and 4 gloo processes, each holding a contiguous shard of
the sequence; forward, final state and every gradient equal the single-process op on the
whole sequence (float64 through the torch backend; the chunked kernels under the
interpreter at small sizes)."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from . import cp_workers

SIZES = {"K": 4, "V": 3, "N": 3, "P": 5, "D": 4}


def chunked_library_specs() -> list[str]:
    """Every library spec with a chunked form (the shard's Phi is its torch form's): all the
    transition classes (prefix sum, scalar, key, value, elementwise, rank-1 with and without a
    per-key decay, the stabilized mLSTM, the rank-r DeltaProduct)."""
    import mixc
    from mixc.dsl import library_names
    return [n for n in library_names("recurrent") if mixc.load(n).plan().layout.torch_chunked
            and not mixc.load(n).plan().systems]      # a block-affine system is refused (below)


TORCH_CASES = [dict(name=n, mode="torch", dtype=torch.float64, T=23, sizes=SIZES) for n in chunked_library_specs()]


def spawn(world: int, cases: list, tmp_path) -> None:
    mp.spawn(cp_workers.cp_cases, args=(world, str(tmp_path / "store"), cases), nprocs=world, join=True)


def test_every_chunked_library_spec_is_covered():
    assert len(TORCH_CASES) >= 18 and {"gla", "delta_rule", "rwkv7", "mamba", "hgrn", "mlstm",
                                       "gated_delta_product", "mamba3"} <= {c["name"] for c in TORCH_CASES}


# 4 ranks behind -m slow (15 s); 3 uneven ranks run by default below
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_equals_one_process(world, tmp_path):
    spawn(world, TORCH_CASES, tmp_path)


def test_context_parallel_uneven_shards_and_packed_sequences(tmp_path):
    # 3 ranks of 9, 2 and 13 tokens; sequences of 4, 12 (crossing all three ranks), 0 and 8
    cu = [0, 4, 16, 16, 24]
    cases = [dict(name=n, mode="torch", dtype=torch.float64, T=24, sizes=SIZES, cu_seqlens=cu, lengths=[9, 2, 13])
             for n in ("gla", "gated_delta_rule", "mamba", "gated_delta_product", "mamba3")]
    spawn(3, cases, tmp_path)


@pytest.mark.slow     # 13 s; the CP logic runs for every chunked spec through the torch backend above
def test_context_parallel_through_the_interpreted_kernels(tmp_path):
    cases = [dict(name=n, mode=mode, dtype=torch.float32, T=20, sizes={"K": 4, "V": 4}, tol=1e-4)
             for n, mode in (("simple_gla", "chunk"), ("delta_rule", "chunk"), ("mamba3", "chunk"))]
    spawn(2, cases, tmp_path)


@pytest.mark.parametrize("where", ["sequence-mixer", "step"])
def test_cp_group_refused_where_there_is_no_shard_summary(where):
    """A sequence mixer (attention: would need ring attention) and step() (one token) say why
    they take no cp_group, before any collective is attempted."""
    import mixc
    from mixc.runtime.inputs import random_args
    from mixc.runtime.signature import ArgumentError
    name = "attention" if where == "sequence-mixer" else "gla"
    op = mixc.load(name)
    kw, sizes = random_args(op.ir, B=1, T=4, H=1, sizes={d.name: 4 for d in op.ir.dims if not d.alias_of})
    with pytest.raises(ArgumentError, match="cp_group: not accepted here; " +
                       ("mixer 'attention' mixes with conv, mix or attend.*ring attention" if where == "sequence-mixer"
                        else r"step\(\) takes one token per sequence")):
        if where == "step":
            names = {d.name for d in op.ir.inputs}
            op.step(**{k: (v[:, 0] if k in names else v) for k, v in kw.items()},
                    state={"S": torch.zeros(1, 1, 4, 4)}, cp_group=object())
        else:
            op(**kw, cp_group=object())


def test_mixer_layer_with_cp_group(tmp_path):
    """MixerLayer on 3 uneven shards (5, 3 and 9 tokens: the short conv of 4 reads across each
    boundary) equals the layer on the whole sequence: output, dx and every param's gradient."""
    mp.spawn(cp_workers.layer_cp, args=(3, str(tmp_path / "store"), ["gla", "mamba2"], [5, 3, 9]), nprocs=3,
             join=True)


def test_ranks_that_disagree_raise_the_same_error_on_every_rank(tmp_path):
    """B, H, K, dtype, an option, a flag, cu_seqlens or the spec differing across 2 ranks (or one
    rank refusing its own arguments): the same ArgumentError on both, before any other collective."""
    mp.spawn(cp_workers.disagreeing_ranks, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def test_context_parallel_keeps_float64(tmp_path):
    """float64 in mode torch: outputs, final states and gradients within 1e-12 of one process
    (the shards' initial states were cast to float32: 1.4e-8 off, issue 30), packed too."""
    cases = [dict(name="gated_delta_rule", mode="torch", dtype=torch.float64, T=23, sizes=SIZES, tol=1e-12),
             dict(name="gla", mode="torch", dtype=torch.float64, T=24, sizes=SIZES, tol=1e-12,
                  cu_seqlens=[0, 4, 16, 16, 24])]
    spawn(2, cases, tmp_path)


"""DistributedDataParallel and FSDP (fully_shard) on gloo, 2 processes with half the batch
each: one training step of a MixerLM gives the same loss, gradients and updated params as
one process on the whole batch (float64, the torch backend), for gla and mamba2 (spec params A, D, dt_bias among the module params)."""
import pytest
import torch.multiprocessing as mp

from . import dp_workers


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_data_parallel_step_equals_one_process(kind, tmp_path):
    mp.spawn(dp_workers.ddp_and_fsdp, args=(2, str(tmp_path / "store"), ["gla", "mamba2"], kind), nprocs=2,
             join=True)

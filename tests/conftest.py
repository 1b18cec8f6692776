import os
import sys
from pathlib import Path

import pytest

# Kernels run on CPU tensors in Triton's interpreter, which must be chosen before Triton is
# first imported. Generated modules go to a fresh cache per test session, and kernels write
# into NaN-poisoned buffers so that an element they forget shows up.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MIXC_POISON"] = "1"
if "MIXC_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MIXC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixc-test-cache-")

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def chunk_calls(monkeypatch):
    """The chunk sizes mode='torch' ran its chunk-at-a-time loop with (it serves the rank-r and
    per-value-column classes): tests check which form ran and at which C."""
    from mixc.runtime import torch_chunk     # lazy: after the environment above is set
    calls = []
    run = torch_chunk.torch_forward_loop

    def spy(*args, **kw):
        calls.append(kw["C"])
        return run(*args, **kw)
    monkeypatch.setattr(torch_chunk, "torch_forward_loop", spy)
    return calls

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


@pytest.fixture(autouse=True)
def _bounds_checked_kernels():
    """MIXC_BOUNDS_CHECK=1: every interpreted kernel launch of every test is bounds-checked
    (tests/interpreter_bounds.py), a test failing on an access outside its launch's tensors
    even where the autotuner or the test itself catches the error."""
    if os.environ.get("MIXC_BOUNDS_CHECK") != "1":
        yield
        return
    from interpreter_bounds import bounds_checked
    with bounds_checked() as seen:
        yield
    assert not seen["errors"], f"{len(seen['errors'])} access(es) out of bounds; the first: {seen['errors'][0]}"

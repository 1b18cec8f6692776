import os
import sys
from pathlib import Path

# Kernels run on CPU tensors in Triton's interpreter, which must be chosen before Triton is
# first imported. Generated modules go to a fresh cache per test session, and kernels write
# into NaN-poisoned buffers so that an element they forget shows up.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MIXC_POISON"] = "1"
if "MIXC_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MIXC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixc-test-cache-")

sys.path.insert(0, str(Path(__file__).parent))

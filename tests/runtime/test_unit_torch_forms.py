"""The torch side of the transition-class units (mixc/classes/): each class with a torch form
has its chunk there, and the units' torch code is imported only when a torch form runs."""
import subprocess
import sys

import pytest

from mixc import classes
from mixc.classes.base import TransitionClass


def test_derive_does_not_import_torch():
    """derive imports the units; `mixc check` and `explain` must not pay torch's import (~4 s):
    the units import mixc.classes.torch_ops only inside their torch methods."""
    code = "import sys, mixc.classes, mixc.derive.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("unit", [u for u in classes.CLASSES if u.torch_chunked], ids=lambda u: u.name)
def test_a_torch_chunked_unit_has_its_chunk_and_shard_summary(unit):
    """A class the torch backend's chunked form serves says how one chunk reads out and
    updates (the loop runs every class) and how a shard's state maps (context parallelism)."""
    for method in ("torch_readout", "torch_advance", "cp_apply"):
        assert getattr(type(unit), method) is not getattr(TransitionClass, method), f"{unit.name}: no {method}"

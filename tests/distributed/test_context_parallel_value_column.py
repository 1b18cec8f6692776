"""Context parallelism for the per-value-column rank-1 class (mixc/classes/value_column.py): a
shard's transition is one [K, K] map per value column (cp_transition: the torch form's chunks
run on each column's identity with the values 0), folded into the next ranks' initial states.
Exact Longhorn and the delta rule with a value-diagonal decay (examples/) on 2 uneven ranks,
fixed length and packed sequences crossing the ranks: forward, final state and every gradient
equal the single-process op (float64, the torch backend; cp_workers.check_cp)."""
from __future__ import annotations

from pathlib import Path

import torch

from .test_context_parallel import SIZES, spawn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_value_column_context_parallel(tmp_path):
    cases = []
    for name in ("longhorn_exact", "delta_rule_value_decay"):
        spec = str(EXAMPLES / f"{name}.mix")
        cases += [dict(name=spec, mode="torch", dtype=torch.float64, T=23, sizes=SIZES, lengths=[9, 14]),
                  dict(name=spec, mode="torch", dtype=torch.float64, T=24, sizes=SIZES, cu_seqlens=[0, 4, 16, 16, 24],
                       lengths=[9, 15])]
    spawn(2, cases, tmp_path)

"""The transition classes of a state (DESIGN.md section 1), named once for derive/plan.py,
which finds them, and derive/layout.py, which decides from them which kernels exist."""

PREFIX_SUM = "prefix sum"
SCALAR = "scalar decay"
KEY_DIAG = "key-diagonal decay"
VALUE_DIAG = "value-diagonal decay"
ELEMENTWISE = "elementwise decay"
RANK1 = "rank-1 correction"
GENERAL = "general linear"

# Parallel algorithm of each class (the recurrent and step forms exist for every class).
CHUNK_CLASSES = (PREFIX_SUM, SCALAR, KEY_DIAG, VALUE_DIAG, RANK1)

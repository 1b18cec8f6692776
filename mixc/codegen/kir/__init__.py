"""The kernel IR (docs/design-notes.md, "Kernel IR"): typed statements of one Triton kernel
(nodes.py) and their dtypes (dtypes.py), its verifier (verify.py), its passes (passes.py) and the one printer of Triton text
(printer.py). codegen/recurrent_ir.py builds the recurrent kernels in it; triton_expr.py's
Emitter builds every spec expression's statements in it."""

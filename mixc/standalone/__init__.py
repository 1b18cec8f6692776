"""The runtime of a compiled module, and mixc's own: the files a module that `mixc compile NAME
-o DIR` writes needs besides its kernels, which mixc's op imports from here too (one set of
rules, not a copy of them).

- errors.py: ArgumentError, the one error of a bad argument;
- binding.py: the binder (a call's arguments checked against the spec's signature: shapes,
  dtypes, devices, states, cu_seqlens, options; the chunk and CK checks and clamps);
- kernel_args.py: each kernel form's argument list (the kernel IR prints the signatures from
  it, the launches pass values by it);
- launch_data.py and launcher.py: the one launcher (every rule that turns a plan and bound
  arguments into kernel launches: grids, blocks, constexprs, buffers, checkpoint dtypes), driven
  by a LaunchPlan (plain data a generated module carries as METADATA["launch"]) and the launch
  knobs; mixc.load's op (runtime/launch.py) and a compiled module launch through it;
- support.py: CompiledOp, a compiled module's op and step (bound by binding.py, launched by
  launcher.py from its METADATA, with gradients).

Each module here imports only the others (relatively), the standard library, torch and Triton
(tests/test_layering.py holds it), so `mixc compile -o DIR` copies these files verbatim, byte
for byte, into DIR/_mixc_standalone/ (FOLDER), and the module DIR/NAME.py imports that folder
by its path, in an environment with only torch and Triton (codegen/module.py writes the
loader; docs/kernels.md, "The compiled module"). This file imports nothing: derive and codegen
read kernel_args.py without loading torch."""

# The folder beside a compiled module that holds a copy of this package. Its leading
# underscore keeps it from the module names a mixer may take (a name starting with `_` is
# refused), and the module imports it by path, under a name of its files' digest, never as a
# top-level package: an installed mixc, or another build's folder, is not what it finds.
FOLDER = "_mixc_standalone"

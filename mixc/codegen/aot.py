"""Ahead-of-time compilation of generated kernels for a GPU target, with no GPU: catches what
the interpreter forgives (dtype rules, shapes, shared memory) and shows the instructions."""
from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..derive.plan import Plan
from ..runtime.launch import block

_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def recurrent_signature(plan: Plan, sizes: dict[str, int], dtype: str = "bfloat16") -> tuple[dict, dict]:
    """(signature, constexprs) of the recurrent forward kernel for the given dim sizes."""
    m = plan.ir
    t = _DTYPE[dtype]
    sig: dict[str, str] = {}
    for d in m.inputs:
        sig[f"p_{d.name}"] = f"*{t}"
    for d in m.params:
        sig[f"p_{d.name}"] = "*fp32"
    for o in m.options:
        if o.kind == "float":
            sig[f"v_{o.name}"] = "fp32"
    for s in m.states:
        sig[f"p_init_{s.name}"] = "*fp32"
        sig[f"p_final_{s.name}"] = "*fp32"
    sig["p_out"] = f"*{t}"
    sig["p_cu_seqlens"] = "*i32"
    sig["T"] = "i32"
    sig["H"] = "i32"
    for d in m.dim_names:
        sig[f"_fsize_{d}"] = "fp32"
    const = {}
    for d in m.dim_names:
        const[f"_size_{d}"] = sizes[d]
        const[f"_BLOCK_{d}"] = block(sizes[d])
    const.update(USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=False)
    for k in const:
        sig[k] = "constexpr"
    return sig, const


def compile_kernel(kernel, signature: dict, constexprs: dict, arch: int = 90, num_warps: int = 4,
                   num_stages: int = 2):
    """triton.compile for CUDA sm_<arch>; kernel is a JITFunction (not an interpreted one)."""
    fn = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else triton.runtime.jit.JITFunction(
        inspect.unwrap(getattr(kernel, "fn", kernel)))
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))

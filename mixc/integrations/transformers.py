"""mixc's ops inside Hugging Face transformers' linear-attention and SSM layers.

    from mixc.integrations import transformers as mixc_hf
    model = mixc_hf.patch(model, mode="auto")     # every mixer layer mixc knows, in place
    model.generate(ids, max_new_tokens=16)          # prefill and decode through mixc's ops
    mixc_hf.unpatch(model)                          # back to transformers' own functions

transformers' mixer layers (Qwen3NextGatedDeltaNet, KimiLinearDeltaAttention, MambaMixer,
Mamba2Mixer and its copies in Bamba, FalconH1, Zamba2, NemotronH, GraniteMoeHybrid, Jamba's
and FalconMamba's MambaMixer, OlmoHybrid's GatedDeltaNet, RWKV's RwkvSelfAttention) compute their projections, short
convolution, gate and norm in their own forward and call one module-level function for the
core: `torch_chunk_gated_delta_rule`, `mamba2_chunk_scan`, `mamba_selective_scan`,
`rwkv_linear_attention`, ... with fla's or mamba_ssm's signature (transformers binds them to fla / mamba_ssm when installed, to
its pure-torch loops otherwise). patch() gives each such layer its own copy of its forward
whose global names point at mixc's ops (hf_cores.py) instead: the model's code, weights and
cache layout stay as they are, nothing global changes (other layers, other models and the
transformers module are untouched), and unpatch() deletes the copy.

The layer is recognized by the names its forward calls, not by its class: a model whose mixer
forward calls one of FAMILIES' functions is patched whatever it is called. A transformers
version that renames them gets an ArgumentError naming what was looked for.
"""
from __future__ import annotations

import inspect
import sys
import types

import torch

from ..runtime.signature import ArgumentError
from . import hf_cores

# mixc's spec for each family of core functions: the names a layer's forward calls -> the
# factory of their replacements (hf_cores), by the library spec they run on.
FAMILIES = {
    "gated_delta_rule": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kda": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    "mamba2": ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined"),
    "mamba": ("mamba_selective_scan", "mamba_selective_state_update", "mamba_inner_fn"),
    "rwkv4": ("rwkv_linear_attention",),
}
# transformers' pure-torch function for a core function that dispatches by itself (no
# `__wrapped__` fallback): RWKV's picks its CUDA kernel when the `kernels` package loaded it
_TORCH_PATHS = {"rwkv_linear_attention": "rwkv_linear_attention_cpu"}
MODES = ("auto", "chunk", "recurrent", "torch", "reference")
_MARK = "_mixc_patch"


def find_mixers(model: torch.nn.Module) -> dict[str, str]:
    """{qualified module name: spec} for each layer of the model that patch() would swap."""
    _check_module(model, "model")
    out = {}
    for name, module in model.named_modules():
        family = _family_of(type(module))
        if family is not None:
            out[name] = family
    return out


def patch(model: torch.nn.Module, mode: str = "auto", **op_kwargs) -> torch.nn.Module:
    """Swap the core of every mixer layer of a transformers model for mixc's op of its spec
    (gated_delta_rule, kda, mamba2, mamba, rwkv4), prefill and decode, in place; returns the model.
    mode: the op's mode ("auto": the kernels on CUDA or under TRITON_INTERPRET=1, plain torch
    otherwise; "chunk", "recurrent", "torch", "reference": float64, cast back). op_kwargs go to
    every call of the op (e.g. chunk=32). Patching again replaces the earlier patch."""
    _check_module(model, "model")
    if mode not in MODES:
        raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
    found = find_mixers(model)
    if not found:
        raise ArgumentError(
            f"model: {type(model).__name__} has no mixer layer mixc can patch (a layer whose forward "
            f"calls one of {', '.join(n for names in FAMILIES.values() for n in names[:2])}); "
            "transformers' Qwen3-Next, Kimi-Linear, Mamba, Mamba-2, Bamba, FalconH1, Zamba2, NemotronH, "
            "Jamba, GraniteMoeHybrid, OlmoHybrid and RWKV have one")
    if mode == "chunk":
        for name, family in found.items():
            if "chunk" not in hf_cores.spec_op(family).plan().forms:
                raise ArgumentError(
                    f"mode='chunk': layer {name} runs mixc's {family}, which has no chunked form (its decay "
                    "differs over both state dims); use mode='auto' or 'recurrent'")
    modules = dict(model.named_modules())
    for name, family in found.items():
        cls = type(modules[name])
        forward_globals = inspect.unwrap(cls.forward).__globals__
        _rebind(modules[name], lambda: hf_cores.make(family, mode=mode, op_kwargs=op_kwargs,
                                                     module_globals=forward_globals),
                key=(family, mode, repr(sorted(op_kwargs.items()))), mark=(family, mode))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo patch() and torch_fallback(): each layer runs its class's forward again."""
    _check_module(model, "model")
    for module in model.modules():
        if _MARK in module.__dict__:
            del module.__dict__["forward"]
            del module.__dict__[_MARK]
    return model


def torch_fallback(model: torch.nn.Module) -> torch.nn.Module:
    """Bind every mixer layer (and its causal conv) to transformers' own pure-torch functions,
    whatever fla, mamba_ssm or causal_conv1d installed: the path transformers runs without them,
    which a patched model is compared against. unpatch() undoes it."""
    _check_module(model, "model")
    for module in model.modules():
        fn = inspect.unwrap(type(module).forward)
        if _family_of(type(module)) is None:
            continue
        fallbacks = {}
        for name in fn.__code__.co_names:
            f = fn.__globals__.get(name)
            inner = getattr(f, "__wrapped__", None)
            if inner is not None and getattr(f, "__module__", None) == fn.__module__:
                fallbacks[name] = inspect.unwrap(f)
            elif _TORCH_PATHS.get(name) in fn.__globals__:
                fallbacks[name] = fn.__globals__[_TORCH_PATHS[name]]
        _rebind(module, lambda: fallbacks, key=("transformers",), mark=("transformers", "torch"))
    return model


def patched(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """{module name: (spec, mode)} of the layers patch() swapped ("transformers" for torch_fallback)."""
    return {n: m.__dict__[_MARK] for n, m in model.named_modules() if _MARK in m.__dict__}


# ---- the swap ----

def _family_of(cls) -> str | None:
    forward = getattr(cls, "forward", None)
    if not callable(forward):
        return None
    fn = inspect.unwrap(forward)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    names = set(code.co_names)
    for family, funcs in FAMILIES.items():
        # the sequence function is the one every layer of the family calls
        if funcs[0] in names and funcs[0] in fn.__globals__:
            return family
    return None


# the copied forwards, one per (layer class, what it runs): every layer of a class (and of every
# model patched alike) shares one copy, its globals and its code object. torch.compile keeps its
# compiled code per code object and puts the compiled graph's function in the globals of the
# frame it compiled: layers sharing a code object must share those globals, or the next layer
# runs the compiled code without its function (NameError: __compiled_fn_...). The copy's code
# object is its own, so the class's unpatched forward is compiled apart.
_FORWARDS: dict = {}


def _rebind(module: torch.nn.Module, replacements, key: tuple, mark) -> None:
    """module.forward = a copy of its class's forward (decorators included) whose innermost
    function reads replacements() in place of the modeling module's globals of those names."""
    cls = type(module)
    forward = _FORWARDS.get((cls,) + key)
    if forward is None:
        forward = _FORWARDS[(cls,) + key] = _copy_with_globals(cls.forward, replacements())
    module.__dict__["forward"] = types.MethodType(forward, module)
    module.__dict__[_MARK] = mark


def _copy_with_globals(fn, replacements: dict):
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        return _clone(fn, _globals_module(fn.__globals__, replacements), fn.__closure__,
                      fn.__code__.replace())                   # a code object of its own
    # a decorator's wrapper (functools.wraps): rebuild it around the copied inner function,
    # which it holds in a closure cell
    cells = fn.__closure__ or ()
    hits = [i for i, c in enumerate(cells) if _cell_value(c) is inner]
    if len(hits) != 1:
        # a wrapper we cannot rebuild: skip it (transformers' wrappers are deprecation notices
        # and accelerate's offload hooks, which the copy then does without)
        return _copy_with_globals(inner, replacements)
    new_inner = _copy_with_globals(inner, replacements)
    closure = tuple(types.CellType(new_inner) if i == hits[0] else c for i, c in enumerate(cells))
    out = _clone(fn, fn.__globals__, closure, fn.__code__)
    out.__wrapped__ = new_inner
    return out


def _globals_module(module_globals: dict, replacements: dict) -> dict:
    """A snapshot of the modeling module's globals with the replacements, as the __dict__ of a
    module registered in sys.modules (the modeling module itself is not touched). torch.compile
    resolves an inlined function's globals by their __name__ through sys.modules: a plain dict
    copy would be resolved to the modeling module's own globals (transformers' functions)."""
    name = f"{__name__}._forward_{len(_FORWARDS)}_{module_globals.get('__name__', 'module').rsplit('.', 1)[-1]}"
    module = types.ModuleType(name)
    module.__dict__.update({k: v for k, v in module_globals.items() if k not in ("__name__", "__spec__")})
    module.__dict__.update(replacements)
    sys.modules[name] = module
    return module.__dict__


def _clone(fn, globals_: dict, closure, code):
    out = types.FunctionType(code, globals_, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    out.__doc__, out.__qualname__, out.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    return out


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:              # an empty cell
        return None


def _check_module(model, name: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"{name}: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")

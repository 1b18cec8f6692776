"""mixc's ops inside Hugging Face transformers' linear-attention and SSM layers.

    from mixc.integrations import transformers as mixc_hf
    model = mixc_hf.patch(model, mode="auto")     # every mixer layer mixc knows, in place
    model.generate(ids, max_new_tokens=16)          # prefill and decode through mixc's ops
    mixc_hf.unpatch(model)                          # back to transformers' own functions

transformers' mixer layers (Qwen3NextGatedDeltaNet, KimiLinearDeltaAttention, MambaMixer,
Mamba2Mixer and its copies in Bamba, FalconH1, Zamba2, NemotronH, GraniteMoeHybrid, Jamba's
and FalconMamba's MambaMixer, OlmoHybrid's GatedDeltaNet, RWKV's RwkvSelfAttention) compute
their projections, gate and norm in their own forward and call module-level functions for the
short convolution and the core, with fla's, mamba_ssm's and causal_conv1d's signatures
(transformers binds them to those packages when installed, to its pure-torch loops otherwise).
patch() swaps those functions for mixc's ops (hf_cores.py) in each layer, in one of two ways:

- Through the layer's own kernel functions (transformers >= 5.25, or 5.24 with a `kernels`
  package it accepts): transformers marks the functions a kernel may replace
  (`use_kernel_func_from_hub_with_fallback("mamba_chunk_scan_combined", "mamba_ssm")`, ...),
  lists them on the layer class (`use_kernelized_func`), and gives every layer instance a
  private copy of each (`layer._kernel_funcs`), which `kernelize` replaces per layer by setting
  its `forward`. patch() does what `kernelize` does with a kernel mapping: it sets the forward
  of the layer's private `chunk_gated_delta_rule`, `mamba_chunk_scan_combined`,
  `selective_state_update`, `causal_conv1d_fn`, ... to mixc's. The functions transformers runs
  in between (`mamba2_scan_forward`, `mamba_scan_forward`, `causal_conv1d_forward`: the scan's
  and the conv's cache handling) stay transformers' own, and must be: a layer in which one of
  them was replaced (kernelized) is refused.
- By rebinding globals (transformers 5.24 without `kernels`, whose layers call the core
  functions from their forward): the layer gets its own copy of its class's forward whose
  global names (`torch_chunk_gated_delta_rule`, `mamba2_chunk_scan`, `causal_conv1d_fn`, ...)
  point at mixc's. The model's code, weights and cache layout stay as they are, nothing global
  changes (other layers, other models and the transformers module are untouched), and unpatch()
  deletes the copy.

The layer is recognized by the functions it calls, not by its class. patch() checks every
layer before it changes one: a layer whose structure mixc does not know (a function between its
forward and the core that mixc cannot reach, a kernel function it does not know, a replaced
scan or conv wrapper) gets an ArgumentError naming the layer and the transformers version, and
the model is left as it was (never half-patched: e.g. a core swapped while the conv that must
keep packed sequences apart is not).
"""
from __future__ import annotations

import inspect
import sys
import types

import torch

from ..runtime.signature import ArgumentError
from . import hf_cores

# mixc's spec for each family of core functions: the global names a layer's forward calls ->
# the factory of their replacements (hf_cores), by the library spec they run on. The first is
# the sequence function every layer of the family calls.
FAMILIES = {
    "gated_delta_rule": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kda": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    "mamba2": ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined"),
    "mamba": ("mamba_selective_scan", "mamba_selective_state_update", "mamba_inner_fn"),
    "rwkv4": ("rwkv_linear_attention",),
}
# The same functions by the kernel name transformers gives them (use_kernel_func_from_hub_with_
# fallback's, which is fla's / mamba_ssm's), in a layer's `_kernel_funcs` -> the global name of
# hf_cores' replacement. The first two of each family (sequence, step) are required.
KERNEL_FUNCS = {
    "gated_delta_rule": {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                         "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule"},
    "kda": {"chunk_kda": "chunk_kimi_delta_attention", "fused_recurrent_kda": "recurrent_kimi_delta_attention"},
    "mamba2": {"mamba_chunk_scan_combined": "mamba2_chunk_scan", "selective_state_update": "mamba2_selective_state_update",
               "mamba_split_conv1d_scan_combined": "mamba2_split_conv1d_scan_combined"},
    "mamba": {"selective_scan_fn": "mamba_selective_scan", "selective_state_update": "mamba_selective_state_update",
              "mamba_inner_fn": "mamba_inner_fn"},
}
# transformers' (5.25) functions between a layer's forward and its core or conv: they read and
# write the cache and call the kernel functions above. By name -> the family they imply.
WRAPPERS = {"mamba2_scan_forward": "mamba2", "mamba_scan_forward": "mamba", "causal_conv1d_forward": None}
_CONV = "causal_conv1d_fn"              # the sequence conv: wrapped to keep packed sequences apart
_CONV_STEP = "causal_conv1d_update"     # the decode conv step (one token): left as it is
# transformers' pure-torch function for a core function that dispatches by itself (no
# `__wrapped__` fallback): RWKV's picks its CUDA kernel when the `kernels` package loaded it
_TORCH_PATHS = {"rwkv_linear_attention": "rwkv_linear_attention_cpu"}
MODES = ("auto", "chunk", "recurrent", "torch", "reference")
_MARK = "_mixc_patch"
_SAVED = "_mixc_saved_forwards"         # kernel route: the private kernel functions' forwards before


def _transformers_version() -> str:
    """The version of the transformers that is imported (what the error messages name)."""
    module = sys.modules.get("transformers")
    return str(getattr(module, "__version__", "not imported"))


def find_mixers(model: torch.nn.Module) -> dict[str, str]:
    """{qualified module name: spec} for each mixer layer of the model mixc recognizes (patch()
    swaps them all, or raises naming the one it cannot take over)."""
    _check_module(model, "model")
    out = {}
    for name, module in model.named_modules():
        family = _family_of(module)
        if family is not None:
            out[name] = family
    return out


def patch(model: torch.nn.Module, mode: str = "auto", **op_kwargs) -> torch.nn.Module:
    """Swap the core (and the sequence conv) of every mixer layer of a transformers model for
    mixc's op of its spec (gated_delta_rule, kda, mamba2, mamba, rwkv4), prefill and decode, in
    place; returns the model. mode: the op's mode ("auto": the kernels on CUDA or under
    TRITON_INTERPRET=1, plain torch otherwise; "chunk", "recurrent", "torch", "reference":
    float64, cast back). op_kwargs go to every call of the op (e.g. chunk=32). Patching again
    replaces the earlier patch. Every layer is checked before any is changed: a layer mixc cannot
    take over whole raises an ArgumentError naming it and the transformers version."""
    _check_module(model, "model")
    if mode not in MODES:
        raise ArgumentError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
    found = find_mixers(model)
    if not found:
        raise ArgumentError(
            f"model: {type(model).__name__} has no mixer layer mixc can patch (a layer whose forward "
            f"calls one of {', '.join(n for names in FAMILIES.values() for n in names[:2])}, or whose "
            f"kernel functions include {', '.join(next(iter(k)) for k in KERNEL_FUNCS.values())}; "
            f"transformers {_transformers_version()}); transformers' Qwen3-Next, Kimi-Linear, Mamba, "
            "Mamba-2, Bamba, FalconH1, Zamba2, NemotronH, Jamba, GraniteMoeHybrid, OlmoHybrid and RWKV have one")
    if mode == "chunk":
        for name, family in found.items():
            if "chunk" not in hf_cores.spec_op(family).plan().forms:
                raise ArgumentError(
                    f"mode='chunk': layer {name} runs mixc's {family}, which has no chunked form (its decay "
                    "differs over both state dims); use mode='auto' or 'recurrent'")
    modules = dict(model.named_modules())
    # check them all first: a refused layer leaves the model as it was
    routes = {name: _route(name, modules[name], family) for name, family in found.items()}
    key = (mode, repr(sorted(op_kwargs.items())))
    for name, family in found.items():
        module = modules[name]
        _unpatch_module(module)
        if routes[name] == "kernel":
            cores = _shared_cores(family, mode, op_kwargs, key)
            funcs = _kernel_funcs(module)
            new = {k: cores[KERNEL_FUNCS[family][k]] for k in funcs if k in KERNEL_FUNCS[family]}
            if _CONV in funcs:
                new[_CONV] = _as_forward(hf_cores.conv(family, _current(funcs[_CONV])))
            _set_kernel_forwards(module, new, mark=(family, mode))
        else:
            forward_globals = inspect.unwrap(type(module).forward).__globals__
            _rebind(module, lambda: hf_cores.make(family, mode=mode, op_kwargs=op_kwargs,
                                                  module_globals=forward_globals),
                    key=(family,) + key, mark=(family, mode))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo patch() and torch_fallback(): each layer runs transformers' functions again."""
    _check_module(model, "model")
    for module in model.modules():
        _unpatch_module(module)
    return model


def torch_fallback(model: torch.nn.Module) -> torch.nn.Module:
    """Bind every mixer layer (and its causal conv) to transformers' own pure-torch functions,
    whatever fla, mamba_ssm, causal_conv1d or a kernelize() installed: the path transformers
    runs without them, which a patched model is compared against. unpatch() undoes it."""
    _check_module(model, "model")
    for name, module in model.named_modules():
        family = _family_of(module)
        if family is None:
            continue
        _unpatch_module(module)
        funcs = _kernel_funcs(module)
        if family in KERNEL_FUNCS and funcs is not None and _kernel_family(funcs) == family:
            new = {}
            for kname, func in funcs.items():
                base = _func_of(func)
                if base is None:
                    raise ArgumentError(_refusal(name, module, f"its kernel function {kname} is not one "
                                                 "mixc can read (the `kernels` package changed)"))
                if kname in WRAPPERS:
                    new[kname] = None                         # transformers' own function
                elif getattr(base, "__wrapped__", None) is not None:
                    new[kname] = _as_forward(inspect.unwrap(base))
            _set_kernel_forwards(module, new, mark=("transformers", "torch"))
            continue
        fn = inspect.unwrap(type(module).forward)
        fallbacks = {}
        for gname in _code_names(fn.__code__):
            f = fn.__globals__.get(gname)
            inner = getattr(f, "__wrapped__", None)
            if inner is not None and getattr(f, "__module__", None) == fn.__module__:
                fallbacks[gname] = inspect.unwrap(f)
            elif _TORCH_PATHS.get(gname) in fn.__globals__:
                fallbacks[gname] = fn.__globals__[_TORCH_PATHS[gname]]
        _rebind(module, lambda: fallbacks, key=("transformers",), mark=("transformers", "torch"))
    return model


def patched(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """{module name: (spec, mode)} of the layers patch() swapped ("transformers" for torch_fallback)."""
    return {n: m.__dict__[_MARK] for n, m in model.named_modules() if _MARK in m.__dict__}


# ---- what a layer is and how it is reached ----

def _code_names(code) -> set:
    """The global (and attribute) names a code object and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _forward_function(cls):
    forward = getattr(cls, "forward", None)
    if not callable(forward):
        return None
    fn = inspect.unwrap(forward)
    return fn if getattr(fn, "__code__", None) is not None else None


def _kernel_funcs(module) -> dict | None:
    """{kernel name: the layer's private kernel function} (use_kernelized_func's
    `_kernel_funcs`), or None for a layer without them."""
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return None
    return {str(getattr(f, "kernel_layer_name", k)): f for k, f in funcs.items()}


def _kernel_family(funcs: dict) -> str | None:
    for family, names in KERNEL_FUNCS.items():
        if next(iter(names)) in funcs:
            return family
    return None


def _family_of(module) -> str | None:
    funcs = _kernel_funcs(module)
    if funcs:
        family = _kernel_family(funcs)
        if family is not None:
            return family
    fn = _forward_function(type(module))
    if fn is None:
        return None
    names = _code_names(fn.__code__)
    for family, funcs_ in FAMILIES.items():
        if funcs_[0] in names and funcs_[0] in fn.__globals__:
            return family
    for wrapper, family in WRAPPERS.items():
        if family is not None and wrapper in names and wrapper in fn.__globals__:
            return family
    return None


def _func_of(kernel_func):
    """The function a kernel function (kernels' `Func` module, made by use_kernel_forward_from_hub
    from a function) runs when nothing replaced it: the `func` its class's forward closes over."""
    forward = getattr(type(kernel_func), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return None
    return _cell_value(forward.__closure__[code.co_freevars.index("func")])


def _kernel_calls(fn, depth: int = 0) -> dict:
    """{kernel name: the global kernel function} of the kernel functions fn calls, followed
    through transformers' wrappers (WRAPPERS) into the functions they call."""
    out = {}
    for gname in _code_names(fn.__code__):
        value = fn.__globals__.get(gname)
        kname = getattr(value, "kernel_layer_name", None) if isinstance(value, torch.nn.Module) else None
        if kname is None:
            continue
        out[str(kname)] = value
        inner = _func_of(value)
        if kname in WRAPPERS and inner is not None and getattr(inner, "__code__", None) is not None and depth < 4:
            out.update(_kernel_calls(inspect.unwrap(inner), depth + 1))
    return out


def _refusal(name: str, module, why: str) -> str:
    return (f"layer {name} ({type(module).__name__}, transformers {_transformers_version()}): {why}; mixc patches "
            "no layer of the model (see docs/integrations.md for the transformers versions it is tested on)")


def _route(name: str, module, family: str) -> str:
    """"kernel" (the layer's private kernel functions) or "globals" (a copy of its forward), or
    an ArgumentError when the layer's structure is one mixc does not know."""
    fn = _forward_function(type(module))
    funcs = _kernel_funcs(module)
    if funcs is not None and family in KERNEL_FUNCS and _kernel_family(funcs) == family:
        if fn is None:
            raise ArgumentError(_refusal(name, module, "its forward is not a Python function mixc can read"))
        calls = _kernel_calls(fn)
        known = set(KERNEL_FUNCS[family]) | set(WRAPPERS) | {_CONV, _CONV_STEP}
        unknown = sorted(set(calls) - known)
        if unknown:
            raise ArgumentError(_refusal(name, module, f"its forward calls the kernel function(s) {', '.join(unknown)}, "
                                         "which mixc does not know"))
        outside = sorted(set(calls) - set(funcs))
        if outside:
            raise ArgumentError(_refusal(name, module, f"its forward calls {', '.join(outside)}, which is not among the "
                                         "layer's own kernel functions (use_kernelized_func): mixc cannot replace it "
                                         "for this layer alone"))
        required = list(KERNEL_FUNCS[family])[:2]
        missing = [k for k in required if k not in calls]
        if missing:
            raise ArgumentError(_refusal(name, module, f"its forward does not reach {', '.join(missing)} (the "
                                         f"{family} core mixc replaces)"))
        if any(WRAPPERS[w] is None for w in calls if w in WRAPPERS) and _CONV not in calls:
            raise ArgumentError(_refusal(name, module, f"its conv does not go through {_CONV}, which mixc wraps to keep "
                                         "packed sequences apart"))
        replaced = sorted(w for w in calls if w in WRAPPERS and "forward" in funcs[w].__dict__)
        if replaced:
            raise ArgumentError(_refusal(name, module, f"its {', '.join(replaced)} was replaced (kernelize): the "
                                         "functions mixc would swap inside it may never be called; patch a model "
                                         "that was not kernelized, or unpatch it first"))
        if any(_func_of(funcs[k]) is None for k in funcs if k in known):
            raise ArgumentError(_refusal(name, module, "its kernel functions are not ones mixc can read "
                                         "(the `kernels` package changed)"))
        return "kernel"
    if fn is None:
        raise ArgumentError(_refusal(name, module, "its forward is not a Python function mixc can read"))
    names = _code_names(fn.__code__)
    wrappers = sorted(w for w in WRAPPERS if w in names and w in fn.__globals__)
    if wrappers:
        raise ArgumentError(_refusal(name, module, f"its forward calls {', '.join(wrappers)}, inside which mixc can "
                                     "reach the core and the conv only through transformers' kernel functions "
                                     "(use_kernelized_func), which this layer does not have: install the `kernels` "
                                     "version transformers asks for (its requirement `kernels`)"))
    for other, funcs_ in FAMILIES.items():
        if other != family and any(f in names and f in fn.__globals__ for f in funcs_[:1]):
            raise ArgumentError(_refusal(name, module, f"its forward calls both {family}'s and {other}'s core functions"))
    return "globals"


# ---- the kernel route: the layer's private kernel functions ----

_SHARED: dict = {}


def _shared_cores(family: str, mode: str, op_kwargs: dict, key: tuple) -> dict:
    """hf_cores' replacements as kernel-function forwards, one set per (family, mode, keyword
    arguments), shared by every layer patched alike (torch.compile traces one function each)."""
    cores = _SHARED.get((family,) + key)
    if cores is None:
        cores = _SHARED[(family,) + key] = {
            gname: _as_forward(f) for gname, f in hf_cores.make(family, mode=mode, op_kwargs=op_kwargs).items()}
    return cores


def _as_forward(impl):
    """A forward for a kernel function (an nn.Module): self is the private kernel function when
    transformers calls it eagerly, the global one under torch.compile; neither is used."""
    def forward(self, *args, **kwargs):
        return impl(*args, **kwargs)
    forward.__qualname__ = forward.__name__ = getattr(impl, "__name__", "forward")
    forward.__wrapped__ = impl
    return forward


def _current(kernel_func):
    """What a private kernel function runs now, callable without it: the function it was made
    from (transformers', which dispatches to causal_conv1d or torch), or the forward a kernelize()
    gave it."""
    if "forward" in kernel_func.__dict__:
        return kernel_func.__dict__["forward"]
    return _func_of(kernel_func)


def _set_kernel_forwards(module, new: dict, mark) -> None:
    """Each private kernel function in new gets that forward (None: its class's), as kernelize
    does (`kernel_func.forward = MethodType(layer.forward, kernel_func)`); the forwards before are
    kept for unpatch()."""
    funcs = _kernel_funcs(module)
    saved = {}
    for kname, forward in new.items():
        func = funcs[kname]
        saved[kname] = func.__dict__.get("forward")
        if forward is None:
            func.__dict__.pop("forward", None)
        else:
            func.__dict__["forward"] = types.MethodType(forward, func)
    module.__dict__[_SAVED] = saved
    module.__dict__[_MARK] = mark


def _unpatch_module(module) -> None:
    if _MARK not in module.__dict__:
        return
    saved = module.__dict__.pop(_SAVED, None)
    if saved is not None:
        funcs = _kernel_funcs(module) or {}
        for kname, forward in saved.items():
            if kname not in funcs:
                continue
            if forward is None:
                funcs[kname].__dict__.pop("forward", None)
            else:
                funcs[kname].__dict__["forward"] = forward
    else:
        module.__dict__.pop("forward", None)
    del module.__dict__[_MARK]


# ---- the globals route: a copy of the layer's forward ----

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

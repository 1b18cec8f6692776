"""A bounds checker for Triton's interpreter: every element a kernel loads, stores or updates
atomically under a true mask must lie inside one of the tensor arguments of its launch (the
span of that tensor's elements: data_ptr to its last element), else OutOfBounds names the
kernel, the program, the constexprs that tell its launches apart (phase, ...), the nearest
argument and the offset. On a GPU such an access is an illegal memory access (or silently
reads or corrupts a neighbouring buffer); under the interpreter it reads host memory and
usually passes unnoticed.

    with bounds_checked() as seen:       # TRITON_INTERPRET=1
        op(...)                          # raises on the first access out of bounds
    seen["launches"]                     # launches checked

Limits: a pointer that leaves its own buffer and lands inside another argument's passes."""
from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager

import numpy as np



class OutOfBounds(AssertionError):
    pass


_STATE = threading.local()


def _extent(t) -> tuple[int, int]:
    """[first byte, one past the last byte] of a tensor's elements."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    lo = t.data_ptr() + min(0, sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st < 0)) * t.element_size()
    return lo, t.data_ptr() + (max(last, 0) + 1) * t.element_size()


def _check(ptrs, mask, what: str) -> None:
    launch = getattr(_STATE, "launch", None)
    if launch is None:
        return
    from triton.runtime.interpreter import interpreter_builder
    p = np.asarray(ptrs.data).astype(np.uint64, copy=False)
    m = np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape) if mask is not None else np.ones(p.shape, bool)
    active = p[m].astype(np.int64)
    if active.size == 0:
        return
    width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    ok = np.zeros(active.shape, dtype=bool)
    for _, lo, hi, _t in launch["ranges"]:
        ok |= (active >= lo) & (active + width <= hi)
    if ok.all():
        return
    bad = active[~ok]
    first = int(bad[0])
    below = [r for r in launch["ranges"] if r[1] <= first]
    name, lo, hi, t = max(below, key=lambda r: r[1]) if below else min(launch["ranges"], key=lambda r: r[1])
    elem = t.element_size()
    err = OutOfBounds(
        f"{launch['kernel']} {launch['consts']} program {tuple(interpreter_builder.grid_idx)} of grid "
        f"{launch['grid']}: {what} of {bad.size} element(s) outside every tensor argument; the first at "
        f"element {(first - lo) // elem} of `{name}` (shape {tuple(t.shape)}, {(hi - lo) // elem} elements, "
        f"{t.dtype}); element offsets from its start: {((bad - lo) // elem).min()}..{((bad - lo) // elem).max()}")
    launch["errors"].append(err)       # kept: a caller (the autotuner) may swallow the raise
    raise err


@contextmanager
def bounds_checked():
    """Check every interpreted launch made inside (see the module's doc); yields a dict whose
    "launches" lists (kernel, constexprs) of each launch checked and "errors" every OutOfBounds
    raised (also those a caller caught)."""
    from triton.runtime import interpreter as I
    seen = {"launches": [], "errors": []}
    builder = I.InterpreterBuilder
    # the builder's memory operations of this Triton (3.6 has no atomic load / store)
    orig = {n: getattr(builder, n) for n in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                             "create_atomic_cas", "create_atomic_load", "create_atomic_store")
            if hasattr(builder, n)}
    orig_init, orig_call = I.GridExecutor._init_args_hst, I.GridExecutor.__call__

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig_init(self, args_dev, kwargs)
        named = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        ranges = [(k, *_extent(v), v) for k, v in named.items() if hasattr(v, "data_ptr") and hasattr(v, "numel")]
        consts = {k: named[k] for k in self.constexprs if isinstance(named.get(k), (int, bool))}
        grid = self.grid(named) if callable(self.grid) else self.grid
        _STATE.launch = dict(kernel=self.fn.__name__, ranges=ranges, consts=consts, grid=tuple(grid),
                             errors=seen["errors"])
        seen["launches"].append((self.fn.__name__, consts))
        return args_hst, kwargs_hst

    def call(self, *a, **kw):
        try:
            return orig_call(self, *a, **kw)
        finally:
            _STATE.launch = None

    def load(self, ptrs, mask, other, *a):
        _check(ptrs, mask, "load")
        return orig["create_masked_load"](self, ptrs, mask, other, *a)

    def store(self, ptrs, value, mask, *a):
        _check(ptrs, mask, "store")
        return orig["create_masked_store"](self, ptrs, value, mask, *a)

    def rmw(self, op, ptr, val, mask, *a):
        _check(ptr, mask, "atomic")
        return orig["create_atomic_rmw"](self, op, ptr, val, mask, *a)

    def cas(self, ptr, cmp, val, *a):
        _check(ptr, None, "atomic cas")
        return orig["create_atomic_cas"](self, ptr, cmp, val, *a)

    def aload(self, ptr, mask, *a):
        _check(ptr, mask, "atomic load")
        return orig["create_atomic_load"](self, ptr, mask, *a)

    def astore(self, ptr, val, mask, *a):
        _check(ptr, mask, "atomic store")
        return orig["create_atomic_store"](self, ptr, val, mask, *a)

    checked = {"create_masked_load": load, "create_masked_store": store, "create_atomic_rmw": rmw,
               "create_atomic_cas": cas, "create_atomic_load": aload, "create_atomic_store": astore}
    for n in orig:
        setattr(builder, n, checked[n])
    I.GridExecutor._init_args_hst, I.GridExecutor.__call__ = init, call
    try:
        yield seen
    finally:
        for n, f in orig.items():
            setattr(builder, n, f)
        I.GridExecutor._init_args_hst, I.GridExecutor.__call__ = orig_init, orig_call
        _STATE.launch = None

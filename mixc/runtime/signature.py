"""Call arguments -> bound sizes and checked tensors, with errors that name the argument.

The binder itself is standalone/binding.py (torch only, so that a compiled module binds with the
same code: standalone/support.py); this module re-exports it and adds what needs the spec
language: option defaults evaluated from the spec's expressions (dsl/scalar.py), with errors
that quote the expression."""
from __future__ import annotations

from ..dsl import ir, scalar
from ..dsl.unparse import expr_text
from ..standalone.binding import (FLOAT_DTYPES, Bound, _check_cu_seqlens, _check_device,  # noqa: F401
                                  _check_state, _check_tensor, _fmt, bind, check_chunking, check_flag_argument,
                                  cu_seqlens_values, expand_heads, head_groups)
from ..standalone.errors import ArgumentError  # noqa: F401  (one class for ops and compiled modules)


def _scalar(e: ir.Expr, sizes: dict[str, int], values: dict[str, float], head: str = "the value",
            tail: str = "") -> float:
    """A scalar of numbers, dims and number options (an option's default, a window), in plain
    Python (so that tracing under torch.compile sees constants, not tensor reads). Each node's
    own operator only is evaluated (dsl/scalar.py); one without a finite real value is an
    ArgumentError that says which part fails and at which sizes: '{head} {e} ... {tail}'."""
    try:
        return scalar.evaluate(e, sizes, values)
    except scalar.ScalarError as err:
        at = ", ".join(f"{d} = {sizes[d]}" for d in sorted(ir.refs(e, "dim")) if d in sizes)
        read = ", ".join(f"{o} = {values[o]:g}" for o in sorted(ir.refs(e, "option")) if o in values)
        where = " and ".join(x for x in (at and f"at {at}", read and f"with {read}") if x)
        where = f" {where}" if where else ""
        if err.node is e:
            msg = f"{head} {expr_text(e)} {err.reason}{where}"
        else:
            msg = f"{head} {expr_text(e)} has no finite real value{where}: {expr_text(err.node)} {err.reason}"
        raise ArgumentError(msg + tail) from None
    except scalar.NotConstant as err:
        raise ArgumentError(f"cannot evaluate {head} {expr_text(e)}: '{err}' has no value here") from None


def option_values(mixer: ir.MixerIR, bound: Bound) -> dict[str, float]:
    """Every number option: the value passed, else its default evaluated with the bound dims."""
    out: dict[str, float] = {}
    for opt in mixer.options:
        if opt.kind == "float":
            out[opt.name] = bound.options[opt.name] if opt.name in bound.options else _scalar(
                opt.default, bound.sizes, out, f"option '{opt.name}': its default",
                f"; pass {opt.name}=<a number> or change the default")
    return out

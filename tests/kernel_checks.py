"""Kernels against the float64 reference, in FlexAttention's manner: the kernel's error must
stay within a small factor of the error of the same computation done eagerly in the same
dtype (the torch backend), plus a floor for exact cases."""
import torch


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


def _run(op, mode, args, flags, st, **kw):
    return op(**args, **flags, initial_state=st, output_final_state=True, mode=mode, **kw)


def _loss(o, st, op, weights):
    wo, ws = weights
    return (o.double() * wo).sum() + sum((st[s.name].double() * w).sum() for s, w in zip(op.ir.states, ws))


def check_against_reference(op, flags, args, st, dtype, CK=4, factor=4.0, cu_seqlens=None, mode="recurrent",
                            chunk=None, formula=None, grads=True):
    """Forward, final states and every gradient of the kernels vs the float64 reference (or
    vs formula(args, state) -> (o, states), an independent float64 formula), within `factor`
    times the torch backend's error (plus a floor for exact cases). grads=False: forward and
    final states only (a check of forward kernels whose backward is checked elsewhere)."""
    leaves = list(args.values()) + (list(st.values()) if st is not None else [])
    kw = {"cu_seqlens": cu_seqlens} if cu_seqlens is not None else {}
    if formula is None:
        ref_o, ref_st = _run(op, "reference", args, flags, st, **kw)
    else:
        ref_o, ref_st = formula({k: v.double() for k, v in args.items()},
                                {k: v.double() for k, v in st.items()} if st is not None else None)
    ker_o, ker_st = _run(op, mode, args, flags, st, CK=CK, chunk=chunk, **kw)
    eag_o, eag_st = _run(op, "torch", args, flags, st, **kw)
    # states: float32 from the kernels; the torch backend keeps float64 inputs' precision
    state_dtype = torch.float64 if mode in ("torch", "conv") and dtype == torch.float64 else torch.float32
    assert ker_o.dtype == dtype and all(v.dtype == state_dtype for v in ker_st.values())
    assert torch.isfinite(ker_o).all(), "the kernel left NaN (poison) or produced inf"
    if not grads:
        floor = {torch.float32: 1e-6, torch.float64: 1e-10, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
        for what, ker, eag, ref in [("o", ker_o, eag_o, ref_o)] + [(f"final {k}", ker_st[k], eag_st[k], ref_st[k])
                                                                   for k in ref_st]:
            allowed = factor * _err(eag, ref) + floor * max(1.0, ref.abs().max().item())
            assert _err(ker, ref) <= allowed, f"{what}: kernel error {_err(ker, ref):.3g} > {allowed:.3g}"
        return
    gen = torch.Generator().manual_seed(11)
    weights = (torch.randn(ref_o.shape, generator=gen, dtype=torch.float64),
               [torch.randn(ref_st[s.name].shape, generator=gen, dtype=torch.float64) for s in op.ir.states])
    ref_g = torch.autograd.grad(_loss(ref_o, ref_st, op, weights), leaves, allow_unused=True)
    ker_g = torch.autograd.grad(_loss(ker_o, ker_st, op, weights), leaves, allow_unused=True)
    eag_g = torch.autograd.grad(_loss(eag_o, eag_st, op, weights), leaves, allow_unused=True)
    floor = {torch.float32: 1e-6, torch.float64: 1e-10, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    names = [f"d{k}" for k in args] + [f"d initial {k}" for k in (st or {})]
    pairs = [("o", ker_o, eag_o, ref_o)] + [(f"final {k}", ker_st[k], eag_st[k], ref_st[k]) for k in ref_st]
    pairs += [(n, k, e, r) for n, k, e, r in zip(names, ker_g, eag_g, ref_g) if r is not None]
    for what, ker, eag, ref in pairs:
        scale = max(1.0, ref.abs().max().item())
        allowed = factor * _err(eag, ref) + floor * scale
        assert _err(ker, ref) <= allowed, f"{what}: kernel error {_err(ker, ref):.3g} > {allowed:.3g}"



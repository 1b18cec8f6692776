"""Section (a): the kernels of one library spec on the device against the float64 reference
(computed on the CPU): every kernel mode it has, fp32 and bf16 inputs, the output, the final
states and every gradient (inputs, params, initial state). The chunked kernels are checked at
every chunk size the autotuner may choose (mode "chunk C=32": mixc.runtime.autotune's
candidates after the default), in one launch per direction as well as two (mode "chunk walk":
launch.CHUNK_PHASES = 1), with the tile dim in blocks of 16 (mode "chunk tile16": two blocks
at D = 32, the partial gradients summed) and with a checkpoint every two chunks (mode "chunk
ckpt2": at T = 130, three chunks of 64 or five of 32, the last checkpoint's partial; the
policy of launch.checkpoint_every keeps one per chunk at so few programs) and, where the
spec stages its intra-chunk matrices (the intra kernel: gla, rwkv6, hgrn2, s4d), without them (mode
"chunk unstaged": launch.STAGE_INTRA = False), for the rank-1 class with its staged inverse
(mode "chunk staged solve": launch.STAGE_SOLVE = True, the default since 2026-12-05), and with the forward's
intra and output kernels looping
over key blocks of 16 (mode "chunk keyblock16": launch.KEY_BLOCK = 16, a checkpoint per chunk,
two blocks at D = 32; codegen/key_split.py, which the policy runs at C * K > 32 * 128 where a
program takes one chunk) and, for the key-diagonal decay, with the output kernel walking two chunks in
static key blocks of 16 (mode "chunk walk keyblock16": codegen/key_walk.py, what its default
C = 64 runs at K = 128 and long sequences); warps and stages do not change the arithmetic."""
from __future__ import annotations

import time
import traceback

TOL = {"float32": 2e-3, "bfloat16": 2e-2}          # TF32 / bf16 matmuls on a GPU
EAGER_FACTOR = 2.0                                 # the kernel's error within 2x the eager same-dtype error


def _eager_errors(op, ref_in: dict, ref_st: dict, ro, rfin: dict, dtype) -> dict:
    """The relative errors of mode "torch" on the CPU with the inputs in `dtype` (the values the
    kernel saw) against the same float64 reference: what the dtype itself costs this problem."""
    import torch
    x = {k: v.detach().to(dtype).requires_grad_(True) for k, v in ref_in.items()}
    st = {k: v.detach().float().requires_grad_(True) for k, v in ref_st.items()}
    o, fin = op(**x, initial_state=st, output_final_state=True, mode="torch")
    (o.float().square().sum() + sum(v.sum() for v in fin.values())).backward()

    def rel(a, b):
        return ((a.detach().double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return {"output_rel_err": rel(o, ro), "state_rel_err": max(rel(fin[k], rfin[k]) for k in rfin),
            "grad_rel_err": max(rel(x[k].grad, ref_in[k].grad) for k in x)}


def check_spec(spec: str, device: str, dry: bool, only: list[str] | None = None) -> list[dict]:
    """Rows of every mode (only: the modes whose label is in it, e.g. ["recurrent", "chunk"])."""
    import torch

    import mixc
    from mixc.runtime.inputs import random_args, random_state

    B, T, H, D = (1, 20, 1, 16) if dry else (2, 130, 2, 32)
    op = mixc.load(spec)
    from mixc.runtime import launch
    modes = _modes(op)
    if only:
        modes = [m for m in modes if m[2] in only]
    rows = []
    for mode, C, label, knobs in modes:
        saved = {k: getattr(launch, k) for k in knobs}
        for k, v in knobs.items():
            setattr(launch, k, v)
        for dtype in (torch.float32, torch.bfloat16):
            row = {"spec": spec, "mode": label, "dtype": str(dtype).replace("torch.", "")}
            try:
                kw, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={d.name: D for d in op.ir.dims if not d.alias_of},
                                        seed=1)
                st = random_state(op.ir, B, H, sizes)
                dev = {k: v.to(device=device, dtype=dtype).requires_grad_(True) for k, v in kw.items()}
                st_dev = {k: v.to(device).requires_grad_(True) for k, v in st.items()}
                t0 = time.perf_counter()
                o, fin = op(**dev, initial_state=st_dev, output_final_state=True, mode=mode,
                            **({"chunk": C} if C else {}))
                loss = o.float().square().sum() + sum(v.sum() for v in fin.values())
                loss.backward()
                row["seconds"] = round(time.perf_counter() - t0, 3)
                ref_in = {k: v.detach().cpu().double().requires_grad_(True) for k, v in dev.items()}
                ref_st = {k: v.detach().cpu().double().requires_grad_(True) for k, v in st_dev.items()}
                ro, rfin = op.reference(**ref_in, initial_state=ref_st, output_final_state=True)
                (ro.square().sum() + sum(v.sum() for v in rfin.values())).backward()

                def rel(a, b):
                    return ((a.detach().cpu().double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                row["output_rel_err"] = rel(o, ro)
                row["state_rel_err"] = max(rel(fin[k], rfin[k]) for k in rfin)
                row["grad_rel_err"] = max(rel(dev[k].grad, ref_in[k].grad) for k in dev)
                # the bound, as FlexAttention's tests set it: TOL, or a small factor of the error of
                # the same-dtype eager computation (mode "torch" on the CPU, same inputs) where the
                # problem itself loses more than TOL in that dtype (gated_delta_product in bf16)
                eager = _eager_errors(op, ref_in, ref_st, ro, rfin, dtype) if dtype != torch.float32 else {}
                row["bound"] = {k: max(TOL[row["dtype"]], EAGER_FACTOR * eager.get(k, 0.0))
                                for k in ("output_rel_err", "state_rel_err", "grad_rel_err")}
                row["ok"] = bool(all(row[k] < row["bound"][k] for k in row["bound"]) and torch.isfinite(o).all())
            except Exception as err:                  # noqa: BLE001 - a failure is a result: keep going
                row["ok"] = False
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
            rows.append(row)
        for k, v in saved.items():
            setattr(launch, k, v)
    return rows



def _modes(op) -> list[tuple]:
    """(mode, C, label, launch knobs) of every mode checked for an op (the module docstring)."""
    from mixc import classes
    from mixc.codegen.key_split import key_dim
    from mixc.derive.layout import chunk_supported
    from mixc.runtime.autotune import chunk_candidates
    modes = [("recurrent", None, "recurrent", {})]
    if chunk_supported(op.plan()) is None:
        modes += [("chunk", None, "chunk", {})] + [("chunk", C, f"chunk C={C}", {})
                                                    for C in chunk_candidates(op.plan())[1:]]
        modes += [("chunk", None, "chunk walk", {"CHUNK_PHASES": 1}),
                  ("chunk", None, "chunk tile16", {"CHUNK_TILE": 16, "CHUNK_PHASES": 2}),
                  ("chunk", None, "chunk ckpt2", {"CHECKPOINT_EVERY": 2, "CHUNK_PHASES": 2})]
        if key_dim(op.plan()) is not None:      # the intra and output kernels over key blocks (one chunk a program)
            modes += [("chunk", None, "chunk keyblock16", {"KEY_BLOCK": 16, "CHECKPOINT_EVERY": 1, "CHUNK_PHASES": 2})]
        if any(classes.unit(st.transition).walks_key_blocks for st in op.plan().states):
            # the output kernel walking two chunks with its state in static key blocks (codegen/key_walk.py)
            modes += [("chunk", None, "chunk walk keyblock16", {"KEY_BLOCK": 16, "CHECKPOINT_EVERY": 2,
                                                                "CHUNK_PHASES": 2})]
        solve = any(classes.unit(st.transition).stages_solve for st in op.plan().states)
        if op.plan().layout.intra_matrices and not solve:     # the output kernel computing its intra-chunk matrices
            modes += [("chunk", None, "chunk unstaged", {"STAGE_INTRA": False, "CHUNK_PHASES": 2})]
        if solve:       # the rank-1 walk and output kernel reading the inverse the intra kernel staged (off by default)
            modes += [("chunk", None, "chunk staged solve", {"STAGE_SOLVE": True, "CHUNK_PHASES": 2})]
    return modes


def mode_labels(spec: str) -> list[str]:
    """The labels of the modes checked for a library spec (bench/gpu_check: one task each)."""
    import mixc
    return [m[2] for m in _modes(mixc.load(spec))]


def line(row: dict) -> str:
    errs = " ".join(f"{k}={row[k]:.1e}" for k in ("output_rel_err", "state_rel_err", "grad_rel_err") if k in row)
    return (f"{row['spec']:20s} {row['mode']:12s} {row['dtype']:8s} " + ("ok " if row["ok"] else "FAIL ") + errs
            + (f"  {row.get('error', '')[:120]}" if not row["ok"] else ""))

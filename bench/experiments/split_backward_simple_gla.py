#!/usr/bin/env python3
"""Experiment (issue 16, seventh session): simple_gla's chunked backward PHASE 2 with the tile
loop split as fla's dq/dk kernel is, written by hand into the generated module, to measure what
the codegen change would buy before making it.

Today's PHASE 2 runs, per block of V, the whole readout and update adjoints and adds each
block's dq and dk to [C, K] accumulators. Here the loop over V blocks only contracts what
carries V: dA += dO V^T, Gq += dO S0^T, dKw += V dh^T, sum(S0 * dh), and stores dv; dP = dA * D,
dq, dk and dg are formed once after the loop. sm_90 (K = V = 128, bf16, 8 warps, the static
report's path): 255 registers and 208 B of spills, against 2108 B for the generated kernel and
1116 B for fla's chunk_bwd_kernel_dqkwg. Under the interpreter the patched kernel passed
tests/ops/test_kernels.py, test_kernel_shapes.py and test_sparse_checkpoints.py for simple_gla
(float64 reference, every gradient). Keys are zeroed by their own non-finite entries only (the
generated kernel zeroes them per V block by the values' too); not a change to land as is.

    python3 bench/experiments/split_backward_simple_gla.py      # patch the cached module
    python3 bench/static_report --specs simple_gla --impls mixc --out /tmp/split
    rm ~/.cache/mixc/simple_gla-*.py                              # (or MIXC_CACHE_DIR's) after

What codegen needs for it (not done): each class's readout and advance adjoints split into the
contractions over the tile dim (inside the loop) and the rest (after it), and the spec-level
adjoint of what lacks the tile dim (q, k, g and their feature maps) run after the loop."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixc import pipeline  # noqa: E402
from mixc.runtime import cache  # noqa: E402

NEW = r'''
        if PHASE == 2:
            v_q = tl.load(p_q + (_rows[:, None] * _heads_q + _head_q) * _size_K + _offs_K[None, :], mask=_mask__T[:, None] & _mask_K[None, :], other=0.0).to(tl.float32)
            v_k = tl.load(p_k + (_rows[:, None] * _heads_k + _head_k) * _size_K + _offs_K[None, :], mask=_mask__T[:, None] & _mask_K[None, :], other=0.0).to(tl.float32)
            v_g = tl.load(p_g + (_rows * _heads_g + _head_g) * 1, mask=_mask__T, other=0.0).to(tl.float32)
            _c1 = tl.where(_mask__T[:, None] & _mask_K[None, :], v_k, 0.0)
            _c3 = tl.where(_mask__T, v_g, 0.0)
            _badk = tl.max(tl.where(tl.abs(_c1) < float('inf'), 0, 1), axis=1)
            _Kc_S = tl.where(_badk[:, None] > 0, 0.0, _c1)
            _r_S = _c3 == float('-inf')
            _g_S = tl.where(_r_S, 0.0, _c3)
            _gh_S = (_g_S + 16384.0) - 16384.0
            _bh_S = tl.cumsum(_gh_S, axis=0)
            _bc_S = tl.cumsum(_g_S - _gh_S, axis=0)
            _b_S = _bh_S + _bc_S
            _z_S = tl.cumsum(tl.where(_r_S, 1.0, 0.0), axis=0)
            _bl_S = tl.sum(tl.where(_offs__T == _n_valid - 1, _bh_S, 0.0), axis=0)
            _blc_S = tl.sum(tl.where(_offs__T == _n_valid - 1, _bc_S, 0.0), axis=0)
            _zl_S = tl.sum(tl.where(_offs__T == _n_valid - 1, _z_S, 0.0), axis=0)
            _b0_S = tl.where(_z_S > 0, float('-inf'), _b_S)
            _bl0_S = tl.where(_zl_S > 0, float('-inf'), _bl_S + _blc_S)
            _kw_S = tl.where(_z_S < _zl_S, float('-inf'), (_bl_S - _bh_S) + (_blc_S - _bc_S))
            _c5 = tl.where(_mask__T[:, None] & _mask_K[None, :], v_q * v_scale, 0.0)
            _D = tl.exp(tl.where((_offs__T[:, None] >= _offs__T[None, :]) & (_z_S[:, None] == _z_S[None, :]), (_bh_S[:, None] - _bh_S[None, :]) + (_bc_S[:, None] - _bc_S[None, :]), float('-inf')))
            _A = _mixc_dot(_c5, tl.trans(_Kc_S), DOT) * _D
            _w = tl.exp(_kw_S)
            _dA = tl.zeros([_BLOCK__T, _BLOCK__T], dtype=tl.float32)
            _Gq = tl.zeros([_BLOCK__T, _BLOCK_K], dtype=tl.float32)
            _dKw = tl.zeros([_BLOCK__T, _BLOCK_K], dtype=tl.float32)
            _sd = tl.sum(tl.zeros([_BLOCK__T], dtype=tl.float32), axis=0)
            for _tv in range(tl.program_id(1), _N_TILES, tl.num_programs(1)):
                _offs_V = _tv * _BLOCK_V + tl.arange(0, _BLOCK_V)
                _mask_V = _offs_V < _size_V
                _ov_S = _offs_V
                _mv_S = _mask_V
                s_S = tl.load(p_ckpt_S + ((bos // _BLOCK__T + i_n + _chunk) * H + i_h) * _size_K * _size_V + _ok_S[:, None] + _ov_S[None, :], mask=_mk_S[:, None] & _mv_S[None, :], other=0.0).to(tl.float32)
                d_S = tl.load(p_dh_S + ((bos // _BLOCK__T + i_n + _chunk) * H + i_h) * _size_K * _size_V + _ok_S[:, None] + _ov_S[None, :], mask=_mk_S[:, None] & _mv_S[None, :], other=0.0).to(tl.float32)
                v_v = tl.load(p_v + (_rows[:, None] * _heads_v + _head_v) * _size_V + _offs_V[None, :], mask=_mask__T[:, None] & _mask_V[None, :], other=0.0).to(tl.float32)
                _c2 = tl.where(_mask__T[:, None] & _mask_V[None, :], v_v, 0.0)
                _bad = _badk | tl.max(tl.where(tl.abs(_c2) < float('inf'), 0, 1), axis=1)
                _Vc_S = tl.where(_bad[:, None] > 0, 0.0, _c2)
                _do = tl.load(p_do + (_rows[:, None] * H + i_h) * _size_V + _offs_V[None, :], mask=_mask__T[:, None] & _mask_V[None, :], other=0.0).to(tl.float32)
                _dR2 = tl.where(_mask__T[:, None] & _mask_V[None, :], _do, 0.0)
                _dA += _mixc_dot(_dR2, tl.trans(_Vc_S), DOT)
                _Gq += _mixc_dot(_dR2, tl.trans(s_S), DOT)
                _dKw += _mixc_dot(_Vc_S, tl.trans(d_S), DOT)
                _sd += tl.sum(s_S * d_S)
                _dv = _mixc_dot(tl.trans(_A), _dR2, DOT) + _mixc_dot(_Kc_S * _w[:, None], d_S, DOT)
                tl.store(p_dv + (_rows[:, None] * H + i_h) * _size_V + _offs_V[None, :], _dv.to(p_dv.dtype.element_ty), mask=_mask__T[:, None] & _mask_V[None, :])
            _dP = _dA * _D
            _E = tl.where((_offs__T[:, None] > _offs__T[None, :]), _dA * _A, 0.0)
            _eb = tl.exp(_b0_S)
            _dQ = _mixc_dot(_dP, _Kc_S, DOT) + _Gq * _eb[:, None]
            _dK = _mixc_dot(tl.trans(_dP), _c5, DOT) + _dKw * _w[:, None]
            _dbq = tl.sum(_E, axis=1) + tl.sum(_Gq * _c5, axis=1) * _eb
            _F = tl.sum(_dKw * _Kc_S, axis=1) * _w
            _Fb = tl.where((_offs__T == _n_valid - 1), 0.0, _F)
            _dbl = tl.sum(_Fb, axis=0) + _sd * tl.exp(_bl0_S)
            _db = _dbq - tl.sum(_E, axis=0) - _Fb + tl.where(_offs__T == _n_valid - 1, _dbl, 0.0)
            _dg = tl.where(_r_S, 0.0, tl.cumsum(_db, axis=0, reverse=True))
            tl.store(p_dq + (_rows[:, None] * H + i_h) * _size_K + _offs_K[None, :], (_dQ * v_scale).to(p_dq.dtype.element_ty), mask=_mask__T[:, None] & _mask_K[None, :])
            tl.store(p_dk + (_rows[:, None] * H + i_h) * _size_K + _offs_K[None, :], _dK.to(p_dk.dtype.element_ty), mask=_mask__T[:, None] & _mask_K[None, :])
            tl.store(p_dg + (_rows * H + i_h) * 1, _dg.to(p_dg.dtype.element_ty), mask=_mask__T)
        else:
'''


def split(module: str) -> str:
    i = module.index("def simple_gla_chunk_bwd(")
    j = module.index("def _t(", i)
    lines = module[i:j].split("\n")
    s = next(n for n, x in enumerate(lines) if x.startswith("        _sum_dq = tl.zeros("))
    e = next(n for n, x in enumerate(lines) if x.startswith("    if PHASE != 2:") and n > s)
    old = ["    " + x if x.strip() else x for x in lines[s:e]]      # PHASE 0 and 1 keep the generated loop
    lines[s:e] = NEW.strip("\n").split("\n") + old
    return module[:i] + "\n".join(lines) + module[j:]


def main() -> int:
    plan = pipeline.compile("simple_gla")
    pipeline.load(plan)
    path = cache.module_path(plan)
    body = path.read_text().rstrip("\n").rpartition("\n")[0] + "\n"
    body = split(body)
    path.write_text(body + cache._FOOTER + cache._checksum(body) + "\n")
    print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The float64 reference of the SSM and delta-rule families against independent formulas.

Every formula below is written here from the paper or from the peer library's own
conventions (mamba_ssm, flash-linear-attention), never from the spec's loop:

  mamba2            the SSD semiseparable (decay-matrix) form, quadratic in T
  mamba             mamba_ssm's selective-scan recurrence, in its (b, d, l) / A (d, n) layout
  s4d               a causal convolution with the kernel K_j = sum_n C (dA^j) B_bar
  rwkv6             fla's recurrence, bonus u on the current token, read before the update
  rwkv7             fla's recurrence written on the [V, K] state (the paper's and fla's
                    docs' form), compared after transposing
  delta_rule        fla's loop (and the chunked WY / UT form, one or several chunks)
  gated_delta_rule  fla's loop: decay first, then the delta update
  mlstm             the stabilized xLSTM recurrence (max-stabilizer m_t), which must equal
                    the spec's unstabilized h = C^T q / max(|n . q|, 1)

Per system: forward output and final state, with and without a random initial state;
gradients of every input, param and of the initial state; gradcheck on tiny inputs;
reference_step token by token; packed sequences (cu_seqlens) against separate runs.
The chunked forms a kernel would use are checked too: the WY / UT form of the (gated)
delta rule, RWKV-6 and RWKV-7 (diagonal-plus-low-rank) with in-chunk cumulative decays,
and mLSTM's row-max-stabilized parallel form (chunks of 9, 4 and 1 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import mixc
from helpers import case_id, random_args, random_state

TOL = 1e-10
INF = float("inf")


# --------------------------------------------------------------------------------------
# helpers

def assert_close(got, want, what, tol=TOL):
    """|got - want| <= tol * max(1, max |want|): absolute for O(1) values, relative when large."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return
    scale = max(1.0, want.detach().abs().max().item())
    err = (got.detach() - want.detach()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3g}"


def _bh(x):
    """[B, T, H, *] -> [B, H, T, *]."""
    return x.transpose(1, 2)


def _l2norm(x):
    """fla.modules.l2norm: x / sqrt(sum x^2 + 1e-6), eps inside the sqrt."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _softplus(x):
    return torch.log1p(torch.exp(x))


# --------------------------------------------------------------------------------------
# independent formulas: f(args, opts, s0) -> (o [B, T, H, *], final state dict in our layout)
# `opts` holds every option value (defaults filled in by the case).

def mamba2_ssd(a, opts, s0):
    """SSD (Dao & Gu 2024), the quadratic semiseparable form:
    y_i = sum_{j<=i} (C_i . B_j) exp(sum_{j<l<=i} delta_l A) delta_j x_j + D x_i
          + C_i^T exp(sum_{l<=i} delta_l A) S0."""
    x, dt, Bm, Cm = a["x"], a["dt"], a["B"], a["C"]          # [b,t,h,p], [b,t,h], [b,t,h,n] x2
    A, D = a["A"], a["D"]                                    # [h]
    delta = _softplus(dt + a["dt_bias"])                     # [b,t,h]
    cum = torch.cumsum(delta * A, dim=1)                     # sum_{l<=i} delta_l A
    T = x.shape[1]
    seg = cum[:, :, None, :] - cum[:, None, :, :]            # [b,i,j,h] = sum_{j<l<=i}
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None]
    L = torch.exp(seg.masked_fill(~causal, -INF))            # the decay matrix, 0 above the diagonal
    CB = torch.einsum("bihn,bjhn->bijh", Cm, Bm)
    y = torch.einsum("bijh,bjh,bjhp->bihp", CB * L, delta, x) + D[:, None] * x
    S0 = s0["S"] if s0 is not None else torch.zeros(x.shape[0], x.shape[2], Bm.shape[-1], x.shape[-1],
                                                   dtype=x.dtype)
    y = y + torch.exp(cum)[..., None] * torch.einsum("bihn,bhnp->bihp", Cm, S0)
    to_end = torch.exp(cum[:, -1:] - cum) * delta            # exp(sum_{j<l<=T}) delta_j
    S = torch.exp(cum[:, -1])[:, :, None, None] * S0 + torch.einsum("bjh,bjhn,bjhp->bhnp", to_end, Bm, x)
    return y, {"S": S}


def mamba_selective_scan(a, opts, s0):
    """mamba_ssm's selective scan (delta_bias=dt_bias, delta_softplus=True), in its own layout:
    u, delta (b, d, l); A (d, n); B, C (b, g, n, l); D (d); state (b, d, n); d = H * P, g = H.
    x_t = exp(delta_t A) * x_{t-1} + delta_t B_t u_t;  y_t = sum_n x_t C_t + D u_t."""
    b, T, H, P = a["x"].shape
    N = a["B"].shape[-1]
    d = H * P
    u = a["x"].reshape(b, T, d).permute(0, 2, 1)                  # (b, d, l)
    delta = _softplus(a["dt"] + a["dt_bias"]).reshape(b, T, d).permute(0, 2, 1)   # (b, d, l)
    A = a["A"].permute(0, 2, 1).reshape(d, N)                     # ours [H, N, P] -> (d, n)
    Bg = a["B"].permute(0, 2, 3, 1)                               # (b, g, n, l)
    Cg = a["C"].permute(0, 2, 3, 1)
    D = a["D"].reshape(d)                                         # ours [H, P] -> (d)
    Bd = Bg.repeat_interleave(P, dim=1)                           # channel c reads group c // P
    Cd = Cg.repeat_interleave(P, dim=1)                           # (b, d, n, l)
    if s0 is None:
        x = torch.zeros(b, d, N, dtype=u.dtype)
    else:
        x = s0["S"].permute(0, 1, 3, 2).reshape(b, d, N)          # ours [B, H, N, P] -> (b, d, n)
    ys = []
    for t in range(T):
        dA = torch.exp(delta[:, :, t, None] * A)
        dBu = delta[:, :, t, None] * Bd[:, :, :, t] * u[:, :, t, None]
        x = dA * x + dBu
        ys.append((x * Cd[:, :, :, t]).sum(-1))
    y = torch.stack(ys, dim=2) + D[:, None] * u                   # (b, d, l)
    o = y.permute(0, 2, 1).reshape(b, T, H, P)
    return o, {"S": x.reshape(b, H, P, N).permute(0, 1, 3, 2)}


def s4d_conv(a, opts, s0):
    """S4D as a convolution, one channel per head: y_t = sum_{s<=t} K_{t-s} x_s + D x_t (+ the
    initial state's free response sum_n C dA^{t+1} h0), with K_j = sum_n C dA^j B_bar,
    dA = exp(dt A), B_bar = (dA - 1) / A * B (zero-order hold), dt = exp(log_dt)."""
    x = a["x"]                                                    # [b, t, h]
    A, Bp, C = a["A"], a["B"], a["C"]                             # [h, n]
    b, T, H = x.shape
    dt = torch.exp(a["log_dt"])[:, None]                          # [h, 1]
    dA = torch.exp(dt * A)
    B_bar = (dA - 1) / A * Bp
    j = torch.arange(T + 1, dtype=x.dtype)
    powers = dA[None] ** j[:, None, None]                         # [T+1, h, n]: dA^j
    kernel = (C[None] * powers[:T] * B_bar[None]).sum(2)          # [T, h]
    lag = torch.arange(T)[:, None] - torch.arange(T)[None, :]     # t - s
    Kmat = kernel[lag.clamp(min=0)] * (lag >= 0)[:, :, None].to(x.dtype)   # [t, s, h]
    y = torch.einsum("tsh,bsh->bth", Kmat, x) + a["D"] * x
    h0 = s0["h"] if s0 is not None else torch.zeros(b, H, A.shape[1], dtype=x.dtype)
    y = y + torch.einsum("thn,bhn->bth", C[None] * powers[1:], h0)
    rev = powers[:T].flip(0)                                      # dA^{T-1-s}
    h = powers[T] * h0 + torch.einsum("shn,bsh->bhn", rev * B_bar[None], x)
    return y, {"h": h}


def rwkv6_fla(a, opts, s0):
    """fla.ops.rwkv6: o_t = sum_k scale r_t,k (S_{t-1}[k, :] + u_k k_t,k v_t);
    S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T."""
    r, k, v, w = (_bh(a[n]) for n in ("r", "k", "v", "w"))       # [b, h, t, *]
    u, scale = a["u"], opts["scale"]
    b, H, T, K = r.shape
    S = s0["S"] if s0 is not None else torch.zeros(b, H, K, v.shape[-1], dtype=r.dtype)
    outs = []
    for t in range(T):
        rt, kt, vt = r[:, :, t], k[:, :, t], v[:, :, t]
        bonus = (scale * rt * u * kt).sum(-1, keepdim=True) * vt
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * rt, S) + bonus)
        S = torch.exp(w[:, :, t])[..., None] * S + kt[..., None] * vt[..., None, :]
    return torch.stack(outs, dim=1), {"S": S}


def rwkv7_fla(a, opts, s0):
    """fla.ops.rwkv7 as its docs (and the paper) write it, on a [V, K] state:
    S_t = S diag(exp(w)) + (S a) b^T + v k^T; o = S_t (scale r). Our state is the transpose
    (fla's kernels also store the state tensors as [N, H, K, V])."""
    r, w, k, v, aa, bb = (_bh(a[n]) for n in ("r", "w", "k", "v", "a", "b"))
    scale = opts["scale"]
    b, H, T, K = r.shape
    V = v.shape[-1]
    S = s0["S"].transpose(-1, -2) if s0 is not None else torch.zeros(b, H, V, K, dtype=r.dtype)
    outs = []
    for t in range(T):
        Sa = S @ aa[:, :, t, :, None]                             # [b, h, V, 1]
        S = (S * torch.exp(w[:, :, t])[:, :, None, :] + Sa * bb[:, :, t, None, :]
             + v[:, :, t, :, None] * k[:, :, t, None, :])
        outs.append((S @ (scale * r[:, :, t, :, None]))[..., 0])
    return torch.stack(outs, dim=1), {"S": S.transpose(-1, -2)}


def delta_fla(a, opts, s0):
    """fla's (gated) delta rule loop: S = exp(g) S; v' = beta (v - S^T k); S = S + k v'^T;
    o = S^T (scale q). q and k l2-normalized first when use_qk_l2norm_in_kernel."""
    q, k, v = (_bh(a[n]) for n in ("q", "k", "v"))
    beta = a["beta"].transpose(1, 2)                              # [b, h, t]
    g = a["g"].transpose(1, 2) if "g" in a else None
    if opts["use_qk_l2norm_in_kernel"]:
        q, k = _l2norm(q), _l2norm(k)
    b, H, T, K = q.shape
    S = s0["S"] if s0 is not None else torch.zeros(b, H, K, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(T):
        if g is not None:
            S = S * torch.exp(g[:, :, t])[..., None, None]
        kt = k[:, :, t]
        v_new = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., None] * v_new[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, opts["scale"] * q[:, :, t]))
    return torch.stack(outs, dim=1), {"S": S}


def delta_wy(a, opts, s0, chunk):
    """The chunked (gated) delta rule in WY / UT form (Yang et al. 2024; 2025), chunk by chunk.
    Delta rule: T = (I + tril(diag(beta) K K^T, -1))^-1, W = T diag(beta) K,
    U = T diag(beta) V - W S, O = scale (Q S + (Q K^T masked i >= j) U), S <- S + K^T U.
    Gated (G = cumsum g within the chunk, Dec_ij = exp(G_i - G_j)): K K^T -> Dec * K K^T,
    W = T diag(beta exp(G)) K, O = scale (diag(exp(G)) Q S + (Q K^T * Dec masked) U),
    S <- exp(G_C) S + K^T diag(exp(G_C - G)) U."""
    q, k, v = (_bh(a[n]) for n in ("q", "k", "v"))
    beta = a["beta"].transpose(1, 2)
    g = a["g"].transpose(1, 2) if "g" in a else torch.zeros_like(beta)
    if opts["use_qk_l2norm_in_kernel"]:
        q, k = _l2norm(q), _l2norm(k)
    b, H, T, K = q.shape
    S = s0["S"] if s0 is not None else torch.zeros(b, H, K, v.shape[-1], dtype=q.dtype)
    outs = []
    for c0 in range(0, T, chunk):
        Q, Kc, Vc, bc, gc = (x[:, :, c0:c0 + chunk] for x in (q, k, v, beta, g))
        n = Q.shape[2]
        G = gc.cumsum(-1)                                             # [b, h, n]
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        dec = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, -INF))
        eye = torch.eye(n, dtype=q.dtype)
        strict = torch.tril(bc[..., None] * dec * (Kc @ Kc.transpose(-1, -2)), -1)
        Tm = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False)
        W = Tm @ ((bc * torch.exp(G))[..., None] * Kc)
        U = Tm @ (bc[..., None] * Vc) - W @ S
        attn = (Q @ Kc.transpose(-1, -2)) * dec
        outs.append(opts["scale"] * (torch.exp(G)[..., None] * (Q @ S) + attn @ U))
        S = (torch.exp(G[..., -1])[..., None, None] * S
             + Kc.transpose(-1, -2) @ (torch.exp(G[..., -1:] - G)[..., None] * U))
    return torch.cat(outs, dim=2).transpose(1, 2), {"S": S}


def _pair_decay(G_row, G_col, strict):
    """exp(G_row[s] - G_col[j]) per key channel, [b, h, s, j, K], zero where j > s (or j >= s)."""
    n = G_row.shape[2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(-1 if strict else 0)[..., None]
    return torch.exp((G_row[:, :, :, None, :] - G_col[:, :, None, :, :]).masked_fill(~keep, -INF))


def rwkv6_chunked(a, opts, s0, chunk):
    """RWKV-6 chunk by chunk (G = cumsum w within the chunk, G_0 = 0):
    o_s = scale [(r_s exp(G_{s-1}))^T S + sum_{j<s} (r_s exp(G_{s-1} - G_j)) . k_j v_j
          + (r_s u) . k_s v_s];  S <- diag(exp(G_C)) S + sum_j diag(exp(G_C - G_j)) k_j v_j^T."""
    r, k, v, w = (_bh(a[n]) for n in ("r", "k", "v", "w"))
    scale, u = opts["scale"], a["u"][None, :, None, :]
    b, H, T, K = r.shape
    S = s0["S"] if s0 is not None else torch.zeros(b, H, K, v.shape[-1], dtype=r.dtype)
    outs = []
    for c0 in range(0, T, chunk):
        R, Kc, Vc, Wc = (x[:, :, c0:c0 + chunk] for x in (r, k, v, w))
        G = Wc.cumsum(2)
        Gprev = G - Wc                                                # G_{s-1}
        A = torch.einsum("bhsk,bhsjk,bhjk->bhsj", R, _pair_decay(Gprev, G, strict=True), Kc)
        bonus = (R * u * Kc).sum(-1, keepdim=True) * Vc
        outs.append(scale * ((R * torch.exp(Gprev)) @ S + A @ Vc + bonus))
        S = (torch.exp(G[:, :, -1])[..., None] * S
             + (Kc * torch.exp(G[:, :, -1:] - G)).transpose(-1, -2) @ Vc)
    return torch.cat(outs, dim=2).transpose(1, 2), {"S": S}


def rwkv7_chunked(a, opts, s0, chunk):
    """RWKV-7 (a diagonal-plus-low-rank transition) chunk by chunk, in our [K, V] layout.
    With G = cumsum w (G_0 = 0) and the pseudo-values u_s = S_{s-1}^T a_s:
    U = (I - A_ab)^-1 (A_ak V + W S),  A_ab[s, j] = (a_s exp(G_{s-1} - G_j)) . b_j (j < s),
    A_ak likewise with k_j, W = rows a_s exp(G_{s-1});
    o_s = scale [(r_s exp(G_s))^T S + sum_{j<=s} (r_s exp(G_s - G_j)) . (k_j v_j + b_j u_j)];
    S <- diag(exp(G_C)) S + sum_j diag(exp(G_C - G_j)) (k_j v_j^T + b_j u_j^T)."""
    r, w, k, v, aa, bb = (_bh(a[n]) for n in ("r", "w", "k", "v", "a", "b"))
    scale = opts["scale"]
    b, H, T, K = r.shape
    S = s0["S"] if s0 is not None else torch.zeros(b, H, K, v.shape[-1], dtype=r.dtype)
    outs = []
    for c0 in range(0, T, chunk):
        R, Wc, Kc, Vc, Ac, Bc = (x[:, :, c0:c0 + chunk] for x in (r, w, k, v, aa, bb))
        n = R.shape[2]
        G = Wc.cumsum(2)
        Gprev = G - Wc
        strict = _pair_decay(Gprev, G, strict=True)                  # exp(G_{s-1} - G_j), j < s
        A_ab = torch.einsum("bhsk,bhsjk,bhjk->bhsj", Ac, strict, Bc)
        A_ak = torch.einsum("bhsk,bhsjk,bhjk->bhsj", Ac, strict, Kc)
        Wm = Ac * torch.exp(Gprev)
        eye = torch.eye(n, dtype=r.dtype)
        U = torch.linalg.solve_triangular(eye - A_ab, A_ak @ Vc + Wm @ S, upper=False, unitriangular=True)
        incl = _pair_decay(G, G, strict=False)                        # exp(G_s - G_j), j <= s
        A_rk = torch.einsum("bhsk,bhsjk,bhjk->bhsj", R, incl, Kc)
        A_rb = torch.einsum("bhsk,bhsjk,bhjk->bhsj", R, incl, Bc)
        outs.append(scale * ((R * torch.exp(G)) @ S + A_rk @ Vc + A_rb @ U))
        to_end = torch.exp(G[:, :, -1:] - G)
        S = (torch.exp(G[:, :, -1])[..., None] * S
             + (Kc * to_end).transpose(-1, -2) @ Vc + (Bc * to_end).transpose(-1, -2) @ U)
    return torch.cat(outs, dim=2).transpose(1, 2), {"S": S}


def mlstm_parallel(a, opts, s0, chunk=None):
    """The mLSTM parallel form, stabilized by the row max (Beck et al. 2024):
    F = cumsum logsigmoid(f), log D_tj = F_t - F_j + i_j (j <= t), the initial state weighted by
    exp(F_t); m_t = max(max_j log D_tj, F_t); Ct = (q_t . ks_j) exp(log D_tj - m_t);
    h_t = (Ct V + exp(F_t - m_t) q_t^T C0) / max(|sum_j Ct + exp(F_t - m_t) q_t . n0|, exp(-m_t))."""
    q, k, v = (_bh(a[n]) for n in ("q", "k", "v"))
    ig, fg = a["i"].transpose(1, 2), a["f"].transpose(1, 2)
    b, H, T, K = q.shape
    ks = opts["scale"] * k
    Fc = F.logsigmoid(fg).cumsum(-1)                                  # [b, h, t]
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    logD = (Fc[..., :, None] - Fc[..., None, :] + ig[..., None, :]).masked_fill(~lower, -INF)
    m = logD.amax(-1)
    if s0 is not None:
        m = torch.maximum(m, Fc)
    Ct = (q @ ks.transpose(-1, -2)) * torch.exp(logD - m[..., None])
    num, den = Ct @ v, Ct.sum(-1)
    if s0 is not None:
        w0 = torch.exp(Fc - m)
        num = num + w0[..., None] * (q @ s0["C"])
        den = den + w0 * (q @ s0["n"][..., None])[..., 0]
    h = num / torch.maximum(den.abs(), torch.exp(-m))[..., None]
    wT = torch.exp(Fc[..., -1:] - Fc + ig)                            # exp(F_T - F_j + i_j)
    C = torch.einsum("bhj,bhjk,bhjv->bhkv", wT, ks, v)
    n = torch.einsum("bhj,bhjk->bhk", wT, ks)
    if s0 is not None:
        C = C + torch.exp(Fc[..., -1])[..., None, None] * s0["C"]
        n = n + torch.exp(Fc[..., -1])[..., None] * s0["n"]
    return h.transpose(1, 2), {"C": C, "n": n}


def mlstm_stabilized(a, opts, s0, branches=None):
    """The xLSTM mLSTM cell with the max-stabilizer (Beck et al. 2024, appendix):
    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t), i' = exp(i_t - m_t),
    f' = exp(logsigmoid(f_t) + m_{t-1} - m_t), C~ = f' C~ + i' ks v^T, n~ = f' n~ + i' ks,
    h = C~^T q / max(|n~ . q|, exp(-m_t)); ks = scale k. C = C~ exp(m), n = n~ exp(m).
    m_0 = -inf from a zero state (fla), 0 from a given state (then C~_0 = C_0)."""
    q, k, v = (_bh(a[n]) for n in ("q", "k", "v"))
    ig, fg = a["i"].transpose(1, 2), a["f"].transpose(1, 2)      # [b, h, t]
    b, H, T, K = q.shape
    ks = opts["scale"] * k
    if s0 is None:
        Ct = torch.zeros(b, H, K, v.shape[-1], dtype=q.dtype)
        nt = torch.zeros(b, H, K, dtype=q.dtype)
        m = torch.full((b, H), -INF, dtype=q.dtype)
    else:
        Ct, nt, m = s0["C"], s0["n"], torch.zeros(b, H, dtype=q.dtype)
    outs = []
    for t in range(T):
        logf = F.logsigmoid(fg[:, :, t])
        m_new = torch.maximum(logf + m, ig[:, :, t])
        i_p = torch.exp(ig[:, :, t] - m_new)
        f_p = torch.exp(logf + m - m_new)
        Ct = f_p[..., None, None] * Ct + i_p[..., None, None] * ks[:, :, t, :, None] * v[:, :, t, None, :]
        nt = f_p[..., None] * nt + i_p[..., None] * ks[:, :, t]
        qt = q[:, :, t]
        num = torch.einsum("bhkv,bhk->bhv", Ct, qt)
        nq = torch.abs((nt * qt).sum(-1))
        floor = torch.exp(-m_new)
        if branches is not None:
            branches.append(nq > floor)
        outs.append(num / torch.maximum(nq, floor)[..., None])
        m = m_new
    scale_back = torch.exp(m)
    return torch.stack(outs, dim=1), {"C": Ct * scale_back[..., None, None], "n": nt * scale_back[..., None]}


# --------------------------------------------------------------------------------------
# the systems and their draws

@dataclass(frozen=True)
class System:
    spec: str
    formula: Callable
    flags: dict = field(default_factory=dict)      # passed only when they differ from the default
    beta: str = "unit"                             # delta rules: 'unit' in (0.1, 0.9), 'near2' in (1.9, 1.99)
    scale_default: Callable | None = None          # sizes -> the default scale (None: no scale option)


def _kpow(sizes):
    return sizes["K"] ** -0.5


SYSTEMS = {
    "mamba2": System("mamba2", mamba2_ssd),
    "mamba": System("mamba", mamba_selective_scan),
    "s4d": System("s4d", s4d_conv),
    "rwkv6": System("rwkv6", rwkv6_fla, scale_default=_kpow),
    "rwkv7": System("rwkv7", rwkv7_fla, scale_default=lambda s: 1.0),
    "mlstm": System("mlstm", mlstm_stabilized, scale_default=_kpow),
}
for _name in ("delta_rule", "gated_delta_rule"):
    for _l2 in (False, True):
        for _beta in ("unit", "near2"):
            _key = _name + ("-l2norm" if _l2 else "") + ("-beta2" if _beta == "near2" else "")
            SYSTEMS[_key] = System(_name, delta_fla, flags={"use_qk_l2norm_in_kernel": _l2} if _l2 else {},
                                   beta=_beta, scale_default=_kpow)

_OPS = {}


def _op(sysname):
    spec = SYSTEMS[sysname].spec
    if spec not in _OPS:
        _OPS[spec] = mixc.load(spec)
    return _OPS[spec]


def _sizes_for(sysname, small=None):
    """The two size sets per dims family (odd, non-power-of-two)."""
    dims = {d.name for d in _op(sysname).ir.dims}
    if "K" in dims:
        return [dict(K=5, V=3), dict(K=7, V=6)] if small is None else dict(K=small, V=small)
    if "P" not in dims:                                           # s4d: one channel per head
        return [dict(N=5), dict(N=7)] if small is None else dict(N=small)
    return [dict(N=5, P=3), dict(N=3, P=7)] if small is None else dict(N=small, P=small)


def make_args(sysname, *, B, T, H, sizes, seed, requires_grad=False):
    """Fresh random inputs and params, drawn so that each recurrence is well-behaved."""
    sysd = SYSTEMS[sysname]
    op = _op(sysname)
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes=sizes, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7919)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    def rand(shape):
        return torch.rand(shape, generator=gen, dtype=torch.float64)

    if sysd.spec in ("delta_rule", "gated_delta_rule"):
        if sysd.flags.get("use_qk_l2norm_in_kernel"):
            args["k"] = args["k"] * (0.5 + rand(args["k"].shape[:-1] + (1,)))   # raw keys of varied norm
        else:
            args["k"] = F.normalize(args["k"], dim=-1)                         # fla expects unit keys here
        if sysd.beta == "near2":
            args["beta"] = 1.9 + 0.09 * rand(args["beta"].shape)
    elif sysd.spec == "rwkv7":
        # RWKV-7's own parametrization: a = -kk, b = kk * gate, kk a unit vector, gate in (0, 1).
        kk = F.normalize(randn(args["a"].shape), dim=-1)
        args["a"] = -kk
        args["b"] = kk * torch.sigmoid(randn(kk.shape))
    elif sysd.spec == "s4d":
        args["log_dt"] = 0.5 * randn(args["log_dt"].shape) - 1.5
    elif sysd.spec == "mlstm":
        args["i"] = 1.5 * randn(args["i"].shape)          # exp(i) from ~0.01 to ~100
        args["f"] = randn(args["f"].shape) + 1.5
    if requires_grad:
        args = {k: v.detach().requires_grad_(True) for k, v in args.items()}
    return args, sizes


def options(sysname, sizes, explicit_scale=False):
    """(kwargs for op.reference, every option value for the formula)."""
    sysd = SYSTEMS[sysname]
    call = dict(sysd.flags)
    full = {"use_qk_l2norm_in_kernel": sysd.flags.get("use_qk_l2norm_in_kernel", False)}
    if sysd.scale_default is not None:
        full["scale"] = sysd.scale_default(sizes)
        if explicit_scale:
            call["scale"] = full["scale"] = 0.37
    return call, full


def _cases():
    out = []
    for name in SYSTEMS:
        for i, sz in enumerate(_sizes_for(name)):
            B, T, H = (2, 9, 3) if i == 0 else (3, 13, 2)
            out.append(pytest.param(name, B, T, H, sz, i == 1, id=f"{name}-" + case_id(B=B, T=T, H=H, **sz)))
    return out


CASES = _cases()


def _run_ref(sysname, args, call, s0, **kw):
    return _op(sysname).reference(**args, **call, initial_state=s0, output_final_state=True, **kw)


# --------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("sysname,B,T,H,sizes,explicit_scale", CASES)
def test_forward_matches_formula(sysname, B, T, H, sizes, explicit_scale, with_state):
    args, sizes = make_args(sysname, B=B, T=T, H=H, sizes=sizes, seed=11 + T)
    call, full = options(sysname, sizes, explicit_scale)
    s0 = random_state(_op(sysname).ir, B, H, sizes, seed=5) if with_state else None
    o, fin = _run_ref(sysname, args, call, s0)
    o_f, fin_f = SYSTEMS[sysname].formula(args, full, s0)
    assert o.dtype == torch.float64
    assert_close(o, o_f, f"{sysname}: output")
    assert set(fin) == set(fin_f)
    for name in fin_f:
        assert_close(fin[name], fin_f[name], f"{sysname}: final state {name}")


@pytest.mark.parametrize("sysname,B,T,H,sizes,explicit_scale", CASES)
def test_gradients_match_formula(sysname, B, T, H, sizes, explicit_scale):
    op = _op(sysname)
    args, sizes = make_args(sysname, B=B, T=T, H=H, sizes=sizes, seed=23 + T, requires_grad=True)
    call, full = options(sysname, sizes, explicit_scale)
    s0 = random_state(op.ir, B, H, sizes, seed=6, requires_grad=True)
    o, fin = _run_ref(sysname, args, call, s0)
    o_f, fin_f = SYSTEMS[sysname].formula(args, full, s0)
    gen = torch.Generator().manual_seed(99)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    w_s = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in fin_f.items()}

    def loss(o_, fin_):
        return (w_o * o_).sum() + sum((w_s[k] * fin_[k]).sum() for k in w_s)

    names = list(args) + [f"initial_state[{k}]" for k in s0]
    leaves = list(args.values()) + list(s0.values())
    g_ref = torch.autograd.grad(loss(o, fin), leaves)
    g_f = torch.autograd.grad(loss(o_f, fin_f), leaves)
    for name, gr, gf in zip(names, g_ref, g_f):
        assert_close(gr, gf, f"{sysname}: d/d {name}")


@pytest.mark.parametrize("sysname", [k for k in SYSTEMS if SYSTEMS[k].beta == "unit"])
def test_gradcheck_tiny(sysname):
    op = _op(sysname)
    sizes = _sizes_for(sysname, small=3)
    args, sizes = make_args(sysname, B=1, T=4, H=2, sizes=sizes, seed=3, requires_grad=True)
    call, _ = options(sysname, sizes)
    s0 = random_state(op.ir, 1, 2, sizes, seed=4, requires_grad=True)
    names, snames = list(args), list(s0)

    def f(*xs):
        a = dict(zip(names, xs[:len(names)]))
        st = dict(zip(snames, xs[len(names):]))
        o, fin = op.reference(**a, **call, initial_state=st, output_final_state=True)
        return (o,) + tuple(fin[k] for k in snames)

    assert torch.autograd.gradcheck(f, tuple(args.values()) + tuple(s0.values()), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sysname,B,T,H,sizes,explicit_scale", CASES)
def test_step_matches_reference(sysname, B, T, H, sizes, explicit_scale):
    op = _op(sysname)
    args, sizes = make_args(sysname, B=B, T=T, H=H, sizes=sizes, seed=31 + T)
    call, _ = options(sysname, sizes, explicit_scale)
    s0 = random_state(op.ir, B, H, sizes, seed=7)
    o, fin = _run_ref(sysname, args, call, s0)
    per_token = {d.name for d in op.ir.inputs}
    state = s0
    for t in range(T):
        step_args = {n: (x[:, t] if n in per_token else x) for n, x in args.items()}
        o_t, state = op.reference_step(state=state, **step_args, **call)
        assert_close(o_t, o[:, t], f"{sysname}: step output at t={t}", tol=1e-12)
    for name in fin:
        assert_close(state[name], fin[name], f"{sysname}: step final state {name}", tol=1e-12)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("lengths", [(3, 5, 1), (4, 0, 2, 7)], ids=["L3-5-1", "L4-0-2-7"])
@pytest.mark.parametrize("sysname", list(SYSTEMS))
def test_cu_seqlens_equals_separate_runs(sysname, lengths, with_state):
    op = _op(sysname)
    H, T = 3, sum(lengths)
    sizes = _sizes_for(sysname)[0]
    args, sizes = make_args(sysname, B=1, T=T, H=H, sizes=sizes, seed=41 + len(lengths))
    call, _ = options(sysname, sizes)
    n = len(lengths)
    s0 = random_state(op.ir, n, H, sizes, seed=8) if with_state else None
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    o, fin = _run_ref(sysname, args, call, s0, cu_seqlens=cu)
    per_token = {d.name for d in op.ir.inputs}
    for i in range(n):
        lo, hi = int(cu[i]), int(cu[i + 1])
        sub = {k: (x[:, lo:hi] if k in per_token else x) for k, x in args.items()}
        s0_i = None if s0 is None else {k: v[i:i + 1] for k, v in s0.items()}
        o_i, fin_i = _run_ref(sysname, sub, call, s0_i)
        assert_close(o[:, lo:hi], o_i, f"{sysname}: packed output of sequence {i}", tol=1e-12)
        for name in fin_i:
            assert_close(fin[name][i:i + 1], fin_i[name], f"{sysname}: packed final {name} of sequence {i}",
                         tol=1e-12)
            if hi == lo:                         # an empty sequence hands its initial state back
                want = s0_i[name] if s0_i is not None else torch.zeros_like(fin_i[name])
                assert_close(fin[name][i:i + 1], want, f"{sysname}: empty sequence {i} state {name}")


CHUNKED = {"delta_rule": delta_wy, "gated_delta_rule": delta_wy, "rwkv6": rwkv6_chunked,
           "rwkv7": rwkv7_chunked, "mlstm": mlstm_parallel}


def _chunk_cases():
    out = []
    for name, sysd in SYSTEMS.items():
        if sysd.spec not in CHUNKED:
            continue
        chunks = [9] if sysd.spec == "mlstm" else [9, 4, 1]   # mlstm: one parallel block
        for c in chunks:
            out.append(pytest.param(name, c, id=f"{name}-" + ("one-chunk" if c == 9 else f"chunk{c}")))
    return out


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("sysname,chunk", _chunk_cases())
def test_chunked_form(sysname, chunk, with_state):
    """The chunked forms (the delta rules' WY / UT form, RWKV-6/7 with in-chunk cumulative
    decays, mLSTM's parallel form) equal the reference (B2 T9 H3 K5 V3)."""
    spec = SYSTEMS[sysname].spec
    B, T, H = 2, 9, 3
    op = _op(sysname)
    args, sizes = make_args(sysname, B=B, T=T, H=H, sizes=dict(K=5, V=3), seed=51)
    call, full = options(sysname, sizes)
    s0 = random_state(op.ir, B, H, sizes, seed=9) if with_state else None
    o, fin = _run_ref(sysname, args, call, s0)
    o_c, fin_c = CHUNKED[spec](args, full, s0, chunk)
    assert_close(o, o_c, f"{sysname}: chunked output (chunk {chunk})")
    for name in fin:
        assert_close(fin[name], fin_c[name], f"{sysname}: chunked final state {name} (chunk {chunk})")


def test_mlstm_draws_reach_both_normalizer_branches():
    """The mlstm draws exercise both sides of max(|n . q|, 1), so both are checked above."""
    args, sizes = make_args("mlstm", B=2, T=9, H=3, sizes=dict(K=5, V=3), seed=11 + 9)
    _, full = options("mlstm", sizes)
    for s0 in (None, random_state(_op("mlstm").ir, 2, 3, sizes, seed=5)):
        branches = []
        mlstm_stabilized(args, full, s0, branches)
        hit = torch.stack(branches)
        assert hit.any() and not hit.all(), f"|n.q| > 1 in {hit.float().mean().item():.2f} of tokens"

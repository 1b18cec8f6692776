"""FLOP and byte counts behind the TFLOP/s and memory-floor columns (derived in bench/README.md).

Counts are per token and head (a multiply-add is 2 FLOPs), for an input of B sequences of T
tokens and H heads; multiply by B * T * H. Both implementations of an op (mixc, fla) get the
same count, taken at the chunk size C = 64 (fla's), so TFLOP/s compares like with like and a
ratio of TFLOP/s is the inverse ratio of milliseconds."""
from __future__ import annotations

NOMINAL_C = 64
BF16 = 2          # bytes per element of the inputs and outputs
RANK1 = ("delta_rule", "gated_delta_rule")


def chunk_flops(spec: str, K: int, V: int, C: int = NOMINAL_C) -> dict[str, float]:
    """FLOPs per token-head of the chunked forward and of forward + backward.

    Linear classes (prefix sum, scalar, key- and value-diagonal decay), per token of a chunk:
      forward   2CK (scores Q K^T) + 2CV (scores V) + 2KV (Q S0) + 2KV (state update K^T V)
                = 2C(K+V) + 4KV
      backward  2CK (recompute the scores) + 2CV (dA = dO V^T) + 2CK + 2KV (dQ = dA K + dO S0^T)
                + 2CK + 2KV (dK = dA^T Q + V dS^T) + 2CV + 2KV (dV = A^T dO + K dS) + 2KV (dS)
                = 6CK + 4CV + 8KV
    Rank-1 (delta rules, WY form): the linear count with V replaced by u = U - W S0, plus
      forward   2CK (A = beta K K^T) + 2C^2/3 (the triangular solve, C^3/3 multiply-adds per
                chunk) + 2CK + 2CV (W = T beta K, U = T beta V) + 2KV (W S0)
      backward  twice those extras (each product has two operand gradients) + 4KV (dW, dS0 of W S0)
    Decay gates, exponentials and the l2-norms are elementwise and not counted."""
    fwd = 2 * C * (K + V) + 4 * K * V
    bwd = 6 * C * K + 4 * C * V + 8 * K * V
    if spec in RANK1:
        extra = 2 * C * K + 2 * C * C / 3 + 2 * C * K + 2 * C * V + 2 * K * V
        fwd += extra
        bwd += 2 * (extra - 2 * K * V) + 4 * K * V
    return {"fwd": float(fwd), "fwd_bwd": float(fwd + bwd)}


def io_elements(mixer, sizes: dict[str, int]) -> tuple[int, int]:
    """(elements of all per-token inputs, elements of the output) per token-head, from the spec."""
    def n(shape):
        out = 1
        for d in shape:
            out *= sizes[d]
        return out
    return sum(n(d.shape) for d in mixer.inputs), n(mixer.output.expr.shape)


def floor_bytes(n_in: int, n_out: int, nbytes: int = BF16) -> dict[str, float]:
    """Bytes per token-head that any implementation must move through HBM:
      forward        read every input, write the output:               b (in + out)
      fwd + bwd      the forward, then read the inputs and dO and write
                     every input's gradient:                            b (3 in + 2 out)
    (q, k, v, o in bf16 give the forward's 4(K+V).) Per-head params and the states, which are
    per sequence, not per token, are left out."""
    return {"fwd": float(nbytes * (n_in + n_out)), "fwd_bwd": float(nbytes * (3 * n_in + 2 * n_out))}


def sdpa_flops(T: int, K: int, V: int) -> dict[str, float]:
    """Causal attention per token-head: query t meets (t + 1) keys, on average (T + 1) / 2:
    forward 2K + 2V FLOPs per pair = (T + 1)(K + V); backward 2.5 times the forward (5 matmuls
    against 2, flash-attention's convention), so forward + backward 3.5 times."""
    fwd = (T + 1) * (K + V)
    return {"fwd": float(fwd), "fwd_bwd": float(3.5 * fwd)}


def decode_step(spec: str, K: int, V: int, n_in: int, n_out: int) -> dict[str, float]:
    """One decode step per sequence and head of a recurrent op: FLOPs 2KV (q^T S) + 2KV (the
    decayed state plus k v^T) [+ 2KV for S^T k in the delta rules]; bytes: the fp32 state read
    and written (8KV) and the token's inputs and output."""
    flops = 4 * K * V + (2 * K * V if spec in RANK1 else 0)
    return {"flops": float(flops), "bytes": float(8 * K * V + BF16 * (n_in + n_out))}


def sdpa_decode(L: int, K: int, V: int) -> dict[str, float]:
    """One query against a KV cache of L tokens, per sequence and head: FLOPs 2L(K + V); bytes:
    the bf16 cache read (2L(K + V)) and q and o."""
    return {"flops": float(2 * L * (K + V)), "bytes": float(BF16 * (L * (K + V) + K + V))}


def tflops(flops_total: float, ms: float) -> float:
    return flops_total / (ms * 1e-3) / 1e12


def floor_multiple(bytes_total: float, ms: float, bandwidth: float) -> float:
    """ms over the time to move bytes_total at the measured copy bandwidth (bytes/s): 1 is the floor."""
    return (ms * 1e-3) / (bytes_total / bandwidth)

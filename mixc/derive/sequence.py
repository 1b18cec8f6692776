"""The Plan of a sequence mixer: a spec built from conv, mix and attend instead of a state.

There is no recurrence to classify. What the derivation decides is, per sequence op, its
algorithm (direct sum or FFT, a masked matmul, SDPA or flex_attention), whether it can step
(causal ops only) and what its step cache keeps; `mixc explain` prints it (explain_sequence).
The runtime is mixc/runtime/sequence.py; gradients are torch autograd's."""
from __future__ import annotations

from dataclasses import dataclass

from ..dsl import ir
from ..dsl.unparse import dim_text, expr_text

# The direct (no FFT) convolution: filters of at most this many taps, or at most this many
# new tokens (decode); runtime/seqops.py uses the same numbers.
DIRECT_MAX_TAPS = 64
DIRECT_MAX_ROWS = 16

LABELS = {"conv": "long convolution", "mix": "token mixing", "attend": "softmax attention"}


@dataclass(frozen=True)
class SeqOpPlan:
    index: int
    kind: str                          # conv, mix, attend
    name: str                          # conv0, mix1, ...: the stem of its cache keys
    text: str                          # the op as spec text
    where: str                         # "let u" or "output y"
    causal: bool                       # the flag resolved
    tap: str | None                    # conv: the filter's tap dim
    filter: str | None                 # conv: "taps" (a tap dim), "constant" (the same at every lag), "sequence"
    window: ir.Expr | None             # attend
    cache: tuple[tuple[str, str], ...]  # (key, what it holds) in the step state
    algorithm: tuple[str, ...]         # lines for mixc explain


@dataclass(frozen=True)
class SequencePlan:
    ops: tuple[SeqOpPlan, ...]
    no_step: str | None                # why step() / states are refused, or None
    stabilized: bool                   # exponentials are carried with a scale (runtime/sequence.py)

    @property
    def kind(self) -> str:
        labels = []
        for op in self.ops:
            label = LABELS[op.kind]
            if op.kind == "attend" and op.window is not None:
                label = "sliding-window " + label
            if label not in labels:
                labels.append(label)
        return "sequence mixer: " + ", ".join(labels)

    @property
    def cache_keys(self) -> tuple[str, ...]:
        return ("pos",) + tuple(k for op in self.ops for k, _ in op.cache)


def varies(mixer: ir.MixerIR, e: ir.Expr) -> bool:
    """e differs from token to token: it reads an input, a per-position param or a sequence op
    (through lets too)."""
    for node in ir.walk(e):
        if isinstance(node, ir.SeqOp):
            return True
        if isinstance(node, ir.Ref):
            if node.kind == "input" or (node.kind == "param" and mixer.positional(node.name)):
                return True
            if node.kind == "let" and varies(mixer, mixer.let(node.name).expr):
                return True
    return False


def _where(mixer: ir.MixerIR, op: ir.SeqOp) -> str:
    for let in mixer.lets:
        if any(n is op or n == op for n in ir.walk(let.expr)):
            return f"let {let.name}"
    return f"output {mixer.output.name}"


def _conv(op: ir.SeqOp, name: str, causal: bool, kind: str, h: str, x: str):
    if kind == "taps":
        L = op.tap
        lines = [f"filter {h}: {L} taps (dim {L}, at most T); y_t = sum_{{j<{L}}} h_j x_{{t-j}}"]
        cache = ((f"{name}_x", f"the last {L} - 1 values of {x}"),)
    elif kind == "constant":
        lines = [f"filter {h} is the same at every lag (no tap dim, nothing per token): "
                 f"y_t = h * sum_{{s<=t}} x_s, a cumulative sum"]
        cache = ((f"{name}_sum", f"the running sum of {x}"),)
    else:
        lines = [f"filter {h} has no tap dim: its taps run along time, h at token j is tap j (as long as the "
                 "sequence)"]
        cache = ((f"{name}_h", f"every past value of {h}"), (f"{name}_x", f"every past value of {x}"))
    if causal:
        lines.append("causal: y_t reads x_s for s <= t")
    else:
        lines.append("not causal (centred): y_t = sum_j h_j x_{t-j+c}, c = (L - 1) // 2 for L taps, zero beyond "
                     "the ends; it reads future tokens")
        cache = ()
    if kind != "constant":
        lines.append(f"algorithm: direct (a sum over the taps) for at most {DIRECT_MAX_TAPS} taps or at most "
                     f"{DIRECT_MAX_ROWS} new tokens (decode); otherwise FFT: n = the next power of two >= "
                     "T + L - 1 (2T for a filter as long as the sequence), y = irfft(rfft(x, n) * rfft(h, n), n) "
                     "truncated to the first T outputs" + ("" if causal else " after a shift by c")
                     + ", in float32 at least")
    else:
        lines.append("algorithm: torch.cumsum (exact; no FFT)" if causal else "algorithm: the sum over the "
                     "centred window, as a cumulative sum")
    return lines, cache


def derive_sequence(mixer: ir.MixerIR, flags: dict[str, bool]) -> tuple[SequencePlan, tuple[str, ...], tuple[str, ...]]:
    """(the sequence plan, the forms, the notes) of a sequence mixer; derive() makes its Plan."""
    values = {o.name: o.default for o in mixer.flags} | flags
    ops, blockers = [], []
    for op in mixer.sequence_ops:
        name = f"{op.kind}{op.index}"
        causal = values[op.causal] if isinstance(op.causal, str) else op.causal
        texts = [expr_text(a) for a in op.args]
        kind = None
        if op.kind == "conv":
            kind = "taps" if op.tap is not None else ("sequence" if varies(mixer, op.args[0]) else "constant")
            lines, cache = _conv(op, name, causal, kind, texts[0], texts[1])
        elif op.kind == "mix":
            lines = [f"y_t = sum_{{s{'<=' if causal else ' < T'}}} W_t[s] x_s, W_t the row of {texts[0]} at position "
                     "t (a [T, T] param sliced to the sequence)",
                     "algorithm: a " + ("causally masked " if causal else "") + "matmul over the source positions, "
                     "O(T^2) per channel"]
            cache = ((f"{name}_x", f"every past value of {texts[1]}"),) if causal else ()
        else:
            win = f"t - s < {expr_text(op.window)}" if op.window is not None else None
            mask = " and ".join(x for x in (("s <= t" if causal else None), win) if x) or "every s"
            lines = [f"o_t = sum_s softmax_s(q_t . k_s) v_s over {mask}; q = {texts[0]}, k = {texts[1]}, "
                     f"v = {texts[2]} (no scale is added: the spec scales q)",
                     "algorithm: on CUDA, flex_attention (compiled) with a block mask built from the mask above" + (
                         "; scaled_dot_product_attention(is_causal=True) when the mask is plain causal"
                         if op.window is None else ""),
                     "algorithm: on the CPU, scaled_dot_product_attention with the mask as a boolean tensor "
                     "(flex_attention has no CPU backward in torch 2.13); reference: the masked softmax in float64"]
            if causal and op.window is not None:
                cache = ((f"{name}_k", f"the last window - 1 keys {texts[1]}"),
                         (f"{name}_v", f"the last window - 1 values {texts[2]}"))
            elif causal:
                cache = ((f"{name}_k", f"every past key {texts[1]}"), (f"{name}_v", f"every past value {texts[2]}"))
            else:
                cache = ()
        if not causal:
            blockers.append(f"{op.kind}() in {_where(mixer, op)} is not causal")
        ops.append(SeqOpPlan(op.index, op.kind, name, expr_text(op), _where(mixer, op), causal, op.tap, kind,
                             op.window, cache, tuple(lines)))
    no_step = None
    if blockers:
        no_step = "; ".join(blockers) + ": it reads future tokens, so there is no state to continue from"
    stabilized = any(isinstance(n, ir.Call) and n.fn == "exp"
                     for e in [x.expr for x in mixer.lets] + [mixer.output.expr] for n in ir.walk(e))
    seq = SequencePlan(tuple(ops), no_step, stabilized)
    notes = [no_step + " (step(), initial_state and output_final_state are refused)"] if no_step else []
    forms = ("sequence",) if no_step else ("sequence", "step")
    return seq, forms, tuple(notes)


def _shape(shape) -> str:
    return "[" + ", ".join(shape) + "]"


def explain_sequence(plan) -> str:
    m, seq = plan.ir, plan.sequence
    out = [f"mixer {m.name}    ({m.source.filename}, spec hash {m.spec_hash})",
           f"class: {plan.transition}",
           f"forms: {', '.join(plan.forms)}",
           "kernels: none generated (no Triton kernel: computed by torch)"]
    if plan.flags:
        out.append("flags: " + ", ".join(f"{k}={str(v).lower()}" for k, v in plan.flags))
    out += ["", "shapes (per call; dims bind from the tensors; T is the sequence length)",
            "  dims     " + ", ".join(dim_text(d) for d in m.dims)]
    for d in m.inputs:
        out.append(f"  input    {d.name}[B, T, H{''.join(', ' + x for x in d.shape)}]")
    for d in m.params:
        rows = ("  (rows and columns sliced to the positions of the call; at least T x T)" if d.shape[1:2] == ("T",)
                else "  (sliced to the positions of the call; at least T)" if d.shape[:1] == ("T",) else "")
        out.append(f"  param    {d.name}[H{''.join(', ' + x for x in d.shape)}]{rows}")
    for o in m.options:
        default = str(o.default).lower() if o.kind == "bool" else expr_text(o.default)
        out.append(f"  option   {o.name} = {default}")
    out.append(f"  output   {m.output.name}[B, T, H{''.join(', ' + x for x in m.output.expr.shape)}]")
    if m.lets:
        out += ["", "lets (per token, over the whole sequence at once)"]
        out += [f"  {x.name}{_shape(x.expr.shape)} = {expr_text(x.expr)}" for x in m.lets]
    out += ["", f"output {m.output.name} = {expr_text(m.output.expr)}"]
    for op in seq.ops:
        out += ["", f"{op.name} = {op.text}    ({LABELS[op.kind]}, in {op.where})"]
        out += ["  " + line for line in op.algorithm]
        if op.cache:
            out.append("  step cache: " + "; ".join(f"{k} = {what}" for k, what in op.cache))
    out.append("")
    if seq.no_step:
        out.append(f"step: none: {seq.no_step}")
    else:
        out.append("step: the state is a cache, {" + ", ".join(seq.cache_keys) + "}: pos counts the tokens seen "
                   "(per sequence); caches are [B, H, length, *dims]; a step appends one token and computes "
                   "only its output")
    if seq.stabilized:
        out.append("exponentials: exp(x) of per-token values is carried as exp(x - c) with its scale c (the "
                   "largest x over the sequence and the positional dims, per channel, held constant in the "
                   "backward), so a ratio such as mix(exp(w), exp(k) * v) / mix(exp(w), exp(k)) never forms "
                   "exp(k) itself; the scales cancel exactly")
    out += ["", "backward", "  torch autograd through the same ops (FFT, cumulative sums, einsum, "
            "scaled_dot_product_attention / flex_attention)"]
    if plan.notes:
        out.append("")
        out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)

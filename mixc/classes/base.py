"""What a transition class is: one unit that owns everything the compiler knows about one
shape of state update S_t = A_t S_{t-1} + B_t (DESIGN.md section 1).

A unit says
- which updates it claims (`claims`, from the update's shape: its decay, which dims that decay
  runs over, its projection terms) and its one name, used by the Plan, the generated module's
  METADATA and tables, `mixc explain` and the runtime alike;
- which parallel form it has (the chunked kernels, an associative scan, none), whether a
  time-invariant state of the class has the convolution form, and whether the exponential-gate
  stabilizer can rescale it;
- its chunk-size policy and the chunk sizes the tuner tries;
- its chunked algorithm three times over, one per notation, each next to the others: the
  Triton kernel stages (the `chunk_*` hooks below, for codegen/chunk.py and chunk_bwd.py: built
  as kernel IR with the builder the codegen hands them, code.builder(st), and reading as Triton),
  the torch backend's chunked form
  (`torch_*`, for runtime/torch_chunk*.py) and the context-parallel summary of a shard
  (`cp_*`, for runtime/context_parallel.py);
- the lines `mixc explain` prints for the class (`explain_chunk`).

The units sit below derive (dsl <- classes <- derive <- codegen <- runtime): they read the
plan's objects (StatePlan, ChunkCode, tensors) handed to them and import no stage above dsl, so
derive, codegen and the runtime all ask the same unit. Registry: mixc/classes/__init__.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Projection:
    """A term scale * (proj @ S) of an update, contracting `over`: the dims of each factor."""

    scale_dims: tuple[str, ...] | None     # None: no scale (1)
    proj_dims: tuple[str, ...]
    over: tuple[str, ...]


@dataclass(frozen=True)
class UpdateShape:
    """The facts about one state's update that decide its class."""

    state_dims: tuple[str, ...]
    key_dims: tuple[str, ...]              # the dims the output contracts (K of S[K, V])
    value_dims: tuple[str, ...]
    decay_is_one: bool                     # the diagonal part is the identity
    decay_dims: tuple[str, ...]            # the dims its diagonal decay varies over
    projections: tuple[Projection, ...]
    # the outer products key (x) value the input term is a sum of, where it is a sum of two or
    # more (derive/plan.py _outer_terms); 0 otherwise
    input_pieces: int = 0


class TransitionClass:
    """The defaults of a unit; each class overrides what differs."""

    name: str = ""
    hardness: float = 0                    # Plan.transition names the hardest class of its states
    parallel_form: str | None = None       # "chunk" (the chunked kernels), "scan", or None
    torch_chunked: bool = False            # the torch backend's chunked form serves it
    conv_form: bool = False                # a time-invariant state of the class: the convolution form
    stabilizable: bool = False             # the exponential-gate max-stabilizer can rescale it
    # the update is one term left * (right @ S) whose left the plan keeps apart (StateIR.left,
    # .right): the rank-1 and value-column classes
    single_projection: bool = False
    # the plan scales the key by the term's left (StateIR.left_scale) and calls the state gated
    # when its diagonal decay is not 1: the rank-1 class's WY/UT form reads them
    keyed_left: bool = False
    # the stabilizer's rescaled state keeps this class's own log decay (a scalar decay); the
    # others' log decay is 0 there (a prefix sum)
    stabilizer_keeps_decay: bool = False
    # mode "torch"'s prefill takes the token loop of the generated step over this class's
    # chunked torch form: no matmul to batch in a chunk (runtime/torch_step.py, measured there)
    token_loop_prefill: bool = False

    def claims(self, u: UpdateShape) -> bool:
        raise NotImplementedError

    # ---- chunk policy ----
    def chunk_size(self, st) -> int:
        """The default chunk C of the chunked kernels for a state of the class (the plan takes
        the smallest over its states)."""
        return 64

    def chunk_candidates(self, C: int) -> list[int]:
        """The chunk sizes the tuner times, the default first: half of it too where the
        intra-chunk term is a [C, C] matrix and C / 2 is still a tensor-core tile (16)."""
        return [C, C // 2] if C // 2 >= 16 else [C]

    # ---- explain ----
    def no_parallel_note(self, st) -> str | None:
        """The derivation's note for a state of a class without a parallel form (None: none)."""
        return None

    def explain_chunk(self, st, s) -> list[str]:
        """The class's chunked (or parallel) equations for `mixc explain`; `s` prints a sympy
        expression as the explain text writes it."""
        return []

    # ---- kernel stages (codegen/chunk.py, chunk_bwd.py) ----
    # The Triton of a class's chunk: a class with chunked kernels (parallel_form "chunk") builds
    # its stages as kernel IR in these hooks with `code.builder(st)` (codegen/chunk_stage.py:
    # the chunk's names as typed blocks, Triton's functions over them; its `lines()` are the
    # stage's statements, verified and printed). `code` is the plan's ChunkCode (ChunkBackward):
    # it owns what every class shares (the chunk's rows, the cumulative log decay b_<S> and its
    # resets, the stabilizer, fresh names, the gradient lists G). `parts` is a state's
    # (K, V, g, kd, vd): its key and value matrices [C, KF], [C, VF], its log decay and its flat
    # key and value axes. readout, advance and their backwards have no default: each class
    # writes its own (mixc/classes/scalar.py is the shortest example).
    compensated_sum: bool = False          # its stages take b as hi + lo (ChunkCode.compensated)
    # its readout's intra-chunk matrix [C, C] is staged: the forward's intra kernel computes it once
    # per chunk into p_intra, the output kernel (every tile block) reads it (ChunkCode.intra_slot)
    stages_intra: bool = False
    # its setup's [C, C] inverse (the rank-1 class's (I - M)^-1) can be staged by the forward's
    # intra kernel for the walk and the output kernel to read (launch.STAGE_SOLVE: on by default)
    stages_solve: bool = False
    # the forward output kernel's block of the tile dim (None: launch.CHUNK_TILE, the other launches')
    output_tile: int | None = None
    # the chunked backward's block of the tile dim, both its launches (None: launch.CHUNK_TILE)
    backward_tile: int | None = None
    # the block of the key dim the chunked kernels loop over where C * K is large (Launcher.key_block, standalone/launcher.py;
    # None: launch.KEY_BLOCK_AT)
    key_block: int | None = None
    # the forward output kernel walking several chunks holds its state in static key blocks (codegen/
    # key_walk.py), where KEY_BLOCK is less than K
    walks_key_blocks: bool = False
    # the chunked form may store the class's checkpoints and dL/dS at chunk ends in bf16/fp16
    # inputs' dtype (derive/layout.py half_states; the plan also asks an output linear in the
    # readouts)
    half_checkpoints: bool = True
    # a stretch of tokens maps its start state by a diagonal Phi = exp(the summed log decays) over the
    # state's leading key dims: the segmented walk (standalone/segments.py) corrects its checkpoints so
    diagonal_segments: bool = False

    def checkpoint_tokens(self, st) -> int | None:
        """Tokens between the chunked forward's checkpoints (None: launch.CHECKPOINT_TOKENS),
        where an output kernel walking several chunks holds too much (a chunk's tokens: one per chunk)."""
        return None

    def decay_is_vector(self, st) -> bool:
        """The chunk's log decay is one number per token, a [C] vector (else [C, axes])."""
        return self.decay_axis(st) == "scalar"

    def decay_axes(self, st, kd, vd):
        """The axes of the chunk's log decay [C, axes] (decay_axis, given the state's flat key
        and value axes): () for a [C] vector, None where the class has no decay."""
        return {None: None, "scalar": (), "key": kd, "value": vd}[self.decay_axis(st)]

    @property
    def stages_file(self) -> str | None:
        """The file of mixc/classes holding the class's kernel stages (its own module; None: no
        chunked kernels)."""
        if self.parallel_form != "chunk":
            return None
        return type(self).__module__.rpartition(".")[2] + ".py"

    def chunk_inputs(self, code, st, em, kd) -> dict[str, str]:
        """The class's own per-token matrices beside K and V, by role (rank-1: L, R)."""
        return {}

    def chunk_setup(self, code, st, parts) -> list[str]:
        """What the readouts and the update of a chunk share, after the cumulative decays."""
        return []

    def chunk_readout(self, code, st, R: str, Q: str, K: str, V: str, prev: bool) -> list[str]:
        """R = the readout of S_t (of S_{t-1} with prev) for the chunk's C query rows Q."""
        raise NotImplementedError(f"the {self.name} class builds no readout stage")

    def chunk_advance(self, code, st, parts) -> list[str]:
        """s_<S> = S_C: the state at the chunk's end."""
        raise NotImplementedError(f"the {self.name} class builds no advance stage")

    def chunk_readout_backward(self, code, st, dR: str, Q: str, K: str, V: str, prev: bool, dQ: str,
                               G: dict) -> list[str]:
        """dQ (assigned), and the readout term's parts of dK, dV, db and dS0 (into G)."""
        raise NotImplementedError(f"the {self.name} class builds no readout backward stage")

    def chunk_advance_backward(self, code, st, parts, G: dict) -> list[str]:
        """The update's parts of dK, dV, db and dS0 given d_<S> = dL/dS_C (and _dbl_<S>, the
        gradient of b at the chunk's last token)."""
        raise NotImplementedError(f"the {self.name} class builds no advance backward stage")

    def chunk_setup_backward(self, code, st, parts, G: dict) -> tuple[list[str], list]:
        """Back through chunk_setup, after the update's adjoint: (lines, seeds), a seed being
        (IR expression, its gradient's name, that gradient's dims) for the spec's adjoint."""
        return [], []

    # ---- torch form (runtime/torch_chunk.py) ----
    # The chunked algorithm in plain torch (autograd gives the backward), in two layouts: one
    # chunk at a time [B, c, H, *] (torch_setup, torch_readout, torch_advance: every class with
    # torch_chunked) and groups of chunks [B' H, N, C, *] (torch_decay and torch_chunks_*: the
    # classes with torch_batched), the runtime keeping the loop, the batching and the walk.
    # st is the state's TORCH_STATES entry (its "class", "decay": decay_axis, kd, vd, decl);
    # K [.., KF], V [.., VF], the rank-1 L, R [.., KF] (else None); S [B, H, KF, VF] the state
    # at the chunk's start; bb the chunk's logs (torch_ops.loop_chunk_logs: b, b at the last
    # token, b_{i-1}, the suffix sums, g; None without a decay); logs the stabilizer's (m per
    # row, the gate, m at the start, m at the end) for a state of its group, else None.
    torch_batched: bool = True             # the batched form (runtime/torch_chunk.py, torch_forward_batched) serves it
    torch_chunk: int | None = None         # the torch form's default chunk (None: torch_chunk.TORCH_CHUNK)
    # The torch form's L, R carry a term axis [.., r, KF] (the plan's StateIR.terms) and K, V an
    # input-term axis [.., m, *] (StateIR.inputs: B_t = sum_m k_m v_m^T): the rank-r class
    term_axes: bool = False
    # The torch form's L varies per value column (the plan's StateIR.left over key and value
    # dims; R stays [.., KF]): [.., KF + VF], its key and value factors side by side, where the
    # left is their product, else [.., KF, VF]: the per-value-column class
    left_per_value: bool = False

    def decay_axis(self, st) -> str | None:
        """What the state's log decay g runs over, for the torch form and the context-parallel
        summary (TORCH_STATES' "decay"): None (no decay: g is None), "scalar" (g [.., H]),
        "key" ([.., H, KF]), "value" ([.., H, VF]) or "element" ([.., H, KF, VF])."""
        return None

    def torch_setup(self, st, K, V, L, R, S, bb):
        """What a chunk's readouts and its update share (handed back to them as ctx)."""
        return None

    def torch_readout(self, st, Q, K, V, L, S, bb, prev, logs, ctx):
        """[B, c, H, VF]: the readouts q . S_t (S_{t-1} with prev) of the chunk's query rows Q."""
        raise NotImplementedError

    def torch_advance(self, st, K, V, L, S, bb, logs, ctx):
        """[B, H, KF, VF]: the state at the chunk's end."""
        raise NotImplementedError

    def torch_decay(self, st, g, fast: bool):
        """The state's decay over a group of chunks for the batched form: a torch_ops.NoDecay
        (or kin) that does the decayed products, the factors on the keys and the factor of the
        walk. g [BH, N, C(, F)] in the chunk layout, or None (no decay); fast: no autograd
        graph is recorded."""
        _, ops = torch_form()
        return ops.DECAYS[st["decay"] if g is not None else None](g, fast)

    def torch_chunks_setup(self, dec, K, V, L, R):
        """What the walk needs besides S <- a S + KV per chunk (rank-1: U = W0 + Wm S), or None."""
        return None

    def torch_chunks_update(self, dec, K, V):
        """[BH, n, KF, VF]: each chunk's own part of the state at its end, (K exp(b_C - b))^T V."""
        _, ops = torch_form()
        # without autograd into the group's arena (it dies with the group: the walk reads it)
        out = dec.take(K.shape[:2] + K.shape[-1:] + V.shape[-1:], K) if dec.fast else None
        return ops.mm(dec.on_keys(K, 3).transpose(-1, -2), V, fast=dec.fast, out=out)

    def torch_chunks_readout(self, dec, Q, K, V, L, S_starts, U, prev):
        """[BH, n, C, VF]: one readout term q . S over a group of chunks, S_starts the states at
        the chunks' starts (and U the rank-1 walk's)."""
        _, ops = torch_form()
        val = ops.mm(dec.on_keys(Q, 2 if prev else 0), S_starts, fast=dec.fast)
        return ops.mm(dec.product(Q, K, prev), V, val, fast=dec.fast)

    # ---- context parallel (runtime/context_parallel.py) ----
    # A shard maps its state at its start affinely to its end: S_end = Phi S_start + Z.
    def cp_transition(self, st, pc, name: str, n: int, H: int):
        """Phi of the state `name` over a shard, from the shard's torch pieces pc (torch_pieces:
        [n, T, H, *]): here a diagonal decay's exp(the sum of g over the shard), [n, H], [n, H,
        KF], [n, H, VF] or [n, H, KF, VF] as g runs over nothing, the keys, the values or every
        element."""
        return pc["g"][name].sum(1).exp()

    def cp_apply(self, st, phi, S):
        """Phi S for a state S [n, H, KF, VF]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<transition class {self.name}>"


def projection_shard_map(unit, st, pc, name, n, H):
    """The [KF, KF] map Phi of a shard for the classes with projection terms (rank-1, rank-r):
    the unit's torch form run chunk by chunk on S0 = I with every value 0 (the input term
    dropped), so S_end = Phi @ S_start over the key axis. Its cp_apply is a matrix product."""
    torch, ops = torch_form()
    L, R, K, g = pc["L"][name], pc["R"][name], pc["K"][name], pc["g"][name]
    T, KF = K.shape[1], K.shape[-1]
    if g is None:                                 # no decay
        g = torch.zeros(n, T, H, dtype=K.dtype, device=K.device)
    S = torch.eye(KF, dtype=K.dtype, device=K.device).expand(n, H, KF, KF)
    C = 32
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        bb = ops.loop_chunk_logs(g[:, c0:c1])       # per-pair sums, suffixes
        L_, R_, K_ = L[:, c0:c1], R[:, c0:c1], K[:, c0:c1]
        zero_v = torch.zeros_like(K_)               # v = 0: K's shape, the value axis KF wide
        ctx = unit.torch_setup(st, K_, zero_v, L_, R_, S, bb)
        S = unit.torch_advance(st, K_, zero_v, L_, S, bb, None, ctx)
    return S


def projection_shard_apply(phi, S):
    """Phi S over the key axis (a shard map of projection_shard_map)."""
    torch, _ = torch_form()
    return torch.einsum("nhij,nhjv->nhiv", phi, S)


def torch_form():
    """(torch, mixc.classes.torch_ops) for the units' torch and context-parallel methods,
    imported on their first call, never at module level: derive imports the units, and `mixc
    check` / `explain` must not pay torch's import (~4 s)."""
    import torch                # lazy: torch only when a unit's torch form runs (see above)

    from . import torch_ops     # lazy: imports torch
    return torch, torch_ops

"""MixerLM: a small decoder language model over any stack of specs, and cached generation.

    ids -> embedding -> n_layers x [x + mixer(norm(x)); x + mlp(norm(x))] -> norm -> logits

There is no positional embedding: the recurrences are ordered by themselves, and the short
convolution of each layer gives attention layers the local order they need.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layer import MixerLayer


def layer_specs(spec: str, n_layers: int, attention_every: int | None = None,
                attention_spec: str = "attention") -> list[str]:
    """The specs of a stack: `spec` everywhere, or a Jamba-style hybrid with `attention_spec`
    as every attention_every-th layer (layers k-1, 2k-1, ...; k = 2 with 2 layers gives
    [spec, attention])."""
    if attention_every is None:
        return [spec] * n_layers
    if attention_every < 1:
        raise ValueError(f"attention_every: expected a positive int, got {attention_every}")
    return [attention_spec if (i + 1) % attention_every == 0 else spec for i in range(n_layers)]


class MLP(nn.Module):
    """SwiGLU feed-forward, hidden size a multiple of 8 near 8/3 * d_model * ratio / 4."""

    def __init__(self, d_model: int, ratio: float = 4.0):
        super().__init__()
        hidden = max(8, int(round(d_model * ratio * 2 / 3 / 8)) * 8)
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, -1)
        return self.down(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, spec, d_model: int, n_heads: int, mlp_ratio: float, layer_kwargs: dict):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-5)
        self.mixer = MixerLayer(spec, d_model, n_heads, **layer_kwargs)
        self.norm2 = nn.RMSNorm(d_model, eps=1e-5)
        self.mlp = MLP(d_model, mlp_ratio) if mlp_ratio > 0 else None

    def forward(self, x, state=None, use_cache=False):
        y, st = self.mixer(self.norm1(x), state, use_cache=use_cache)
        x = x + y
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x, st

    def step(self, x, state):
        y, st = self.mixer.step(self.norm1(x), state)
        x = x + y
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x, st


class MixerLM(nn.Module):
    """A decoder LM. specs: one spec for every layer (a name, a .mix path or a MixerOp) or a
    list, one per layer; attention_every=k makes every k-th layer `attention_spec` (a
    hybrid). layer_kwargs go to every MixerLayer (head_dims, conv_size, output_gate, ...);
    per_spec_kwargs={name: {...}} to the layers of one spec only. mode: the ops' mode.

    forward(ids [B, T], state=None, use_cache=False) -> (logits [B, T, vocab], state or None);
    step(ids [B], state) -> (logits [B, vocab], state); generate(...) decodes with the cache.
    The state is a list with one MixerLayer state per layer."""

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, specs="gla", *,
                 n_heads: int = 4, attention_every: int | None = None, attention_spec: str = "attention",
                 mlp_ratio: float = 4.0, mode: str = "auto", tie_embeddings: bool = True,
                 layer_kwargs: dict | None = None, per_spec_kwargs: dict | None = None):
        super().__init__()
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
            specs = layer_specs(specs, n_layers, attention_every, attention_spec)
        elif attention_every is not None:
            raise ValueError("attention_every: give one spec (not a list) to build a hybrid from")
        specs = list(specs)
        self.vocab_size, self.d_model = vocab_size, d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        blocks = []
        for s in specs:
            kw = dict(layer_kwargs or {}, mode=mode)
            name = s if isinstance(s, str) else getattr(s, "name", None)
            kw.update((per_spec_kwargs or {}).get(name, {}))
            blocks.append(Block(s, d_model, n_heads, mlp_ratio, kw))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init(len(specs))
        if tie_embeddings:
            self.head.weight = self.embed.weight

    @property
    def specs(self) -> list[str]:
        return [b.mixer.spec for b in self.blocks]

    def _init(self, n_layers: int) -> None:
        # GPT-2's scheme for the plain linears: N(0, 0.02), the residual outputs scaled by
        # 1/sqrt(2 n_layers). The mixers' input projections keep their own init (roles).
        nn.init.normal_(self.embed.weight, std=0.02)
        for b in self.blocks:
            nn.init.normal_(b.mixer.out_proj.weight, std=0.02 / (2 * n_layers) ** 0.5)
            if b.mlp is not None:
                nn.init.normal_(b.mlp.up.weight, std=0.02)
                nn.init.normal_(b.mlp.down.weight, std=0.02 / (2 * n_layers) ** 0.5)

    def forward(self, ids: torch.Tensor, state: list | None = None, use_cache: bool = False):
        h, state = self.trunk(self.embed(ids), state, use_cache)
        return self.head(h), state

    def step(self, ids: torch.Tensor, state: list | None = None):
        """One token per sequence: ids [B] -> (logits [B, vocab], state)."""
        h, state = self.trunk_step(self.embed(ids), state)
        return self.head(h), state

    def trunk(self, x: torch.Tensor, state: list | None = None, use_cache: bool = False):
        """The blocks and the final norm over embeddings x [B, T, d_model] -> (hidden [B, T, d_model],
        state or None): forward() without the embedding and the output projection (what
        mixc.integrations.hf_model's base model returns)."""
        new = []
        for i, b in enumerate(self.blocks):
            x, st = b(x, None if state is None else state[i], use_cache=use_cache)
            new.append(st)
        return self.norm(x), (new if use_cache else None)

    def trunk_step(self, x: torch.Tensor, state: list | None = None):
        """step() without the embedding and the output projection: x [B, d_model] -> (hidden
        [B, d_model], state)."""
        new = []
        for i, b in enumerate(self.blocks):
            x, st = b.step(x, None if state is None else state[i])
            new.append(st)
        return self.norm(x), new

    def state_size(self, state: list) -> int:
        """Floats per sequence in the mixers' states (for attention: its KV cache at that length)."""
        return sum(b.mixer.state_size(s) for b, s in zip(self.blocks, state))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 return_logits: bool = False):
        """Prefill the prompt ids [B, T0] with one forward, then decode token by token from
        each layer's state: ids [B, T0 + max_new_tokens] (and the logits of every new token,
        [B, max_new_tokens, vocab], with return_logits). temperature 0: greedy."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
        out, steps = [ids], []
        if max_new_tokens == 0:
            return (ids, ids.new_zeros(ids.shape[0], 0, self.vocab_size, dtype=torch.float)) if return_logits else ids
        logits, state = self(ids, use_cache=True)
        logits = logits[:, -1]
        for i in range(max_new_tokens):
            steps.append(logits)
            nxt = sample(logits, temperature, top_k, generator)
            out.append(nxt[:, None])
            if i + 1 < max_new_tokens:
                logits, state = self.step(nxt, state)
        ids = torch.cat(out, 1)
        return (ids, torch.stack(steps, 1)) if return_logits else ids


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k largest (all when None)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


def generate(model: MixerLM, ids: torch.Tensor, max_new_tokens: int, **kwargs):
    """mixc.nn.generate(model, ids, n): the same as model.generate(ids, n)."""
    return model.generate(ids, max_new_tokens, **kwargs)

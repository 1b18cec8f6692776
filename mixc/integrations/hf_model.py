"""mixc's language model as a Hugging Face transformers model: the Auto classes build, save, load
and generate a `MixerLM` over any spec (docs/integrations.md, "mixc's model in transformers").

    import mixc.integrations.hf_model           # registers model_type "mixc" with the Auto classes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixc", spec="gla", vocab_size=256, d_model=64, n_layers=2, n_heads=4)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained("out")                 # config.json (the spec as a name or as its text) + weights
    model = AutoModelForCausalLM.from_pretrained("out")
    ids = model.generate(prompt, max_new_tokens=16, do_sample=False)   # the states in a MixcCache

- `MixcConfig` (model_type "mixc") holds `MixerLM`'s arguments under their own names (`d_model`,
  `n_layers`, `n_heads`; transformers' `hidden_size`, `num_hidden_layers`, `num_attention_heads`
  read them) and the spec: a library name ('gla'), or a user spec's text (a `.mix` path given to
  the config is read and its text stored), or a list of those, one per layer. The text is data:
  mixc parses and compiles it as `mixc.load` does a `.mix` file; nothing in it runs as Python.
- `MixcForCausalLM` and `MixcModel` hold a `MixerLM` built from the config (`model.model`): the
  layers, their initialization and their state are `mixc.nn`'s, not a second implementation.
  The causal LM's prompt is `MixerLM.forward` with the cache, each decoded token `MixerLM.step`,
  as `MixerLM.generate` runs them, so greedy tokens and logits are the same.
- `MixcCache` (a `transformers.Cache`) keeps each block's `MixerLayer` state (the op's state dict
  and the short conv's last tokens; a KV cache for attention layers) in one `MixcLayerCache`
  per block, with the tokens seen. generate() gets it from the model's first forward (the model
  says it cannot use a `DynamicCache`, as transformers' RWKV and xLSTM do), or from the caller
  (`cache=MixcCache(config)`). Beam search and `num_return_sequences` reorder and repeat it along
  the batch; it cannot be cropped (assisted decoding is refused by transformers for that reason).

Registering is idempotent (`exist_ok=True`); mixc without transformers never imports this module.
"""
from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..dsl import library_names
from ..nn import MixerLM
from ..pipeline import from_text

MODEL_TYPE = "mixc"


def _spec_value(spec, what: str) -> str:
    """A spec as the config stores it: a library name, or a spec's text (a .mix path read now, so
    that the config carries the spec itself and loads anywhere)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what}: expected a library spec name, a spec's text or a .mix path, got {spec!r}")
    if "\n" in spec or spec in library_names():
        return spec
    if spec.endswith(".mix") and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    raise ValueError(f"{what}: {spec!r} is not a library spec ({', '.join(library_names())}), a spec's text "
                     "(several lines, starting with `mixer NAME`) or a .mix file")


class MixcConfig(PreTrainedConfig):
    """MixerLM's arguments (docs/nn.md) as a transformers config.

    spec: a library spec name, a spec's text, or a list of those with one per layer (a .mix path
    is read and its text stored). attention_every / attention_spec: a Jamba-style hybrid of one
    spec. layer_kwargs go to every MixerLayer (head_dims, options, conv_size, output_gate, norm,
    max_len, op_kwargs), per_spec_kwargs={spec name: {...}} to the layers of one spec. mode: the
    ops' mode ("auto": the Triton kernels on CUDA, the torch backend on a CPU)."""

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    spec: str | list[str] = "gla"
    n_heads: int = 4
    attention_every: int | None = None
    attention_spec: str = "attention"
    mlp_ratio: float = 4.0
    mode: str = "auto"
    layer_kwargs: dict | None = None
    per_spec_kwargs: dict | None = None
    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if isinstance(self.spec, (list, tuple)):
            if self.attention_every is not None:
                raise ValueError("attention_every: give one spec (not a list) to build a hybrid from")
            if len(self.spec) != self.n_layers:
                raise ValueError(f"spec: a list of {len(self.spec)} specs for n_layers={self.n_layers}; "
                                 "give one per layer")
            self.spec = [_spec_value(s, f"spec[{i}]") for i, s in enumerate(self.spec)]
        else:
            self.spec = _spec_value(self.spec, "spec")
        self.attention_spec = _spec_value(self.attention_spec, "attention_spec")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        super().__post_init__(**kwargs)


def _op_or_name(spec: str):
    """What MixerLM takes: a library name as it is, a spec's text compiled to its op."""
    return from_text(spec, "<MixcConfig spec>") if "\n" in spec else spec


def build_lm(config: MixcConfig) -> MixerLM:
    """The MixerLM a config describes (its own initialization: each spec's roles, GPT-2's scheme)."""
    spec = config.spec
    specs = [_op_or_name(s) for s in spec] if isinstance(spec, list) else _op_or_name(spec)
    return MixerLM(config.vocab_size, config.d_model, config.n_layers, specs, n_heads=config.n_heads,
                   attention_every=config.attention_every, attention_spec=_op_or_name(config.attention_spec),
                   mlp_ratio=config.mlp_ratio, mode=config.mode, tie_embeddings=config.tie_word_embeddings,
                   layer_kwargs=config.layer_kwargs, per_spec_kwargs=config.per_spec_kwargs)


# ---------------------------------------------------------------------------------------- cache

def _map(state, fn):
    """fn applied to every tensor of a (nested) layer state."""
    if isinstance(state, dict):
        return {k: _map(v, fn) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map(v, fn) for v in state)
    return fn(state) if torch.is_tensor(state) else state


class MixcLayerCache:
    """One block's state in a MixcCache: MixerLayer's state dict ({"mixer": the op's state,
    "conv": the short conv's last tokens}) and the number of tokens it has seen. Every tensor in
    it has the batch first (a recurrent state [B, H, ...], a KV cache [B, H, T, ...], its token
    counts [B], the conv's [B, C, kernel - 1]). Duck-typed as transformers' cache layers are
    (its DummyLayer too): the methods Cache calls on each layer."""

    is_compileable = False        # states are replaced, not written in place (no static addresses)
    is_croppable = False          # a recurrent state cannot be rolled back to an earlier token
    is_sliding = False
    supports_early_init = False

    def __init__(self):
        self.state: dict | None = None
        self.seen = 0

    def __repr__(self):
        return f"MixcLayerCache(seen={self.seen})"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def batch_size(self) -> int:
        leaves = []
        _map(self.state, leaves.append)
        return leaves[0].shape[0] if leaves else -1

    def set_state(self, state: dict, tokens: int) -> None:
        """The block's state after `tokens` more tokens."""
        self.state, self.seen = state, self.seen + tokens

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = _map(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _map(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = _map(self.state, lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("a MixcCache holds each layer's state after the last token only; it cannot be "
                                      "cropped to an earlier token")

    def offload(self) -> None:
        if self.state is not None:
            self.device = next(iter(_leaves(self.state))).device
            self.state = _map(self.state, lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.state is not None and getattr(self, "device", None) is not None:
            self.state = _map(self.state, lambda t: t.to(self.device, non_blocking=True))


def _leaves(state) -> list:
    out = []
    _map(state, out.append)
    return out


class MixcCache(Cache):
    """transformers' Cache for a mixc model: one MixcLayerCache per block (MixerLM's list of layer
    states). MixcCache(config) or MixcCache(num_layers=n); MixcForCausalLM makes one for a forward
    with use_cache and no cache, which is what generate() uses."""

    def __init__(self, config: MixcConfig | None = None, num_layers: int | None = None):
        if num_layers is None:
            if config is None:
                raise ValueError("MixcCache: give the model's config or num_layers")
            num_layers = config.n_layers
        super().__init__(layers=[MixcLayerCache() for _ in range(num_layers)])

    def states(self) -> list | None:
        """MixerLM's state (a list with one layer state per block), None before the first token."""
        if all(layer.state is None for layer in self.layers):
            return None
        return [layer.state for layer in self.layers]

    def update_states(self, states: list, tokens: int) -> None:
        """The blocks' states after `tokens` more tokens."""
        if len(states) != len(self.layers):
            raise ValueError(f"MixcCache: {len(states)} layer states for a cache of {len(self.layers)} layers")
        for layer, state in zip(self.layers, states):
            layer.set_state(state, tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (transformers 5.24's Cache counts attention layers only)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise NotImplementedError("a MixcCache holds MixerLayer states, which mixc's layers replace as a whole "
                                  "(update_states); it takes no key/value updates")


# ---------------------------------------------------------------------------------------- models

class MixcPreTrainedModel(PreTrainedModel):
    config_class = MixcConfig
    config: MixcConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # MixerLM ties its output projection to the embedding (config.tie_word_embeddings); the base
    # model keeps the projection too, so that it loads a causal LM's checkpoint either way
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """Nothing: MixerLM initializes its weights when it is built (each spec's parametrization
        from mixc.nn.roles, GPT-2's scheme for the linears), and transformers' generic init would
        overwrite the roles (e.g. Mamba-2's A_log and dt_bias, GLA's gate bias)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # the layers' states are MixerLayer's dicts (a recurrent state, a KV cache, a cache of past
        # inputs), kept in a MixcCache that the first forward makes; generate() must not make a
        # DynamicCache of key/value layers for it
        return False

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def _run(self, input_ids, inputs_embeds, attention_mask, cache, use_cache):
        """(final hidden states [B, T, d_model], the cache or None): a prompt (no state yet, or
        several tokens) through MixerLM.trunk, one token after a state through MixerLM.trunk_step,
        as MixerLM.generate runs them."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if cache is not None and not isinstance(cache, MixcCache):
            raise TypeError(f"cache: a mixc model keeps its layers' states in a MixcCache, got {type(cache).__name__} "
                            "(leave cache=None and generate() makes one, or pass MixcCache(model.config))")
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = MixcCache(self.config)
        state = cache.states() if cache is not None else None
        if attention_mask is not None and state is None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("attention_mask: a mixc model has no padding mask (its recurrences read every token); "
                             "give sequences of one length, or generate them one at a time")
        x = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if state is not None and x.shape[1] == 1:
            h, new = self.model.trunk_step(x[:, 0], state)
            h = h[:, None]
        else:
            h, new = self.model.trunk(x, state, use_cache=use_cache or state is not None)
        if cache is not None and new is not None:
            cache.update_states(new, x.shape[1])
        return h, (cache if use_cache else None)


class MixcModel(MixcPreTrainedModel):
    """The blocks and the final norm of a MixerLM: last_hidden_state [B, T, d_model]."""

    def __init__(self, config: MixcConfig):
        super().__init__(config)
        self.model = build_lm(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None, use_cache=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        if output_hidden_states:
            raise ValueError("output_hidden_states: a mixc model returns the last hidden state only")
        cache = kwargs.pop("past_key_values", None) if cache is None else cache     # transformers' old name
        h, cache = self._run(input_ids, inputs_embeds, attention_mask, cache, use_cache)
        out = BaseModelOutputWithPast(last_hidden_state=h, cache=cache)
        return out if return_dict is not False else out.to_tuple()


class MixcForCausalLM(MixcPreTrainedModel, GenerationMixin):
    """A MixerLM with transformers' causal-LM interface: logits, the shifted cross-entropy loss
    with labels, and generate() over a MixcCache."""

    def __init__(self, config: MixcConfig):
        super().__init__(config)
        self.model = build_lm(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, logits_to_keep=0, **kwargs):
        if output_hidden_states:
            raise ValueError("output_hidden_states: a mixc model returns the logits and the cache only")
        cache = kwargs.pop("past_key_values", None) if cache is None else cache     # transformers' old name
        h, cache = self._run(input_ids, inputs_embeds, attention_mask, cache, use_cache)
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.model.head(h)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()


def register() -> None:
    """model_type "mixc" with AutoConfig, AutoModel and AutoModelForCausalLM (done on import)."""
    AutoConfig.register(MODEL_TYPE, MixcConfig, exist_ok=True)
    AutoModel.register(MixcConfig, MixcModel, exist_ok=True)
    AutoModelForCausalLM.register(MixcConfig, MixcForCausalLM, exist_ok=True)


register()

__all__ = ["MixcConfig", "MixcCache", "MixcLayerCache", "MixcModel", "MixcForCausalLM", "MixcPreTrainedModel",
           "build_lm", "register"]

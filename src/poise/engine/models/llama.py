"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Reads top to bottom: block, model, weights. A step's tokens from all sequences are concatenated
into one ``(T, hidden)`` tensor so every projection is a single matrix product; only attention
looks at sequence boundaries, through ``AttentionMetadata`` (``attention.py``). The members of
the family differ only in switches of ``ModelConfig``: biases on q/k/v (Qwen2) or on every
attention projection (``attention_bias``), Qwen3's per-head RMSNorm of q and k, sliding windows
per layer, and the rotary settings.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from poise.engine.errors import ModelLoadError
from poise.engine.models.attention import Attention, AttentionMetadata
from poise.engine.models.config import ModelConfig
from poise.engine.models.int8_linear import Int8Linear
from poise.engine.models.layers import MLP, RMSNorm
from poise.engine.models.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        ropes: nn.ModuleList,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ropes, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # Hugging Face projection name -> (poise's fused parameter, which part of it).
    FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ropes = nn.ModuleList(
            RotaryEmbedding(spec, config.max_model_len) for spec in config.ropes
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def rope_length_dependent(self) -> bool:
        """Whether any layer's rotation depends on the sequence's length (dynamic, longrope)."""
        return any(rope.length_dependent for rope in self.ropes)

    def prefix_cache_salt(self, num_prompt_tokens: int, num_tokens: int) -> int | None:
        """The rotation a sequence's keys get, as a prefix-cache salt, where its length changes
        it; None where it does not (the common case: every request shares)."""
        variants = tuple(
            rope.spec.rotation_variant(num_prompt_tokens, num_tokens) for rope in self.ropes
        )
        return None if all(v is None for v in variants) else hash(variants)

    @property
    def recompute_past(self) -> int | None:
        """The length at which a sequence is computed again from its first token: Phi-3's
        generation does so when LongRoPE switches to its long factors (``rope.py``)."""
        for rope in self.ropes:
            if rope.spec.rope_type == "longrope":
                return rope.spec.original_max_position_embeddings
        return None

    def build_rope(self, device: torch.device) -> None:
        for rope in self.ropes:
            rope.build(device)

    def tie_weights(self) -> None:
        # An int8 head holds its own quantized copy of the embedding (``load_weights``).
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Logits, float32, for the tokens in ``meta.logits_indices``: (S, vocab)."""
        x = self.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, self.ropes, meta, k_cache, v_cache)
        x = self.norm(x[meta.logits_indices])
        return self.lm_head(x).float()

    # ----- weights -----
    def _fused_slices(self) -> dict[str, tuple[str, int, int]]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive; an
        ``Int8Linear``'s rows are quantized as they arrive (``int8_linear.py``)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        fused = self._fused_slices()
        tied = self.config.tie_word_embeddings
        tied_head: torch.Tensor | None = None
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and tied:
                tied_head = tensor  # kept only if it is not the embedding (below)
                continue
            parts = name.split(".")
            target, offset, size = name, None, None
            for i, part in enumerate(parts):
                if part in fused:
                    new, offset, size = fused[part]
                    target = ".".join([*parts[:i], new, *parts[i + 1 :]])
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in the model")
            dest = param.data if offset is None else param.data.narrow(0, offset, size)
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                    f"config's {tuple(dest.shape)}"
                )
            owner = modules.get(target.rpartition(".")[0])
            if isinstance(owner, Int8Linear) and target.endswith(".weight"):
                owner.load_rows(tensor, offset, size)
            else:
                dest.copy_(tensor)
            if name == "embed_tokens.weight" and tied and isinstance(self.lm_head, Int8Linear):
                self.lm_head.load_rows(tensor, None, None)
            loaded.add(name)
        embedding = self.embed_tokens.weight
        if tied_head is not None and not torch.equal(
            tied_head.to(embedding.device, embedding.dtype), embedding
        ):
            # transformers does not tie what the checkpoint stores apart: neither does poise.
            if tied_head.shape != embedding.shape:
                raise ModelLoadError(f"lm_head.weight has shape {tuple(tied_head.shape)}")
            if isinstance(self.lm_head, Int8Linear):
                self.lm_head.load_rows(tied_head, None, None)
            else:
                head = tied_head.to(embedding.device, embedding.dtype).clone()
                self.lm_head.weight = nn.Parameter(head)
        missing = [n for n in self.expected_hf_names() if n not in loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors: {shown}")

    def attention_hf_names(self, prefix: str) -> list[str]:
        c = self.config
        names = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(f"{prefix}{proj}.weight")
            if c.qkv_bias:
                names.append(f"{prefix}{proj}.bias")
        names.append(f"{prefix}o_proj.weight")
        if c.o_bias:
            names.append(f"{prefix}o_proj.bias")
        if c.qk_norm:
            names += [f"{prefix}q_norm.weight", f"{prefix}k_norm.weight"]
        return names

    def mlp_hf_names(self, prefix: str) -> list[str]:
        names = []
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{prefix}{proj}.weight")
            if self.config.mlp_bias:
                names.append(f"{prefix}{proj}.bias")
        return names

    def expected_hf_names(self) -> list[str]:
        """Every tensor a checkpoint must hold, without the ``model.`` prefix."""
        c = self.config
        names = ["embed_tokens.weight", "norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(c.num_layers):
            p = f"layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += self.attention_hf_names(p + "self_attn.")
            names += self.mlp_hf_names(p + "mlp.")
        return names

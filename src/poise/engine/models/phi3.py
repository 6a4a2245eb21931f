"""Phi-3 (``Phi3ForCausalLM``): the Llama decoder with q/k/v and gate/up already fused.

Its checkpoints store ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` in the very layout poise
fuses the Llama projections into (q, k, v rows; gate rows, then up rows), so they load as they
are. What else sets it apart lives in ``ModelConfig`` and ``rope.py``: a sliding window on every
layer, ``partial_rotary_factor``, and LongRoPE.
"""

from __future__ import annotations

from poise.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def attention_hf_names(self, prefix: str) -> list[str]:
        return [f"{prefix}qkv_proj.weight", f"{prefix}o_proj.weight"]

    def mlp_hf_names(self, prefix: str) -> list[str]:
        return [f"{prefix}gate_up_proj.weight", f"{prefix}down_proj.weight"]

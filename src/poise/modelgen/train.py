"""Training the demo model: a small Llama that has read Python's own documentation.

``make run`` serves a model made on the spot, because nothing may be downloaded. Random weights
answer with random tokens, and then a new user cannot tell a working stack from a broken one.
So the demo is trained here, on the CPU, for a few minutes. The text is the documentation
topics of the standard library's ``pydoc_data``, which every Python installation has.

The model is written out here in plain PyTorch, with Hugging Face Llama's parameter names and
rotary convention (its RMSNorm and half-rotation are the engine's own), so the saved
directory loads unchanged in poise and in transformers.
Training: next-token cross-entropy on random windows of the token stream, AdamW, a warm-up
then cosine decay paced by the time budget (not a step count, so the run ends on time), and
bfloat16 autocast. One fixed seed makes the data order and initial weights reproducible; the
number of steps is whatever the time budget allows, so a faster machine trains further.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from poise.engine.models.layers import RMSNorm
from poise.engine.models.rope import rotate_half
from poise.modelgen.corpus import pydoc_corpus
from poise.modelgen.make_model import (
    EOS,
    SIZES,
    ModelSize,
    model_config,
    save_weights,
    train_tokenizer,
    write_tokenizer_files,
)

# A few million parameters and a vocabulary of a few thousand: small enough to learn something
# in three CPU minutes, large enough to write recognizable English.
TRAINED = SIZES["demo"]


@dataclass(frozen=True, slots=True)
class TrainSettings:
    minutes: float = 3.0
    seq_len: int = 128
    # Small batches: in three minutes the number of updates matters more than their size
    # (measured: 1-minute runs reached a loss of 4.1 with 8 sequences a step, 5.1 with 32).
    batch: int = 8
    lr: float = 4e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    threads: int | None = None  # torch threads; None: torch's default


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim = (
            c["num_attention_heads"], c["num_key_value_heads"], hd,
        )  # fmt: skip
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TinyLlama(nn.Module):
    """Hugging Face Llama's structure and names (``model.*``, ``lm_head``), training only."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        hd = config["head_dim"]
        inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def _init(model: TinyLlama, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    layers = len(model.model.layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / math.sqrt(2 * layers)  # residual branches, as GPT-2 scales them
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def token_stream(tok: Any, docs: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc, add_special_tokens=False).ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def train_model(
    out_dir: str | Path, settings: TrainSettings | None = None, size: ModelSize = TRAINED,
    progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Train, save the Hugging Face directory and ``training.json``; return what it records."""
    s = settings or TrainSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    t_start = time.perf_counter()
    tok = train_tokenizer(size.vocab, s.seed)
    docs = pydoc_corpus()
    data = token_stream(tok, docs)
    config = model_config("llama", size, tok)
    model = TinyLlama(config)
    _init(model, s.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    keep = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": keep, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    budget = s.minutes * 60
    t0 = time.perf_counter()
    step, loss_ewma = 0, None
    losses: list[float] = []
    bar = tqdm(total=round(budget), unit="s", disable=not progress, desc="training",
               bar_format="{desc}: {n}/{total}s |{bar}| {postfix}")  # fmt: skip
    high = len(data) - s.seq_len - 1
    while (elapsed := time.perf_counter() - t0) < budget:
        # Warm-up (30 steps, or the first 5 % of the time if that is shorter), then cosine
        # decay to a tenth by the share of the time budget spent.
        frac = min(1.0, elapsed / budget)
        warm = min(1.0, max((step + 1) / s.warmup_steps, frac / 0.05))
        lr = s.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = [rng.randrange(high) for _ in range(s.batch)]
        window = torch.stack([data[i : i + s.seq_len + 1] for i in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        losses.append(value)
        loss_ewma = value if loss_ewma is None else 0.95 * loss_ewma + 0.05 * value
        bar.n = min(round(time.perf_counter() - t0), round(budget))
        bar.set_postfix_str(f"step {step}, loss {loss_ewma:.3f}", refresh=False)
        bar.refresh()
    bar.close()
    train_s = time.perf_counter() - t0
    weights = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_weights(weights, out, 1)
    write_tokenizer_files(tok, out, config)
    record = {
        "corpus": "pydoc_data.topics (the standard library's documentation topics)",
        "documents": len(docs),
        "tokens": len(data),
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": asdict(s),
        "steps": step,
        "tokens_seen": step * s.batch * s.seq_len,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "first_loss": round(losses[0], 4) if losses else None,
        # The mean of the last 20 steps: one batch's loss is noisy.
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4) if losses else None,
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2))
    return record

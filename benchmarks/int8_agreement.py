"""How often weight-only int8 picks the same greedy token as the unquantized model, step by step.

For each prompt (paragraphs of Python's own documentation, ``pydoc_data``, tokenized by the
model's tokenizer) the reference model (``--ref-dtype``, bfloat16 by default) generates
``--tokens`` greedy tokens. Then each compared model reads the prompt and that reference text in
one forward pass (teacher forcing), and a step agrees when its argmax at that position is the
reference's token. Teacher forcing keeps one early difference from making every later step
differ. Reported: the share of steps that agree, over all prompts, for int8 and for a control
(the unquantized reference scored the same way, which isolates the scoring path's rounding).

    python benchmarks/int8_agreement.py --model .cache/models/w3 [--ref-dtype float32] \
        [--prompts 16] [--prompt-tokens 128] [--tokens 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from poise import LLM, SamplingParams
from poise.engine.models.attention import AttentionMetadata, AttentionView, PrefillChunk
from poise.engine.models.checkpoint import load_tokenizer, open_checkpoint
from poise.engine.models.llama import LlamaForCausalLM
from poise.engine.models.loader import load_model
from poise.modelgen.corpus import pydoc_corpus


def all_logits(net: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, in one prefill over a scratch KV cache."""
    c, n = net.config, len(ids)
    dtype = net.embed_tokens.weight.dtype
    slots = torch.arange(n)
    chunk = PrefillChunk(0, n, slots, None)
    meta = AttentionMetadata(
        positions=slots, slot_mapping=slots, rope_lens=None, seq_lens=None,
        views={w: AttentionView([], [chunk]) for w in set(c.layer_windows)},
        block_size=16, decode_kernel=None, logits_indices=slots,
    )  # fmt: skip
    shape = (c.num_kv_heads, n, c.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(c.num_layers)]  # fmt: skip
    return net(torch.tensor(ids), meta, caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ref-dtype", default="bfloat16")
    parser.add_argument("--dtype", default=None, help="the int8 model's dtype (default: ref's)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    ckpt = open_checkpoint(args.model)
    tok = load_tokenizer(ckpt)
    texts = [t for t in pydoc_corpus() if len(t) > 2000][: args.prompts]
    if len(texts) < args.prompts:
        raise SystemExit(f"only {len(texts)} documentation topics are long enough")
    prompts = [tok.encode(t)[: args.prompt_tokens] for t in texts]
    # The reference's greedy text, from poise's engine (batched, over its paged KV cache).
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ref = LLM(args.model, dtype=args.ref_dtype)
    outs = [o.outputs[0].token_ids for o in ref.generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]  # fmt: skip
    del ref
    # The control: the reference model itself, scored the same way (one teacher-forced
    # prefill instead of the engine's decode steps). What it misses is the scoring path's own
    # rounding, not int8's.
    models = {
        f"control ({args.ref_dtype}, unquantized)": load_model(ckpt, args.ref_dtype),
        f"int8 ({args.dtype or args.ref_dtype} model)": load_model(
            ckpt, args.dtype or args.ref_dtype, quantization="int8"
        ),
    }
    for name, net in models.items():
        agree = total = 0
        with torch.inference_mode():
            for prompt, out in zip(prompts, outs, strict=True):
                logits = all_logits(net, prompt + out)[len(prompt) - 1 : -1]
                agree += int((logits.argmax(-1) == torch.tensor(out)).sum())
                total += len(out)
        print(
            f"{args.model.name}: {name} agrees with {args.ref_dtype} greedy on "
            f"{agree}/{total} = {agree / total:.1%} of steps",
            flush=True,
        )


if __name__ == "__main__":
    main()

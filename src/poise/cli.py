"""The ``poise`` command: ties the packages together; nothing below it parses arguments."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_PROMPTS = [
    "The for statement",
    "A function definition",
    "Exceptions are raised when",
    "The import system",
]


def _make_model(args: argparse.Namespace) -> int:
    from poise.modelgen.make_model import make_model

    t0 = time.perf_counter()
    out = make_model(args.dir, arch=args.arch, size=args.size, seed=args.seed, shards=args.shards)
    print(f"wrote {args.size} {args.arch} model to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from poise import LLM, SamplingParams
    from poise.engine.errors import EngineError

    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    generated = 0
    for out in outputs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(
            f"--- {out.prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]"
        )
        print(completion.text)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in "
        f"{elapsed:.2f}s: {generated / elapsed:.1f} output tokens/s, "
        f"{(prompt_tokens + generated) / elapsed:.1f} total tokens/s ({args.dtype})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from poise import __version__

    parser = argparse.ArgumentParser(prog="poise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"poise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a Hugging Face-format model with random weights")
    mm.add_argument("dir", type=Path)
    mm.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    mm.add_argument("--size", choices=["tiny", "small", "w0"], default="tiny")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--shards", type=int, default=1, help="split the weights into N files")
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="complete prompts offline and print the throughput")
    gen.add_argument("--model", required=True, type=Path, help="a local Hugging Face model dir")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--device", default=None, help="cpu (default), cuda or auto")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

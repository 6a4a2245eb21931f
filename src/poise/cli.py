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
    if args.train:
        from poise.modelgen.make_model import SIZES
        from poise.modelgen.train import TrainSettings, train_model

        if args.arch != "llama":
            raise SystemExit("error: --train makes a llama model")
        size = SIZES[args.size or "demo"]
        record = train_model(args.dir, TrainSettings(minutes=args.minutes, seed=args.seed), size)
        print(
            f"trained a {record['parameters'] / 1e6:.1f}M-parameter llama on "
            f"{record['tokens']} tokens of Python's documentation: {record['steps']} steps in "
            f"{record['train_seconds']:.0f}s, loss {record['final_loss']:.2f}; wrote {args.dir}"
        )
        return 0
    size_name = args.size or "tiny"
    out = make_model(args.dir, arch=args.arch, size=size_name, seed=args.seed, shards=args.shards)
    print(f"wrote {size_name} {args.arch} model to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from poise import LLM, SamplingParams
    from poise.engine.errors import EngineError

    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
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


def _serve(args: argparse.Namespace) -> int:
    from poise.config import ConfigError, ServerSettings, http_url, load_settings

    flags = {name: getattr(args, name, None) for name in ServerSettings.model_fields}
    flags["api_keys"] = args.api_key
    if args.no_admission_control:
        flags["admission_control"] = False
    if args.enable_fault_injection:
        flags["enable_fault_injection"] = True
    if args.engine_in_thread:
        flags["engine_process"] = False
    try:
        settings = load_settings(flags, args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from poise.engine.errors import ModelLoadError
    from poise.engine.models.checkpoint import check_checkpoint
    from poise.server.run import serve

    try:  # refuse what the checkpoint says and poise cannot run before listening at all
        check_checkpoint(settings.model, settings.generation_config)
    except ModelLoadError as exc:
        print(f"error: cannot serve {settings.model}: {exc}", file=sys.stderr)
        return 1
    print(
        f"poise: serving {settings.model_name} at {http_url(settings.host, settings.port)}",
        flush=True,
    )
    return serve(settings)


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a local Hugging Face model directory")
    p.add_argument("--config", help="a YAML file of settings (flags and POISE_* env win)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--api-key", action="append", help="accepted key (repeatable)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device")
    p.add_argument("--quantization", choices=["int8"], help="int8: weight-only int8 linear layers")
    p.add_argument("--kv-cache-memory-gib", type=float)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--step-time-budget-s",
        type=float,
        help="keep each engine step within this (default 0.08; 0: only the caps above)",
    )
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every answer the same bit for bit whatever else is in the batch (off by default: "
        "a long prompt alone prefills about 1.5x as slowly; the load fails where it cannot hold)",
    )
    p.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        help="auto: the model's generation_config.json sampling settings are request defaults",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        default=None,
        help="let chat requests bring a chat_template of their own (it runs on the server)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        help="how tool_choice auto reads calls in answers (default: from the chat template)",
    )
    p.add_argument("--engine-niceness", type=int, help="nice value added to engine threads")
    p.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the step loop in a thread of the HTTP process, not a process of its own",
    )
    p.add_argument("--max-waiting-requests", type=int)
    p.add_argument("--max-waiting-tokens", type=int)
    p.add_argument(
        "--queue-target-s",
        type=float,
        help="while more requests arrive than start or finish, refuse what is predicted to "
        "wait longer than this (default 0.5; 0: never for the wait alone); a burst that drains "
        "is served",
    )
    p.add_argument(
        "--burst-gap-s",
        type=float,
        help="requests arriving this close together, far faster than the server starts them, "
        "into a calm queue are a burst, served however long it makes the queue (default 0.1)",
    )
    p.add_argument(
        "--default-timeout-s",
        type=float,
        help="deadline of requests without one (default 600; 0: none)",
    )
    p.add_argument("--no-admission-control", action="store_true")
    p.add_argument("--watchdog-stall-s", type=float)
    p.add_argument("--probe-timeout-s", type=float)
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--enable-fault-injection", action="store_true")
    p.add_argument("--log-level")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    p.add_argument("--otlp-endpoint", help="send traces over OTLP/HTTP to this collector URL")


def _gateway(args: argparse.Namespace) -> int:
    from poise.config import ConfigError, http_url
    from poise.gateway.config import load_gateway_settings

    try:
        settings = load_gateway_settings(
            args.config,
            {
                "host": args.host,
                "port": args.port,
                "log_level": args.log_level,
                "log_format": args.log_format,
                "otlp_endpoint": args.otlp_endpoint,
            },
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from poise.gateway.run import serve_gateway

    print(f"poise: gateway at {http_url(settings.host, settings.port)}", flush=True)
    return serve_gateway(settings)


def _up(args: argparse.Namespace) -> int:
    from poise.config import read_config_file
    from poise.engine.errors import ModelLoadError
    from poise.engine.models.checkpoint import check_checkpoint
    from poise.launcher import up

    try:  # a checkpoint every replica would refuse is refused once, before anything starts
        flags = args.serve_flags.split()
        mode = "auto"
        for i, flag in enumerate(flags):
            if flag.startswith("--generation-config"):
                mode = flag.partition("=")[2] or (flags[i + 1] if i + 1 < len(flags) else mode)
        check_checkpoint(args.model, mode)
    except ModelLoadError as exc:
        print(f"error: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 1
    autoscale = None
    if args.autoscale:
        low, high = args.min_replicas, args.max_replicas
        if not 1 <= low <= high:
            raise SystemExit("error: want 1 <= --min-replicas <= --max-replicas")
        autoscale = (low, high)
    extra = read_config_file(args.gateway_config) if args.gateway_config else None
    serve_flags = args.serve_flags.split()
    if args.deterministic is not None:  # after --serve-flags: the named flag wins
        serve_flags.append("--deterministic" if args.deterministic else "--no-deterministic")
    return up(
        str(args.model),
        args.replicas,
        args.host,
        args.port,
        serve_flags,
        args.served_model_name,
        extra,
        autoscale,
    )


def build_parser() -> argparse.ArgumentParser:
    from poise import __version__

    parser = argparse.ArgumentParser(prog="poise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"poise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser(
        "make-model", help="write a Hugging Face-format model: random weights, or --train"
    )
    mm.add_argument("dir", type=Path)
    mm.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    mm.add_argument(
        "--size",
        choices=["tiny", "small", "w0", "w3", "demo"],
        help="tiny by default; demo (3.2M parameters) with --train",
    )
    mm.add_argument(
        "--train",
        action="store_true",
        help="train it on Python's own documentation (pydoc_data), on the CPU",
    )
    mm.add_argument("--minutes", type=float, default=3.0, help="with --train: the time budget")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--shards", type=int, default=1, help="split the weights into N files")
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="complete prompts offline and print the throughput")
    gen.add_argument("--model", required=True, type=Path, help="a local Hugging Face model dir")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    gen.add_argument("--device", default=None, help="cpu (default), cuda or auto")
    gen.add_argument("--quantization", choices=["int8"], help="weight-only int8 linear layers")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve one replica over OpenAI-compatible HTTP")
    _add_serve_flags(srv)
    srv.set_defaults(func=_serve)

    gw = sub.add_parser("gateway", help="one resilient front for many OpenAI-compatible backends")
    gw.add_argument("--config", required=True, help="the gateway's YAML file")
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
    gw.add_argument("--log-level")
    gw.add_argument("--log-format", choices=["auto", "json", "console"])
    gw.add_argument("--otlp-endpoint", help="send traces over OTLP/HTTP to this collector URL")
    gw.set_defaults(func=_gateway)

    u = sub.add_parser("up", help="N local replicas and a gateway in front, supervised")
    u.add_argument("--model", required=True, type=Path)
    u.add_argument("--replicas", type=int, default=2)
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--served-model-name", default="demo")
    u.add_argument("--serve-flags", default="", help="extra flags for each `poise serve`")
    u.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each replica's answers the same bit for bit whatever the batch (`poise serve`'s "
        "--deterministic; a stream continued after a replica fails then goes on exactly)",
    )
    u.add_argument(
        "--gateway-config",
        type=Path,
        help="a YAML of gateway settings (keys, limits, timeouts, autoscale) merged in",
    )
    u.add_argument(
        "--autoscale",
        action="store_true",
        help="start and drain replicas as the gateway's /autoscale advice moves",
    )
    u.add_argument("--min-replicas", type=int, default=1, help="with --autoscale")
    u.add_argument("--max-replicas", type=int, default=4, help="with --autoscale")
    u.set_defaults(func=_up)

    from poise.bench.command import add_parser as add_bench  # light: no engine, no torch

    add_bench(sub)
    from poise.chaos.command import add_parser as add_chaos  # light: no engine, no torch

    add_chaos(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

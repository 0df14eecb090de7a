"""The `hetero-infer` command.

    hetero-infer serve                      all three services on loopback (Ctrl-C stops them)
    hetero-infer gateway|scheduler|worker   one service (for containers)
    hetero-infer generate --input "..."     one completion, in-process
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hetero_infer.config import add_config_arguments, config_from_args
from hetero_infer.errors import HeteroError
from hetero_infer.log import configure_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero-infer", description="LLM serving over gRPC: gateway, scheduler, workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("serve", "run gateway, scheduler and worker as separate processes"),
                       ("gateway", "run the public gRPC gateway"), ("scheduler", "run the scheduler service"),
                       ("worker", "run one model worker")):
        service = sub.add_parser(name, help=text, description=text)
        add_config_arguments(service)
        if name == "worker":  # set per process by `serve` for tensor-parallel ranks; not configuration
            service.add_argument("--tp-rank", type=int, default=0, help="tensor-parallel rank of this process")
            service.add_argument("--tp-init-file", default=None, help="torch.distributed rendezvous file of the group")
    gen = sub.add_parser("generate", help="print one completion (in-process engine)")
    gen.add_argument("--input", required=True, help="the prompt")
    gen.add_argument("--max-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the input as plain text, not as a chat message")
    add_config_arguments(gen)
    return parser


def _generate(args: argparse.Namespace, config) -> int:
    from hetero_infer.engine import GenerationParams, InferenceEngine

    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    use_chat = not args.raw and bool(engine.tokenizer.chat_template)
    engine.submit_request(args.input, params, chat=use_chat)
    for result in engine.run():
        print(result.output_text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except HeteroError as exc:
        print(f"hetero-infer: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format, service=args.command)
    try:
        if args.command == "serve":
            from hetero_infer.supervisor import serve

            return serve(config)
        if args.command == "worker":
            from gpu_worker.service import serve_worker

            serve_worker(config, args.tp_rank, args.tp_init_file)
        elif args.command == "scheduler":
            from scheduler_svc.service import serve_scheduler

            asyncio.run(serve_scheduler(config))
        elif args.command == "gateway":
            from gateway.service import serve_gateway

            asyncio.run(serve_gateway(config))
        elif args.command == "generate":
            return _generate(args, config)
    except HeteroError as exc:
        print(f"hetero-infer {args.command}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `hetero-infer` command.

    hetero-infer serve                      all three services on loopback (Ctrl-C stops them)
    hetero-infer gateway|scheduler|worker   one service (for containers)
    hetero-infer generate --input "..."     one completion, in-process
    hetero-infer health ADDRESS             exit 0 when a service answers SERVING (container health checks)
    hetero-infer bench --url ...            load-test a running gateway (gRPC or HTTP)
    hetero-infer internal-certs --out DIR   a fresh CA + certificate for the internal mutual TLS
                                            (--kubernetes-secret: the Secret on stdout, for kubectl apply -f -)

The seed's own forms work too, without a subcommand: `hetero-infer --input "..." [--max-tokens
--temperature --top-p --config ...]` is `generate`, and `hetero-infer --serve [--config ...]` is
`serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hetero_common.errors import HeteroError
from hetero_common.log import configure_logging
from hetero_infer.config_sources import add_config_arguments, config_from_args
from hetero_infer.parent_death import die_with_parent

COMMANDS = ("serve", "gateway", "scheduler", "worker", "health", "bench", "generate", "internal-certs")


def seed_form(argv: list[str]) -> list[str]:
    """The seed's command lines as subcommands: `--serve ...` -> `serve ...`, `--input ...` -> `generate --input ...`.
    Anything that already names a subcommand (or asks for help) is left as it is."""
    if not argv or argv[0] in COMMANDS or argv[0] in ("-h", "--help"):
        return argv
    if "--serve" in argv:
        rest = [a for a in argv if a != "--serve"]
        return ["serve", *rest]
    if any(a == "--input" or a.startswith("--input=") for a in argv):
        return ["generate", *argv]
    return argv


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero-infer", description="LLM serving over gRPC: gateway, scheduler, workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("serve", "run gateway, scheduler and worker as separate processes"),
                       ("gateway", "run the public gRPC gateway"), ("scheduler", "run the scheduler service"),
                       ("worker", "run one model worker")):
        service = sub.add_parser(name, help=text, description=text)
        add_config_arguments(service)
        if name != "serve":  # set by `serve` on its children; not configuration
            service.add_argument("--supervisor-pid", type=int, default=None,
                                 help="exit (SIGTERM) when this process, the `serve` that started us, dies")
        if name == "worker":  # set per process by `serve` for tensor-parallel ranks; not configuration
            service.add_argument("--tp-rank", type=int, default=0, help="tensor-parallel rank of this process")
            service.add_argument("--tp-init-file", default=None, help="torch.distributed rendezvous file of the group")
            service.add_argument("--local-rank", type=int, default=None,
                                 help="this process's place among the host's workers, which picks its GPU (config "
                                      "devices); serve sets it; default: --tp-rank")
    health = sub.add_parser("health", help="check a service's grpc.health.v1 status (exit 0 = SERVING)")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds")
    health.add_argument("--tls-ca", help="CA file to trust (TLS on)")
    health.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    health.add_argument("--tls-key", help="client key (mutual TLS)")
    from hetero_infer.bench.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="load-test a running gateway; print and save latency figures"))
    gen = sub.add_parser("generate", help="print one completion (in-process engine)")
    gen.add_argument("--input", required=True, help="the prompt")
    gen.add_argument("--max-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the input as plain text, not as a chat message")
    add_config_arguments(gen)
    from hetero_infer.internal_certs import add_arguments as add_internal_certs_arguments

    add_internal_certs_arguments(sub.add_parser(
        "internal-certs", help="make a fresh CA and certificate for the internal links' mutual TLS (files or a Secret)"))
    return parser


def _generate(args: argparse.Namespace, config) -> int:
    if config.serving.backend.kind == "command_bridge":
        return _generate_through_bridge(args, config)
    from hetero_infer.engine import GenerationParams, InferenceEngine

    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    use_chat = not args.raw and bool(engine.tokenizer.chat_template)
    engine.submit_request(args.input, params, chat=use_chat)
    for result in engine.run():
        print(result.output_text)
    return 0


def _generate_through_bridge(args: argparse.Namespace, config) -> int:
    """serving.backend.kind command_bridge: the program answers (the prompt in HETERO_PROMPT, as typed); no model
    is loaded. Its output is printed as it streams."""
    from gateway.backends.command_bridge import CommandBridge
    from hetero.v1 import common_pb2
    from hetero_common.sampling import resolve

    sampling = resolve(common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                 top_p=args.top_p, top_k=args.top_k, seed=args.seed))
    bridge = CommandBridge(config.serving.backend)

    async def answer() -> None:
        async for chunk in bridge.stream("generate-1", args.input, sampling, config.serving.model_name):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

    asyncio.run(answer())
    print()
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hetero_common.config import TLSConfig
    from hetero_common.grpc_server import channel_credentials

    tls = TLSConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca)
    creds = channel_credentials(tls, mutual=True) if args.tls_cert else (
        grpc.ssl_channel_credentials(open(args.tls_ca, "rb").read()) if args.tls_ca else None)
    channel = grpc.secure_channel(args.address, creds) if creds else grpc.insecure_channel(args.address)
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                               timeout=args.timeout).status
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(seed_form(list(sys.argv[1:] if argv is None else argv)))
    if args.command == "health":
        return _health(args)
    if args.command == "internal-certs":
        from hetero_infer.internal_certs import run as internal_certs

        return internal_certs(args)
    if args.command == "bench":
        from hetero_infer.bench.cli import run_bench

        return run_bench(args)
    try:
        config = config_from_args(args)
    except HeteroError as exc:
        print(f"hetero-infer: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format, service=args.command)
    if getattr(args, "supervisor_pid", None) is not None:
        from hetero_infer.supervisor import stop_grace_s

        # `serve` gone, this service exits within the time `serve` would have given it to stop.
        if not die_with_parent(args.supervisor_pid, stop_grace_s(config)):
            return 1  # `serve` is already gone: nothing to serve for
    try:
        if config.tokenizer.kind == "simple" and args.command in ("serve", "gateway", "generate"):
            # Refuse a model the simple tokenizer does not match now, before any model loads or process starts.
            from gateway.server import load_gateway_tokenizer

            load_gateway_tokenizer(config)
        if args.command == "serve":
            from gateway.auth import ApiKeys, check_exposure
            from hetero_infer.supervisor import serve

            check_exposure(config, ApiKeys.from_config(config))  # before any process starts (not restarted in a loop)
            return serve(config)
        if args.command == "worker":
            from gpu_worker.service import serve_worker

            serve_worker(config, args.tp_rank, args.tp_init_file, args.local_rank)
        elif args.command == "scheduler":
            from scheduler_svc.service import serve_scheduler

            asyncio.run(serve_scheduler(config))
        elif args.command == "gateway":
            from gateway.server import serve_gateway

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

"""A client built only from protos/: stubs are generated into a temp dir at start-up.

    python examples/python_client.py [--address 127.0.0.1:50051] [--raw] "What is the capital of France?"

Sends the prompt as a chat message (the model's chat template is applied by the server);
--raw sends it as plain text instead. Prints the text as it streams, then the usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "protos"


def load_stubs(out_dir: str):
    from grpc_tools import protoc

    files = [str(p.relative_to(PROTOS)) for p in sorted((PROTOS / "hetero" / "v1").glob("*.proto"))]
    if protoc.main(["protoc", f"-I{PROTOS}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *files]) != 0:
        raise SystemExit("protoc failed")
    sys.path.insert(0, out_dir)
    from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402  (generated just now)

    return common_pb2, inference_pb2, inference_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--raw", action="store_true", help="plain-text prompt instead of a chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ca", help="CA file when the gateway serves TLS")
    args = parser.parse_args()

    import grpc

    with tempfile.TemporaryDirectory() as tmp:
        common_pb2, inference_pb2, inference_pb2_grpc = load_stubs(tmp)
        request = inference_pb2.GenerateRequest(
            params=common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        if args.raw:
            request.prompt = args.prompt
        else:
            request.chat.messages.add(role="user", content=args.prompt)
        # HETERO_API_KEY, when set, goes in the `authorization` metadata (gateways with API keys on).
        key = os.environ.get("HETERO_API_KEY")
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        channel = (grpc.secure_channel(args.address, grpc.ssl_channel_credentials(open(args.ca, "rb").read()))
                   if args.ca else grpc.insecure_channel(args.address))
        with channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for message in stub.Generate(request, timeout=300, metadata=metadata):
                print(message.text, end="", flush=True)
                if message.finish_reason:
                    reason = common_pb2.FinishReason.Name(message.finish_reason)
                    print(f"\n[{reason}; prompt {message.usage.prompt_tokens} tokens, "
                          f"completion {message.usage.completion_tokens} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

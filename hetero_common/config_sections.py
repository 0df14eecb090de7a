"""The configuration's sections: the nested objects under `Config` (`serving`, its `backend` and
`tls`, `tokenizer`, `internal_tls`), and `doc`, how every field carries its meaning (read by
`python -m hetero_infer.config_doc`). Their validation is `Config.validate`'s (config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


def doc(meaning: str, group: str = "") -> dict[str, str]:
    """A field's documentation: its one-line meaning and, on the first key of a group of
    top-level keys, the group's title (nested sections are titled by their own field's doc)."""
    return {"doc": meaning, "group": group} if group else {"doc": meaning}


@dataclass
class CommandConfig:
    """An external program for the command bridge backend; the prompt goes in HETERO_PROMPT."""

    program: str = ""
    args: list[str] = field(default_factory=list)


@dataclass
class BackendConfig:
    kind: str = field(default="scheduler", metadata=doc(
        "`scheduler` (alias `local_engine`, the seed's name): the paged engine behind the scheduler service; "
        "`command_bridge`: every request answered by `command`"))
    command: CommandConfig | None = field(default=None, metadata=doc(
        "the command bridge's program, run per request as an argv list (never a shell string) with the prompt in "
        '`HETERO_PROMPT`: `{"program": ..., "args": [...]}`, JSON in env and flags'))
    fallback: str = field(default="none", metadata=doc(
        "`command_bridge`: answer with `command` when the scheduler stays unreachable after retries; `none`: fail"))
    command_timeout_s: float = field(default=60.0, metadata=doc(
        "the bridge program is killed after this many seconds; the client gets `DEADLINE_EXCEEDED`"))
    command_max_output_bytes: int = field(default=1_000_000, metadata=doc(
        "stdout beyond this is cut (finish reason `LENGTH`) and the program killed"))
    command_max_concurrent: int = field(default=16, metadata=doc(
        "bridge programs running at once; a request beyond it waits for one to end (a many-prompt request "
        "cannot start a process per prompt)"))
    command_env: list[str] = field(default_factory=lambda: ["PATH", "LANG", "LC_ALL", "TZ"], metadata=doc(
        "the gateway's environment variables the program inherits, by name (an allow-list; the `HETERO_*` request "
        "variables are always set, and nothing else of the gateway's environment, its keys included, is passed)"))


@dataclass
class TLSConfig:
    """PEM files. Public ports: cert_file + key_file (ca_file: what `serve` trusts for its
    readiness check). Internal links: all three, for mutual TLS (each side presents a
    certificate signed by ca_file and requires one from the other)."""

    cert_file: str | None = field(default=None, metadata=doc("the PEM certificate this side presents"))
    key_file: str | None = field(default=None, metadata=doc("its PEM private key"))
    ca_file: str | None = field(default=None, metadata=doc(
        "a PEM CA certificate: on the public ports, the one `serve` trusts for its readiness check (default: the "
        "certificate itself); on the internal links, the CA that both sides' certificates must be signed by"))

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass
class EmbeddingConfig:
    """Embedding requests (`Embed`, `/v1/embeddings`; docs/embeddings.md)."""

    pooling: str = field(default="auto", metadata=doc(
        "how a request that names none pools the final norm's hidden states: `last`, `mean` or `cls`; `auto` = the "
        "model directory's sentence-transformers config (`modules.json`, `1_Pooling/config.json`) when it has one, "
        "else `last` (decoder embedding models: e5-mistral, gte-Qwen2)"))
    max_inputs: int = field(default=2048, metadata=doc(
        "inputs one embedding request may carry (OpenAI's limit); more are refused with `INVALID_ARGUMENT` / 400"))


@dataclass
class ServingConfig:
    """The gateway's public surface: its ports, the model name it answers to, its backend, who may call it."""

    host: str = field(default="127.0.0.1", metadata=doc("the gateway's bind address"))
    port: int = field(default=50051, metadata=doc("the gateway's public gRPC port"))
    model_name: str = field(default="SmolLM2-135M-Instruct", metadata=doc("the model name clients send as `model`"))
    backend: BackendConfig = field(default_factory=BackendConfig, metadata=doc("what answers the gateway's requests"))
    http_port: int = field(default=8000, metadata=doc("the OpenAI-compatible HTTP API on the gateway; 0 disables it"))
    api_keys: list[str] = field(default_factory=list, metadata=doc(
        "accepted `Authorization: Bearer` keys (a JSON list, or comma-separated); empty = no authentication"))
    api_keys_file: str | None = field(default=None, metadata=doc(
        "a file of keys, one per line (`#` starts a comment), added to `serving.api_keys`; a file with no key "
        "stops start-up (a mis-mounted Secret must not turn authentication off)"))
    admin_api_keys: list[str] = field(default_factory=list, metadata=doc(
        "keys that may also load, unload and replace LoRA adapters, see their paths, and abort any tenant's "
        "requests (docs/security.md); an admin key also serves requests, as its own tenant"))
    admin_api_keys_file: str | None = field(default=None, metadata=doc(
        "a file of admin keys, one per line, added to `serving.admin_api_keys`; a file with no key stops start-up"))
    allow_unauthenticated: bool = field(default=False, metadata=doc(
        "serve with no API keys on a non-loopback `serving.host` (every caller then acts as an admin); without "
        "it, a gateway with no keys refuses to start unless it listens on a loopback address"))
    max_prompts_per_request: int = field(default=128, metadata=doc(
        "prompts one `/v1/completions` request may carry (a list of strings or of token lists); more are refused "
        "with 400 naming `prompt`. They run a window at a time, as embedding inputs do"))
    tls: TLSConfig = field(default_factory=TLSConfig, metadata=doc("TLS on the public gRPC and HTTP ports"))
    max_concurrent_requests: int = field(default=0, metadata=doc(
        "generations in flight at the gateway (gRPC and HTTP); more are refused with `RESOURCE_EXHAUSTED` / "
        "HTTP 429; 0 = no limit"))
    stream_interval: int = field(default=1, metadata=doc(
        "streaming from the scheduler backend: a sample's first token goes out at once, later ones in messages of "
        "at least this many tokens; 1 = each token as it comes (vLLM's and SGLang's `stream_interval`)"))
    # Limits on what one client may send or hold (docs/api.md, "Limits").
    max_request_bytes: int = field(default=4 * 1024 * 1024, metadata=doc(
        "largest request body (HTTP) or message (gRPC) in bytes; HTTP answers 413 (checked on `Content-Length` before "
        "reading, and as a chunked body arrives), gRPC `RESOURCE_EXHAUSTED`. 4 MiB holds a 128k-token prompt of text "
        "(about 4 bytes a token, more when JSON escapes it) or of token ids (about 7 bytes each in JSON); nginx caps "
        "bodies at 1 MiB, most API gateways at 1-10 MiB"))
    max_connections: int = field(default=1000, metadata=doc(
        "open connections on each public port (HTTP, gRPC); HTTP answers a connection beyond it 429 with "
        "`Retry-After` and closes it, gRPC closes it at accept; 0 = no limit"))
    http_keep_alive_timeout_s: float = field(default=15.0, metadata=doc(
        "an idle HTTP keep-alive connection is closed after this long; behind a load balancer, set it above the "
        "balancer's idle timeout"))
    http_header_timeout_s: float = field(default=10.0, metadata=doc(
        "a request's line and headers must arrive within this long of the connection opening (or of the request's "
        "first byte on a kept-alive one), else the connection is closed (slow-header clients); also gRPC's "
        "connection handshake timeout"))
    http_body_timeout_s: float = field(default=60.0, metadata=doc(
        "a request's whole body must arrive within this long of its headers, else 408 and the connection is closed "
        "(slow-body clients)"))
    grpc_idle_timeout_s: float = field(default=300.0, metadata=doc(
        "a gRPC connection with no call open this long is closed (GOAWAY; a client reconnects on its next call)"))
    grpc_max_concurrent_streams: int = field(default=100, metadata=doc(
        "calls open at once on one gRPC connection (HTTP/2 `MAX_CONCURRENT_STREAMS`); a client queues more itself"))
    metrics_require_key: bool = field(default=False, metadata=doc(
        "`/metrics` needs an API key (401 without one) when `serving.api_keys` are set; false keeps it open for "
        "Prometheus (keep the port private then). `/healthz` and `/readyz` stay open"))
    tokenizer_workers: int = field(default=2, metadata=doc(
        "threads that tokenize and render chats of large inputs (over 8192 characters; smaller ones are done "
        "inline), off the event loop, so that a large request delays only itself"))
    tokenizer_queue: int = field(default=16, metadata=doc(
        "large inputs that may wait for a tokenizer thread; more are refused with `RESOURCE_EXHAUSTED` / HTTP 429 "
        "(bounds the text held waiting)"))
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig, metadata=doc("embedding requests"))


@dataclass
class TokenizerConfig:
    kind: str = field(default="auto", metadata=doc(
        "`auto`: the model's own (tokenizer.json next to the weights, or the GGUF's); `huggingface`; `gguf`; "
        "`simple`: the built-in byte-level tokenizer (the seed's SimpleTokenizer)"))
    path: str | None = field(default=None, metadata=doc(
        "a tokenizer.json, a directory holding one, or a .gguf file; null = the model's (and always with `simple`)"))

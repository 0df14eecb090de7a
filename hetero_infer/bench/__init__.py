"""`hetero-infer bench`: load-test a running gateway over gRPC or the OpenAI HTTP API; and harness.py, what
the benchmarks in benchmarks/ start and build (a real `serve` stack, prompts, tiny models)."""

"""`hetero-infer bench`: load-test a running gateway over gRPC or the OpenAI HTTP API."""

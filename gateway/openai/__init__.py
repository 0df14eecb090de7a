"""The OpenAI-compatible HTTP API (FastAPI): routes, request bodies, their translation to the
gRPC messages every generation goes through, and the HTTP-only response shapes.

What both APIs share (validation, tool calls, generation) stays in `gateway/`; nothing there
imports this package. Kept free of imports: `from gateway.openai import x` loads only `x`.
"""

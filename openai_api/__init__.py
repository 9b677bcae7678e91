"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), served by `specpool serve` next to gRPC, in front of
the same Router: /v1/completions, /v1/chat/completions, /v1/models, /health."""

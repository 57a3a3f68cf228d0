"""The embedded engine server: a `transformers` model behind SGLang's native HTTP API (and OpenAI chat).

Layers, bottom up: `model` (load, forward, weight loading), `kv` (the batch KV cache), `sampling` (validated
per-request sampling), `scheduler` (the continuous-batching decode loop on its own thread), `core` (the engine's
operations with SGLang's semantics and messages; `LocalEngine` drives it in-process), `protocol` (request and
response JSON), `http` + `openai_api` (the aiohttp server), `weights` (the distributed weight receive path).
"""

"""The embedded engine server: a `transformers` model behind SGLang's native HTTP API (and OpenAI chat).

Layers, bottom up: `model` (load, forward, weight loading), `kv` (the running batch's KV cache), `prefix` (KV
reuse across turns), `prefill` (batched prefill), `sampling` (validated per-request sampling), `scheduler` (the
continuous-batching loop on its own thread), `weights` (the distributed weight receive), `core` (the engine's
operations with SGLang's semantics and messages), `local` (`LocalEngine`, in-process), `protocol` (`/generate`
JSON), `http` + `openai_api` (the aiohttp server). See docs/engine.md.
"""

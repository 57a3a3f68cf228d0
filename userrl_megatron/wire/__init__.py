"""The wire types both sides of an engine call read: the flat bucket layout (`bucket`), the tensor-handle codec
(`handles`) and the payload formats (`embedded_payload`, `sglang_payload`, `receive`), the process-group helpers
(`group`), the bearer-token check (`bearer`) and the result of a generate call (`generation`).

A low package: it imports only the standard library, torch, numpy and other low packages, never `server/`,
`sync/` or `fleet/`, which stand beside each other on it (docs/architecture.md).
"""

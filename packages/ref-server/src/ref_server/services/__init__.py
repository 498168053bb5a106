"""The gRPC deployment: router, prefill and decode instances, KV transfer. docs/ref-server.md."""

"""Tandem's shared torch engine: HF checkpoints on a paged KV cache with continuous batching.

The engine knows nothing about gRPC, Ray or Kubernetes. Workers wrap it; the router imports only
:mod:`engine.block_hash` (and the tokenizer) so that it computes block hashes exactly as the workers do.
"""

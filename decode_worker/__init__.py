"""Decode role: reserves blocks, receives prompt KV from prefill workers, and decodes with continuous batching."""

"""Prefill role: computes prompts and streams their KV, layer by layer, into decode workers' reserved blocks."""

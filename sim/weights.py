"""The weights a token's forward multiplies by, counted from ``config.json`` alone: the shape half of the roofline.

The simulator's step model (``roofline.py``) charges a step FLOPs and bytes from these counts; ``tandem bench
throughput``'s ceilings (``bench/ceilings.py``) use the same counts for its floors, so both read one definition.
"""

from __future__ import annotations

from engine.model_config import ModelConfig


def layer_shapes(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matmul one token goes through in ``layer`` (the active experts only)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q)]
    if cfg.is_moe_layer(layer):
        assert cfg.moe is not None
        shapes.append((cfg.moe.num_experts, h))  # the router
        shapes += [(2 * cfg.moe.intermediate_size, h), (h, cfg.moe.intermediate_size)] * cfg.moe.top_k
    else:
        shapes += [(2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return shapes


def weights_per_token(cfg: ModelConfig) -> int:
    """Weight elements one token's forward multiplies by: every layer's projections (active experts only) and the
    LM head. Also the elements a single-sequence decode step must read (the embedding row is one row)."""
    layers = sum(o * i for layer in range(cfg.num_layers) for o, i in layer_shapes(cfg, layer))
    return layers + cfg.vocab_size * cfg.hidden_size

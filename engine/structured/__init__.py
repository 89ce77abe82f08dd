"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by llguidance and applied as a
token bitmask in the sampler."""

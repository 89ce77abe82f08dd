"""Speculative decoding: proposers guess the next K tokens, one batched forward verifies them (``decoder.py``)."""

"""Tandem's built-in default model: deterministic random-weight checkpoints in Hugging Face format.

A tool, not part of serving: the CLI (``tandem up`` with no ``--model``, ``tandem model tiny``), the benches and the
tests write a checkpoint here and then load it like any hub model. The engine never imports this package, so the
serving path cannot depend on how the test model was made. It imports nothing else of Tandem.

- :mod:`tinymodel.checkpoint`: the per-architecture configs, tensors and tokenizer, and the directory writer.
- :mod:`tinymodel.corpus`: the generated text the tokenizer is trained on.
"""

"""Quantized weights: the checkpoint formats Tandem reads and writes, and the weight-only matmuls that run them.

- :mod:`engine.quant.scheme`: what a checkpoint's ``quantization_config`` says (compressed-tensors, GPTQ, AWQ, FP8),
  refusing any scheme this engine does not run with an error naming it;
- :mod:`engine.quant.weights`: one canonical form of a quantized matrix (signed integers, per-group scales and
  zero points) that every format unpacks into;
- :mod:`engine.quant.formats`: unpacking (and, for tests and the quantizer, packing) compressed-tensors, GPTQ and AWQ
  tensors;
- :mod:`engine.quant.reader`: a quantized checkpoint's tensors as the dense weights the model loader takes, plus the
  integers behind them;
- :mod:`engine.quant.kernels`: the CPU weight-only matmuls (torch's INT8 and INT4 packed kernels);
- :mod:`engine.quant.attach`: fusing the per-projection integers into the model's packed matrices and attaching the
  kernels to them;
- :mod:`engine.quant.quantize`: ``tandem model quantize``, an HF checkpoint written as a compressed-tensors one.
"""

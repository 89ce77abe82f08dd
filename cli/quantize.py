"""``tandem model quantize IN OUT --scheme w8a16|w4a16 [--group-size N] [--format ...]``: write a quantized copy of
an HF checkpoint (:mod:`engine.quant.quantize`). The parser imports nothing heavy; the run imports torch and
compressed-tensors. An unsupported scheme, group size or format exits 2 with an error naming it."""

from __future__ import annotations

import argparse
import sys


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("in_dir", help="HF checkpoint directory")
    p.add_argument("out_dir", help="where the quantized checkpoint is written (absent or empty)")
    # not `choices`: an unknown scheme is refused by engine.quant.scheme, naming it and the supported ones
    p.add_argument("--scheme", required=True, help="w8a16 (INT8 per output channel) or w4a16 (INT4 grouped)")
    p.add_argument("--group-size", type=int, default=None,
                   help="inputs per scale (default: per channel for w8a16, 128 for w4a16)")
    p.add_argument("--format", default="compressed-tensors", dest="out_format",
                   help="compressed-tensors (default), gptq or awq (w4a16 only)")


def run_quantize(args: argparse.Namespace) -> int:
    from engine.quant.scheme import cli_scheme

    try:
        cli_scheme(args.scheme, args.group_size)  # refused before torch and compressed-tensors are imported
        from engine.quant.quantize import quantize_checkpoint

        out = quantize_checkpoint(args.in_dir, args.out_dir, args.scheme, args.group_size, args.out_format)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"tandem model quantize: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

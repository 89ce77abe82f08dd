"""Benchmarks. Each runs Tandem and its peers side by side in one invocation and reports ratios."""

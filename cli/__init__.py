"""The ``tandem`` command line: a thin front over the components (engine, bench, workers, control plane)."""

"""Grammar masks computed while the forward pass runs.

Per step, with constrained requests in the batch::

    ModelRunner.execute: prepare ──► Sampler.prefetch(rows) ──► forward ──► logits ──► Sampler(rows)
                                         │ MaskBatch.start                                   │ take(): MaskBatch.finish
                                         ▼                                                   ▼
                           native masks thread (llg_masks.c): rows one by one ──► the engine's thread takes the rows
                           through llguidance's C API, no GIL                     not begun, waits for the rest

Every matcher has consumed the previous step's token before the step starts (the engine advances them as it accepts
tokens), and nothing touches a matcher between ``prefetch`` and the sampler, so the masks are exactly those an
inline fill computes: outputs do not change.

The engine never waits for the thread to *start*: the two threads claim rows through one counter, so rows the
thread has not begun when the sampler needs them are filled by the sampler's thread, as without a worker. Since the
matchers are llguidance's C objects (:mod:`engine.structured.native`), neither side takes the GIL for the fill: the
engine's thread pays one ctypes call to start and one to finish. (A Python thread calling llguidance's Python API,
which this replaced, paid two GIL hand-offs a step, about what the fill it hid cost on a 2-CPU host.)
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.structured.bitmask import MaskBatch, MaskBuffers
from engine.structured.native import MaskFiller, NativeMatcher


class MaskPrefetch:
    def __init__(self, filler: MaskFiller, buffers: MaskBuffers) -> None:
        self._filler = filler
        self._buffers = buffers
        self._batch: MaskBatch | None = None
        self.prefetched = 0  # steps whose masks were started on the worker

    def start(self, matchers: Sequence[NativeMatcher | None], vocab_size: int, width: int) -> None:
        """Begin filling the masks of a step whose rows have ``matchers`` (None: unconstrained row)."""
        self.settle()
        batch = MaskBatch(self._filler, matchers, vocab_size, width, self._buffers)
        batch.start()
        self._batch = batch
        self.prefetched += 1

    def take(self, matchers: Sequence[NativeMatcher | None], width: int) -> MaskBatch | None:
        """The started step's masks, complete, if they are for these rows; None if no step was started for them."""
        batch = self._batch
        self._batch = None
        if batch is None:
            return None
        batch.finish()
        if batch.width != width or len(batch.matchers) != len(matchers) or any(
                a is not b for a, b in zip(batch.matchers, matchers, strict=True)):
            return None
        return batch

    def settle(self) -> None:
        """Complete a started fill that no sampler took (a forward pass that raised)."""
        batch = self._batch
        self._batch = None
        if batch is not None:
            batch.finish()

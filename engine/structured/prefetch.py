"""Grammar masks computed while the forward pass runs.

Per step, with constrained requests in the batch::

    ModelRunner.execute: prepare ──► Sampler.prefetch(rows) ──► forward ──► logits ──► Sampler(rows)
                                         │ submit MaskBatch.fill                           │ take(): the filled masks
                                         ▼                                                  ▼
                           masks worker thread: llguidance (GIL released) ──► done (or not yet started:
                                                                           the sampler fills inline)

Every matcher has consumed the previous step's token before the step starts (the engine advances them as it accepts
tokens), and nothing touches a matcher between ``prefetch`` and the sampler, so the masks are exactly those an
inline fill would compute: outputs do not change. llguidance holds each matcher borrowed while it fills, so a
misuse would raise, not race.

The worker never makes the engine wait for it to *start*: if the fill has not begun when the sampler needs it (a
busy host whose spare CPU went elsewhere), the job is cancelled and the sampler fills inline, as without a worker;
only a fill already running is waited for. So on an idle core the masks cost the step nothing. The thread still
costs two GIL hand-offs a step (it takes the GIL to call llguidance and again when the fill returns), each an OS
wake-up of the other thread: on a host of two CPUs, shared and busy, those cost more than the 32-row fill they hide
(``tandem bench structured`` times both ways), so the sampler fills inline there (``Sampler.mask_overlap``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg

from engine.structured.bitmask import MaskBatch, MaskBuffers


class MaskPrefetch:
    def __init__(self, executor: llg.LLExecutor, buffers: MaskBuffers) -> None:
        self._executor = executor
        self._buffers = buffers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-masks")
        self._batch: MaskBatch | None = None
        self._job: Future[None] | None = None
        self.prefetched = self.inline = 0  # steps whose masks were ready from the worker / filled by the sampler

    def start(self, matchers: Sequence[llg.LLMatcher | None], vocab_size: int, width: int) -> None:
        """Begin filling the masks of a step whose rows have ``matchers`` (None: unconstrained row)."""
        self.settle()
        batch = MaskBatch(self._executor, matchers, vocab_size, width, self._buffers)
        self._batch = batch
        self._job = self._pool.submit(batch.fill, True)  # one call: the GIL taken twice, not per row

    def take(self, matchers: Sequence[llg.LLMatcher | None], width: int) -> MaskBatch | None:
        """The started step's masks if they are for these rows (filled, or cancelled before they began: then the
        caller's ``apply`` fills them inline); None if no step was started for these rows."""
        batch, job = self._batch, self._job
        self._batch = self._job = None
        if batch is None or job is None:
            return None
        if job.cancel():
            self.inline += 1
        else:
            job.result()  # running or done; a fill error is raised here, on the engine's thread
            self.prefetched += 1
        if batch.width != width or len(batch.matchers) != len(matchers) or any(
                a is not b for a, b in zip(batch.matchers, matchers, strict=True)):
            return None
        return batch

    def settle(self) -> None:
        """Wait for (or cancel) a started fill that no sampler took (a forward pass that raised)."""
        job = self._job
        self._batch = self._job = None
        if job is not None and not job.cancel():
            with contextlib.suppress(Exception):  # its step failed already; the next fill reports its own errors
                job.result()

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True)

"""The discrete-event loop: arrivals, steps, KV transfers, replicas starting and draining, planner ticks.

Events sit in one heap as ``(time, seq, handler, arg)``; ``seq`` keeps equal times in the order they were pushed, so
a run is a function of its inputs. Per event the work is the real code's: the router's selectors on arrival, the
engine's scheduler on a step, the block pool's KV events into the router's index after each step.

Request accounting (checked by the tests): every trace request ends exactly once, ``done`` or ``rejected`` (no
decode worker, or a prompt larger than a replica's KV cache); every replica's block pool is back to all-free when it
goes and at the end; GPU-seconds are the sum of each replica's life times its GPUs, which must equal the integral of
the per-tier replica timeline.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.block_hash import extra_keys_for
from engine.config import SchedulerConfig
from engine.request import RequestStatus
from operators.planner.config import Role
from operators.planner.observations import LengthStats, Observations, Percentiles, TierObservation
from operators.planner.planner import Plan, PlannerState, plan
from sim.config import SimConfig
from sim.request import SimRequest
from sim.router import SimRouter
from sim.tokens import prompt_block_hashes
from sim.trace import TraceRequest
from sim.worker import Phase, SimWorker

PENDING, DONE, REJECTED = 0, 1, 2


@dataclass(slots=True)
class Books:
    """Per trace request outcomes (arrays indexed like the trace) and the run's time series."""

    n: int
    status: bytearray = field(init=False)
    ttft: array = field(init=False)  # type: ignore[type-arg]
    tpot: array = field(init=False)  # type: ignore[type-arg]
    end: array = field(init=False)  # type: ignore[type-arg]
    cached_tokens: int = 0
    prompt_tokens: int = 0  # of requests whose prefill ran (on whichever worker)
    itl: array = field(default_factory=lambda: array("d"))  # every inter-token gap
    itl_at: array = field(default_factory=lambda: array("d"))  # when each gap ended
    replicas: list[tuple[float, str, int, int, int]] = field(default_factory=list)  # (t, tier, ready, start, drain)
    scale_events: list[dict[str, Any]] = field(default_factory=list)
    failed_during_drain: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.status = bytearray(self.n)
        self.ttft = array("d", [math.nan]) * self.n
        self.tpot = array("d", [math.nan]) * self.n
        self.end = array("d", [math.nan]) * self.n


class Cluster:
    def __init__(self, config: SimConfig, trace: list[TraceRequest]) -> None:
        self.cfg = config
        self.trace = trace
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self.books = Books(len(trace))
        self.extra_keys = extra_keys_for(config.model_name)
        self.sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        self.workers: dict[str, SimWorker] = {}
        self.gone: list[SimWorker] = []
        self.ready: dict[str, list[str]] = {t.name: [] for t in config.tiers}  # ready, non-draining ids per tier
        self.roles = {t.name: t.role for t in config.tiers}
        self.prefill_tier = next((t.name for t in config.tiers if t.role is Role.PREFILL), None)
        self.decode_tier = next(t.name for t in config.tiers if t.role is not Role.PREFILL)
        self._ids = itertools.count()
        total_blocks = sum(t.replicas for t in config.tiers) * config.step.kv_blocks(config.block_size)
        self.router = SimRouter(config.routing, config.block_size, max(total_blocks, 1) * 2, lambda: self.now,
                                config.router_temperature, config.seed)
        self._next_arrival = 0
        self._unfinished = 0
        self._draining = 0
        self.planner_state = PlannerState()
        self.plans: list[Plan] = []
        self._window_start = 0.0
        self._window_arrivals: list[int] = []
        self._window_itl_from = 0
        self._window_ttft: list[float] = []
        self._window_cached = [0, 0]
        self.end_s = 0.0

    # -- the loop ---------------------------------------------------------------------------------------------

    def at(self, t: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), handler, arg))

    def run(self, max_events: int | None = None) -> Books:
        # Millions of long-lived block objects and no reference cycles worth collecting: the cyclic GC would only
        # rescan them (at a thousand GPUs it cost more than building the pools). Restored on the way out.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(max_events)
        finally:
            if was_enabled:
                gc.enable()

    def _run(self, max_events: int | None) -> Books:
        for tier in self.cfg.tiers:
            for _ in range(tier.replicas):
                self._add_worker(tier.name, ready=True)
        self._record_replicas()
        if self.trace:
            self.at(self.trace[0].arrival_s, self._arrive, 0)
        if self.cfg.planner is not None:
            self.at(self.cfg.planner_window_s, self._planner_tick)
        self.at(self.cfg.sample_every_s, self._sample)
        heap, pop = self._heap, heapq.heappop
        events = 0
        while heap:
            t, _, handler, arg = pop(heap)
            self.now = t
            handler(arg)
            events += 1
            if self._next_arrival >= len(self.trace) and not self._unfinished:
                break
            if max_events is not None and events >= max_events:
                raise RuntimeError(f"simulation did not finish within {max_events} events")
        self.end_s = self.now
        self._finish()
        return self.books

    def _finish(self) -> None:
        for w in list(self.workers.values()):
            if w.phase is not Phase.GONE:
                self._retire(w)
        self._record_replicas()
        for w in self.gone:
            w.pool.check_accounting()

    # -- fleet ------------------------------------------------------------------------------------------------

    def _add_worker(self, tier: str, ready: bool) -> SimWorker:
        w = SimWorker(f"{tier}-{next(self._ids)}", tier, self.roles[tier], self.cfg.step, self.sched_cfg,
                      self.cfg.block_size, self.now, self.cfg.max_model_len)
        self.workers[w.worker_id] = w
        if ready:
            self._ready(w)
        else:
            self.at(self.now + self.cfg.step.startup_s, self._ready, w)
        return w

    def _ready(self, w: SimWorker) -> None:
        if w.phase is not Phase.STARTING:
            return  # cancelled while starting
        w.phase = Phase.READY
        self.ready[w.tier] = [*self.ready[w.tier], w.worker_id]
        self._record_replicas()

    def _drain(self, tier: str, k: int) -> None:
        ws = [w for w in self.workers.values() if w.tier == tier and w.phase in (Phase.STARTING, Phase.READY)]
        ws.sort(key=lambda w: (w.phase is not Phase.STARTING, w.sched.num_unfinished + len(w.prealloc), w.created_s))
        for w in ws[:k]:
            if w.phase is Phase.STARTING:
                self._retire(w)
                continue
            w.phase = Phase.DRAINING
            self._draining += 1
            self.ready[tier] = [i for i in self.ready[tier] if i != w.worker_id]
            self.router.load.set_draining(w.worker_id)
            if w.idle():
                self._retire(w)
        self._record_replicas()

    def _retire(self, w: SimWorker) -> None:
        if w.phase is Phase.DRAINING:
            self._draining -= 1
        if w.phase is Phase.READY:
            self.ready[w.tier] = [i for i in self.ready[w.tier] if i != w.worker_id]
        w.phase = Phase.GONE
        w.gone_s = self.now
        del self.workers[w.worker_id]
        self.gone.append(w)
        self.router.forget(w.worker_id)
        self._record_replicas()

    def _record_replicas(self) -> None:
        counts: dict[str, list[int]] = {t.name: [0, 0, 0] for t in self.cfg.tiers}
        for w in self.workers.values():
            if w.phase is not Phase.GONE:
                counts[w.tier][(Phase.READY, Phase.STARTING, Phase.DRAINING).index(w.phase)] += 1
        for tier, (r, s, d) in counts.items():
            last = next((e for e in reversed(self.books.replicas) if e[1] == tier), None)
            if last is None or last[2:] != (r, s, d):
                self.books.replicas.append((self.now, tier, r, s, d))

    # -- requests ---------------------------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        self._next_arrival = i + 1
        if i + 1 < len(self.trace):
            self.at(self.trace[i + 1].arrival_s, self._arrive, i + 1)
        self._unfinished += 1
        self._window_arrivals.append(i)
        tr = self.trace[i]
        decoders = self.ready[self.decode_tier]
        if not decoders:
            self._reject(i)
            return
        hashes = prompt_block_hashes(tr.hash_ids, tr.input_len, self.cfg.block_size, self.extra_keys)
        router = self.router
        d = router.decode.select_hashed(hashes, tr.input_len, decoders)
        dw = self.workers[d.worker_id]
        uncached = tr.input_len - d.overlap_blocks * self.cfg.block_size
        prefillers = self.ready[self.prefill_tier] if self.prefill_tier else []
        rid = str(i)
        if prefillers and uncached >= self.cfg.min_uncached_tokens:
            p = router.prefill.select_hashed(hashes, tr.input_len, prefillers)
            pw = self.workers[p.worker_id]
            prec = SimRequest(rid + "/p", i, tr.arrival_s, tr.input_len, tr.output_len, hashes)
            prec.decision = p
            drec = SimRequest(rid, i, tr.arrival_s, tr.input_len, tr.output_len, hashes, tr.input_len + 1)
            drec.decision = d
            prec.decode_decision = drec
            if tr.input_len + 1 >= pw.sched.max_model_len or tr.input_len + 2 >= dw.sched.max_model_len:
                router.prefill.release(p)
                router.decode.release(d)
                self._reject(i)
                return
            dw.prealloc.append((drec, pw, prec))
            pw.inflight += 1  # promised work: a draining prefill worker waits for it
            self._reserve(dw)
        else:
            rec = SimRequest(rid, i, tr.arrival_s, tr.input_len, tr.output_len, hashes)
            rec.decision = d
            try:
                dw.sched.add(rec)
            except ValueError:
                router.decode.release(d)
                self._reject(i)
                return
            self._kick(dw)

    def _reserve(self, dw: SimWorker) -> None:
        """Decode's Prealloc queue: reserve blocks for the prompt in arrival order; each reserved prompt's prefill
        starts at once."""
        while dw.prealloc:
            drec, pw, prec = dw.prealloc[0]
            if not dw.sched.add_remote(drec, drec.prompt_len):
                if not dw.sched.has_unfinished() and not dw.inflight:  # can never fit: nothing will free blocks
                    dw.prealloc.popleft()
                    pw.inflight -= 1
                    self._after_free(pw)
                    self.router.prefill.release(prec.decision)
                    self.router.decode.release(drec.decision)
                    self._reject(drec.index)
                    continue
                return
            dw.prealloc.popleft()
            pw.inflight -= 1
            try:
                pw.sched.add(prec)
            except ValueError:
                dw.sched.abort([drec.request_id])
                self._after_free(pw)
                self.router.prefill.release(prec.decision)
                self.router.decode.release(drec.decision)
                self._reject(drec.index)
                continue
            self._kick(pw)

    def _reject(self, i: int) -> None:
        self.books.status[i] = REJECTED
        self.books.end[i] = self.now
        self._unfinished -= 1
        if self._draining:
            self.books.failed_during_drain += 1

    def _kick(self, w: SimWorker) -> None:
        if not w.busy:
            dt = w.start_step(self.now)
            if w.busy:
                self.at(self.now + dt, self._step_done, w)

    def _step_done(self, w: SimWorker) -> None:
        out = w.current
        assert out is not None
        w.current = None
        w.busy = False
        w.sched.finish_step(out)
        self.books.preemptions += len(out.preempted)
        for req in out.requests:
            if req.num_computed_tokens >= req.num_tokens and not req.is_finished:
                self._token(w, req)
        router = self.router
        if router.policy == "kv":
            router.kv_events(w.worker_id, w.pool)
            sched = w.sched
            router.load.update_from_report(w.worker_id, w.queue_depth, len(sched.running),
                                           w.backlog_tokens() if w.role is Role.PREFILL else 0,
                                           w.pool.num_used_blocks, w.pool.num_blocks)
        if w.prealloc:
            self._reserve(w)
        if w.phase is Phase.DRAINING and w.idle():
            self._retire(w)
            return
        self._kick(w)

    def _token(self, w: SimWorker, req: SimRequest) -> None:
        now = self.now
        b = self.books
        if w.role is Role.PREFILL or req.generated == 0:  # a prompt computed here: count its prefix hits
            b.cached_tokens += max(req.num_cached_tokens, 0)
            b.prompt_tokens += req.prompt_len
            self._window_cached[0] += max(req.num_cached_tokens, 0)
            self._window_cached[1] += req.prompt_len
        if w.role is Role.PREFILL:
            started = req.last_token_s  # when its first chunk was scheduled (SimWorker.start_step)
            w.sched.finish(req, RequestStatus.FINISHED_LENGTH)
            self.router.prefill.prefill_done(req.decision)
            self.router.prefill.release(req.decision)
            self._first_token(req.index, req.arrival_s)
            drec = req.decode_decision
            assert isinstance(drec, SimRequest)
            drec.generated = 1
            drec.first_token_s = drec.last_token_s = now
            dw = self.workers[drec.decision.worker_id]
            if drec.output_len <= 1:
                dw.sched.abort([drec.request_id])
                self.router.decode.release(drec.decision)
                self._done(drec)
                self._after_free(dw)
                return
            step = self.cfg.step
            land = max(now + step.transfer_tail(req.prompt_len), started + step.transfer_time(req.prompt_len))
            dw.inflight += 1
            self.at(land, self._kv_landed, drec)
            return
        req.generated += 1
        if req.generated == 1:
            self._first_token(req.index, req.arrival_s)
            self.router.decode.prefill_done(req.decision)
        else:
            gap = now - req.last_token_s
            req.itl_sum += gap
            b.itl.append(gap)
            b.itl_at.append(now)
        req.last_token_s = now
        if req.generated >= req.output_len:
            w.sched.finish(req, RequestStatus.FINISHED_LENGTH)
            self.router.decode.release(req.decision)
            self._done(req)
        else:
            req.num_tokens += 1

    def _kv_landed(self, drec: SimRequest) -> None:
        dw = self.workers[drec.decision.worker_id]
        dw.inflight -= 1
        dw.sched.remote_kv_ready(drec.request_id, drec.prompt_len)
        self.router.decode.prefill_done(drec.decision)
        self._kick(dw)

    def _after_free(self, w: SimWorker) -> None:
        if w.prealloc:
            self._reserve(w)
        if w.phase is Phase.DRAINING and w.idle():
            self._retire(w)

    def _first_token(self, i: int, arrival_s: float) -> None:
        ttft = self.now - arrival_s
        self.books.ttft[i] = ttft
        self._window_ttft.append(ttft)

    def _done(self, req: SimRequest) -> None:
        b = self.books
        i = req.index
        b.status[i] = DONE
        b.end[i] = self.now
        b.tpot[i] = req.itl_sum / (req.generated - 1) if req.generated > 1 else 0.0
        self._unfinished -= 1

    # -- periodic ---------------------------------------------------------------------------------------------

    def _sample(self, _: Any) -> None:
        self._record_replicas()
        if self._next_arrival < len(self.trace) or self._unfinished:
            self.at(self.now + self.cfg.sample_every_s, self._sample)

    def observe(self) -> Observations:
        window = max(self.now - self._window_start, 1e-9)
        arrivals = self._window_arrivals
        ins = sorted(self.trace[i].input_len for i in arrivals)
        outs = sorted(self.trace[i].output_len for i in arrivals)
        itl = sorted(self.books.itl[self._window_itl_from:])
        ttft = sorted(self._window_ttft)
        cached, prompt = self._window_cached
        tiers = []
        for t in self.cfg.tiers:
            counts = [0, 0, 0]
            queue = used = total = 0
            for w in self.workers.values():
                if w.tier != t.name:
                    continue
                if w.phase is Phase.READY:
                    counts[0] += 1
                    queue += w.queue_depth
                    used += w.pool.num_used_blocks
                    total += w.pool.num_blocks
                elif w.phase is Phase.STARTING:
                    counts[1] += 1
                elif w.phase is Phase.DRAINING:
                    counts[2] += 1
            kv = used / total if total else 0.0
            tiers.append(TierObservation(t.name, counts[0], counts[1], counts[2], queue_depth=queue, kv_utilisation=kv))
        return Observations(
            time_s=self.now, window_s=window, request_rate=len(arrivals) / window,
            input_len=LengthStats(sum(ins) / len(ins), _pct(ins, 0.9) or 0.0) if ins else LengthStats(),
            output_len=LengthStats(sum(outs) / len(outs), _pct(outs, 0.9) or 0.0) if outs else LengthStats(),
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            ttft=Percentiles(_pct(ttft, 0.5), _pct(ttft, 0.9), _pct(ttft, 0.99)),
            itl=Percentiles(_pct(itl, 0.5), _pct(itl, 0.9), _pct(itl, 0.99)), tiers=tuple(tiers))

    def _planner_tick(self, _: Any) -> None:
        cfg = self.cfg.planner
        assert cfg is not None
        obs = self.observe()
        p = plan(cfg, obs, self.planner_state)
        self.planner_state = p.state
        self.plans.append(p)
        for d in p.tiers:
            if d.desired > d.current:
                for _ in range(d.desired - d.current):
                    self._add_worker(d.name, ready=False)
            elif d.drain:
                self._drain(d.name, d.drain)
            if d.desired != d.current:
                self.books.scale_events.append({"t": self.now, "tier": d.name, "from": d.current, "to": d.desired,
                                                "reason": d.reason})
        self._record_replicas()
        self._window_start = self.now
        self._window_arrivals = []
        self._window_itl_from = len(self.books.itl)
        self._window_ttft = []
        self._window_cached = [0, 0]
        if self._next_arrival < len(self.trace) or self._unfinished:
            self.at(self.now + self.cfg.planner_window_s, self._planner_tick)


def _pct(sorted_values: list[float] | list[int], q: float) -> float | None:
    if not sorted_values:
        return None
    return float(sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)])

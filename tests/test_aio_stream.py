"""worker/aio_stream.py: outputs handed from a plain thread (the engine loop's role) to handlers on an asyncio loop,
through sinks that share one LoopWaker: every handler gets its outputs in order, and the outputs of one "step" for
many streams cross to the loop with one call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.engine_loop import END
from engine.llm_engine import RequestOutput
from worker.aio_stream import AioSink, LoopWaker


def _out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1, 2], [token], [token], f"<{token}>", finished, "length" if finished else None)


def test_sinks_sharing_a_waker_get_every_output_in_order_with_one_crossing_per_step() -> None:
    streams, steps = 32, 5

    async def main() -> tuple[dict[str, list[int]], list[int]]:
        loop = asyncio.get_running_loop()
        crossings: list[int] = []
        real = loop.call_soon_threadsafe

        def counted(cb: Any, *args: Any) -> Any:
            crossings.append(1)
            return real(cb, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        waker = LoopWaker(loop)
        sinks = {f"r{i}": AioSink(waker) for i in range(streams)}
        got: dict[str, list[int]] = {rid: [] for rid in sinks}
        step_done = threading.Event()
        go = [threading.Event() for _ in range(steps)]
        per_step: list[int] = []

        def engine() -> None:  # a step puts one output into every sink, then waits until the handlers took them
            for s in range(steps):
                go[s].wait(10)
                before = len(crossings)
                for rid, sink in sinks.items():
                    sink.put(_out(rid, s, finished=s == steps - 1))
                    if s == steps - 1:
                        sink.put(END)
                per_step.append(len(crossings) - before)
                step_done.set()

        async def handler(rid: str, sink: AioSink) -> None:
            while (item := await sink.get(10.0)) is not END:
                assert item is not None
                got[rid].extend(item.new_token_ids)

        thread = threading.Thread(target=engine, daemon=True)
        thread.start()
        handlers = [asyncio.create_task(handler(rid, sink)) for rid, sink in sinks.items()]
        for s in range(steps):
            step_done.clear()
            go[s].set()
            step_done.wait(10)  # the loop is blocked while the step puts its outputs, as a busy loop may be
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*handlers), 10)
        thread.join(5)
        return got, per_step

    got, per_step = asyncio.run(main())
    assert got == {f"r{i}": list(range(steps)) for i in range(streams)}
    # Puts made while the loop could not run share one crossing.
    assert per_step == [1] * steps


def test_a_sink_on_a_closed_loop_drops_its_wake_up_quietly() -> None:
    loop = asyncio.new_event_loop()
    waker = LoopWaker(loop)
    sink = AioSink(waker)
    loop.close()
    sink.put(_out("r", 7))  # the engine thread must not raise because a server went away
    sink.put(END)
    assert sink.get_nowait() is not END and sink.get_nowait() is END

"""Tandem's locust suite: OpenAI HTTP and gRPC users, four scenarios, closed-loop by default.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 16 -t 60s \\
        --scenario mix --csv out/run --html out/run.html --summary-file out/summary.json
    locust -f loadtest/locustfile.py,loadtest/open_loop.py --host ... --headless --rate 8 -t 60s   # open loop

Closed loop: ``-u N`` users, each sending its next request as soon as the previous one ends (concurrency N).
Open loop: loadtest/open_loop.py's ``LoadTestShape`` starts ``--max-users`` users that send at a fixed total
``--rate`` (requests/s) whatever the latency, so queueing shows up in TTFT instead of slowing the arrivals.
Pick the users with locust's class arguments (``OpenAIHTTP`` and/or ``GatewayGRPC``; both by default, weighted
3:1). At the end the TTFT, ITL and E2E percentiles are printed and, with ``--summary-file``, written as JSON.
No Tandem module is imported (the gRPC user uses only the published client stubs), so the suite runs against any
OpenAI-compatible server too (``OpenAIHTTP`` alone).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's modules, however locust was started

from grpc_user import GatewayUser
from locust import between, events
from locust.env import Environment
from openai_user import OpenAIUser
from pacing import paced_wait
from report import summary, write_summary
from scenarios import SCENARIOS


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--scenario", choices=SCENARIOS, default="mix", help="what each request sends")
    parser.add_argument("--model", default="", help="model name (default: the server's first /v1/models entry)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses, no TTFT/ITL")
    parser.add_argument("--long-words", type=int, default=400, help="words in a 'long' scenario prompt")
    parser.add_argument("--grpc-target", default="", help="host:port of the gRPC API (default: HTTP port + 1)")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second in total")
    parser.add_argument("--max-users", type=int, default=64, help="open loop: users available to send")
    parser.add_argument("--summary-file", default="", help="write the TTFT/ITL/E2E percentiles here as JSON")


@events.quitting.add_listener
def _summary(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    data = write_summary(environment, opts.summary_file) if opts is not None and opts.summary_file else summary(
        environment)
    print("tandem loadtest summary: " + json.dumps(data), flush=True)


class OpenAIHTTP(OpenAIUser):
    weight = 3
    wait_time = paced_wait(between(0, 0))


class GatewayGRPC(GatewayUser):
    weight = 1
    wait_time = paced_wait(between(0, 0))

"""The open-loop load shape: ``--max-users`` users started at once and kept for the run (``-t``), each pacing
itself on the shared ``--rate`` schedule (pacing.py). Add it to the locustfile list to use it:

    locust -f loadtest/locustfile.py,loadtest/open_loop.py --host http://127.0.0.1:8000 --headless --rate 8 -t 60s
"""

from __future__ import annotations

from locust import LoadTestShape


class ConstantRate(LoadTestShape):
    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options if self.runner is not None else None
        if opts is None or opts.rate <= 0:
            raise ValueError("the open-loop shape needs --rate R (requests per second)")
        if opts.run_time and self.get_run_time() > opts.run_time:
            return None
        return opts.max_users, float(opts.max_users)

"""The cluster simulator: Tandem's own router, scheduler, block pool and planner, with only the model step modelled.

Modules: ``hardware`` (GPU spec-sheet figures), ``roofline`` (a step's time from its tokens and KV reads),
``trace`` (Mooncake-format traces and synthetic generators), ``request`` (the engine's request record without its
token lists), ``worker`` (one replica: the engine's real scheduler and block pool), ``router`` (the router's real
selector, cost function, KV index and load tracker), ``cluster`` (the discrete-event loop, fleet and planner),
``results`` (attainment, goodput, GPU-hours, distributions), ``plots``, ``capacity`` (each tier's capacity at the SLO,
for the planner), ``calibration`` (this CPU as the "GPU"), ``sweep`` (goodput at >= 90% attainment over
speed-ups).

It loads no weights and runs no forward pass (DESIGN.md). ``engine.scheduler`` imports ``engine.config`` and
``engine.request``, which import torch (for dtypes and seeded sampling generators): the simulator imports them as
they are (torch is a dependency of the project; the import costs about two seconds) and uses no tensor.
"""

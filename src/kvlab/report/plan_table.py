"""Terminal tables for a plan dict and a comparison: every size with its unit, binary and decimal apart."""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from kvlab.plan.units import binary, decimal


def _size(num_bytes: Optional[float]) -> str:
    if num_bytes is None:
        return "unknown"
    return f"{num_bytes:,.0f} B  ({binary(num_bytes)} = {decimal(num_bytes)})"


def _count(value: Any) -> str:
    if value is None:
        return "unbounded"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _params(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3f}{suffix}" if suffix == "B" else f"{count / scale:.1f}{suffix}"
    return str(count)


def render_plan(result: dict[str, Any], console: Console) -> None:
    model, inputs = result["model"], result["inputs"]
    if "kv_lora_rank" in model:  # MLA caches a latent, not KV heads: its up-projected heads are not what is stored
        keys = model.get("rope_key_heads", 1)
        cached = f"latent {model['kv_lora_rank']} + {keys if keys != 1 else 'one'} RoPE key"
        title = (f"{model['name']}: {model['layers']} layers, {model['q_heads']} q heads, {cached}"
                 f"{'s' if keys != 1 else ''} cached, head dim {model['head_dim']} "
                 f"({', '.join(model['attention_kinds'])})")
    else:
        title = (f"{model['name']}: {model['layers']} layers, {model['q_heads']} q heads, {model['kv_heads']} KV "
                 f"heads, head dim {model['head_dim']} ({', '.join(model['attention_kinds'])})")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("KV cache dtype", str(inputs["kv_cache_dtype"]))
    if model.get("windows"):
        table.add_row("sliding windows", f"{model['windowed_layers']} layers, window {model['windows']}")
    if model.get("layer_shapes"):
        table.add_row("layer shapes", "; ".join(f"{item['layers']} {item['kind']}: {item['kv_heads']} KV heads x "
                                                f"{item['head_dim']}" for item in model["layer_shapes"]))
    if model.get("chunk_sizes"):
        table.add_row("chunked local attention", f"chunks of {model['chunk_sizes']} tokens")
    if model.get("kv_shared_layers"):
        table.add_row("KV-sharing layers", f"{model['kv_shared_layers']} layers reuse earlier caches")
    if "state_bytes_per_sequence" in result:
        table.add_row(f"state ({model['state_layers']} linear layers)",
                      f"{_size(result['state_bytes_per_sequence'])} per sequence, any context")
    if "kv_lora_rank" in model:
        keys = model.get("rope_key_heads", 1)
        rope = f"{keys} x RoPE {model['qk_rope_head_dim']}" if keys != 1 else f"RoPE {model['qk_rope_head_dim']}"
        table.add_row("MLA latent", f"{model['kv_lora_rank']} + {rope} per token per layer")
    if inputs["tensor_parallel_size"] > 1:
        table.add_row("tensor parallel", f"{inputs['tensor_parallel_size']} ranks, figures per rank")
    spec = result.get("speculative")
    if spec:
        if "draft_state_bytes_per_sequence" in spec:  # a built-in head: no K/V
            table.add_row(f"draft {spec['draft']}", f"weights {_size(spec['draft_weight_bytes'])} (counted below), "
                                                    f"no KV; {spec['draft_state_bytes_per_sequence']:,} B of hidden "
                                                    "states per running sequence, outside the pool")
        else:
            table.add_row(f"draft {spec['draft']}", f"weights {_size(spec['draft_weight_bytes'])}, KV "
                                                    f"{spec['draft_kv_bytes_per_token']:,} B/token (counted below)")
        if "acceptance_source" in spec and spec["acceptance_source"] != "--acceptance-rate":
            table.add_row("acceptance rate", f"{spec['acceptance_rate']} from {spec['acceptance_source']}")
        if "expected_speedup" in spec:
            table.add_row(f"speculative, a={spec['acceptance_rate']}, k={spec['num_speculative_tokens']}",
                          f"{spec['expected_tokens_per_step']:.2f} tokens/step, {spec['expected_speedup']:.2f}x "
                          f"expected (draft {'pass' if 'draft_passes' in spec else 'step'} {spec['cost_ratio']:.3f} "
                          f"of the target's step"
                          + (f", {spec['draft_passes']} per step" if 'draft_passes' in spec else "")
                          + f", verification {spec['verify_cost']:g})")
    table.add_row("KV bytes per token", _size(result["kv_bytes_per_token"]))
    table.add_row(f"KV per sequence @ {inputs['context']:,} tokens", _size(result["kv_bytes_per_sequence"]))
    table.add_row(f"KV for batch of {inputs['batch']}", _size(result["kv_bytes_batch"]))
    if "kv_fixed_bytes" in result:
        table.add_row("KV fixed per model (codebooks, key ranges)", _size(result["kv_fixed_bytes"]))
    params = model.get("params_total")
    label = "" if params is None else f" ({_params(params)} params{', estimated' if model['params_estimated'] else ''})"
    table.add_row(f"weights{label}", _size(result["weight_bytes"]))
    if model.get("weight_format"):
        table.add_row("weights as shipped", model["weight_format"])
    if model.get("checkpoint_bytes"):
        table.add_row("checkpoint (MTP layers too)", _size(model["checkpoint_bytes"]))
    if "cache_budget_bytes" in result:
        vllm_mode = "vllm" in result
        table.add_row("cache budget" + (" (vLLM's available KV cache)" if "vllm_startup" in result else ""),
                      _size(result["cache_budget_bytes"]))
        if "kv_cache_tokens" in result:
            table.add_row("tokens that fit (kv_cache_tokens)", _count(result["kv_cache_tokens"]))
        how = " (vLLM blocks)" if vllm_mode else ""
        table.add_row(f"seats @ {inputs['context']:,} tokens{how}", _count(result["seats"]))
        limited = " (the model's limit)" if result.get("max_context_limited_by") else ""
        table.add_row(f"longest context @ batch {inputs['batch']}{how}", _count(result["max_context"]) + limited)
    if "decode_ms_per_token" in result:
        table.add_row(f"decode floor @ batch {inputs['batch']}",
                      f"{result['decode_ms_per_token']:.2f} ms/token, {result['decode_tokens_per_s']:,.0f} tokens/s "
                      f"({result['decode_bound']} bound)")
        table.add_row(f"prefill {result['prefill_tokens']:,} tokens", f"{result['prefill_ms']:,.1f} ms")
    if "binding_limit" in result:
        table.add_row("binding limit", result["binding_limit"])
    console.print(table)
    if "does_not_fit" in result:
        console.print(f"does not fit: {result['does_not_fit']}; no decode or prefill figures")
    if "hardware" in result:
        hw = result["hardware"]
        console.print(f"card: {hw['name']}, {decimal(hw['memory_bytes'])} at {hw['gpu_memory_utilization']:.0%}, "
                      f"{hw['bandwidth_gbs']:,} GB/s, {hw['bf16_tflops']} bf16 TFLOP/s; source: {hw['source']}")
    for note in model["notes"]:
        console.print(f"[dim]note: {note}[/dim]")
    if "vllm_startup" in result:
        render_startup(result["vllm_startup"], console)
    if "vllm" in result:
        render_vllm(result["vllm"], console)
    for line in result.get("kvlab_engine", {}).get("log_lines", []):
        console.print(f"kvlab's engine would log: {line}", soft_wrap=True, highlight=False)


def render_startup(table_data: dict[str, Any], console: Console) -> None:
    """vLLM's start-up memory as a budget: total, requested, each subtracted term, what is left for the cache."""
    table = Table(title=f"vLLM {table_data['vllm_version']} start-up memory on {table_data['device']}, one rank "
                        f"(max_num_batched_tokens {table_data['max_num_batched_tokens']:,}, "
                        f"max_num_seqs {table_data['max_num_seqs']:,})", header_style="bold")
    for column in ("term", "GiB", "kind", "how"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    table.add_row("total CUDA reports", f"{table_data['total_bytes'] / 2**30:,.2f}", "", table_data["total_source"])
    table.add_row(f"x gpu_memory_utilization {table_data['gpu_memory_utilization']:g}",
                  f"{table_data['requested_bytes'] / 2**30:,.2f}", "", "what vLLM may use")
    for term in table_data["terms"]:
        table.add_row(f"- {term['term']}", f"{term['bytes'] / 2**30:,.2f}", term["kind"], term["how"])
    table.add_row("= available KV cache memory", f"{table_data['available_bytes'] / 2**30:,.2f}", "", "")
    console.print(table)


def render_vllm(vllm: dict[str, Any], console: Console) -> None:
    """The lines vLLM would log, how it gets there, and what one request really holds."""
    for line in vllm["log_lines"]:
        console.print(f"vLLM {vllm['vllm_version']} would log: {line}")
    for line in vllm["decomposition"]:
        console.print(f"  {line}")
    fit = vllm["requests_that_fit"]
    freed = ", blocks outside windows freed" if any(group["window"] for group in vllm["kv_cache_groups"]) else ""
    console.print(f"vLLM per request: {vllm['request_blocks']:,} blocks ({binary(vllm['request_bytes'])}) at "
                  f"{vllm['request_context']:,} tokens{freed}; {fit if fit is not None else '-'} such requests fit")


def render_cards(result: dict[str, Any], console: Console) -> None:
    """The inverse question over several cards: each card's smallest serving TP, and the cheapest overall."""
    inputs = result["inputs"]
    table = Table(title=f"{result['model']} @ {inputs['context']:,} tokens, batch {inputs['batch']} "
                        f"({inputs['engine']} engine)", header_style="bold")
    for column in ("card", "TP", "weights/rank", "KV budget/rank", f"seats @ {inputs['context']:,}",
                   f"longest ctx @ {inputs['batch']}", "serves", "decode tok/s"):
        table.add_column(column, justify="left" if column == "card" else "right")
    for row in result["cards"]:
        budget = row.get("cache_budget_bytes")
        table.add_row(row["card"], str(row["tensor_parallel_size"]), binary(row["weight_bytes_per_rank"]),
                      binary(budget) if budget is not None and budget > 0 else "none",
                      _count(row.get("seats")), _count(row.get("max_context")), "yes" if row.get("fits") else "no",
                      f"{row['decode_tokens_per_s']:,.0f}" if "decode_tokens_per_s" in row else "-")
    console.print(table)
    best = result["smallest"]
    if best is None:
        console.print(f"no card serves {inputs['batch']} x {inputs['context']:,} tokens at tensor-parallel sizes "
                      f"{', '.join(map(str, inputs['tensor_parallel_sizes']))}")
    else:
        console.print(f"smallest that serves {inputs['batch']} x {inputs['context']:,} tokens: {best['card']} x "
                      f"{best['tensor_parallel_size']} ({decimal(best['memory_bytes'] * best['tensor_parallel_size'])} "
                      "in all)")


def render_comparison(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title, header_style="bold")
    for column in ("variant", "KV dtype", "KV heads", "bytes/token", "per sequence", "vs first"):
        table.add_column(column, justify="right")
    has_seats = "seats" in rows[0]
    has_speed = "decode_tokens_per_s" in rows[0]
    if has_seats:
        table.add_column("seats", justify="right")
        table.add_column("longest ctx", justify="right")
    if has_speed:
        table.add_column("decode tok/s", justify="right")
    for row in rows:
        heads = "latent" if "mla" in row["attention_kinds"] else str(row["kv_heads"])
        per_token = row["kv_bytes_per_token"]
        cells = [row["variant"], row["kv_cache_dtype"], heads,
                 f"{per_token:,}" if isinstance(per_token, int) else f"{per_token:,.1f}",
                 binary(row["kv_bytes_per_sequence"]), f"{row['cache_ratio']:.3f}x"]
        if has_seats:
            cells += [_count(row["seats"]), _count(row["max_context"])]
        if has_speed:
            cells.append(f"{row['decode_tokens_per_s']:,.0f}" if "decode_tokens_per_s" in row else "does not fit")
        table.add_row(*cells)
    console.print(table)

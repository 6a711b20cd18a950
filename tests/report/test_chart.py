"""The chart page: its numbers are the planner's, before and after a control moves (headless Chromium)."""


import pytest

from needs import require_browser, require_module

from kvlab.cli import main
from kvlab.plan.hardware import device
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.presets import preset
from kvlab.report.chart_data import PRECISIONS, chart_data

GIB = 2**30


def page_bytes(terms, tokens):
    return sum(per_token * (tokens if window is None else min(tokens, window)) + (fixed if tokens else 0)
               for per_token, window, fixed in terms)


@pytest.mark.parametrize("name", ["llama-3-8b", "mistral-7b", "gemma-3-270m", "deepseek-v2"])
def test_exported_terms_reproduce_the_planner_exactly(name):
    spec = preset(name)
    data = chart_data(spec, 4096, 2, 40 * GIB)
    for heads in data["kv_head_choices"]:
        model = spec.with_kv_heads(heads)
        for bits, dtype in PRECISIONS.items():
            for tokens in (1, 500, 4096, 70_000):
                assert page_bytes(data["variants"][str(heads)][str(bits)], tokens) == \
                    kv_bytes_per_sequence(model, tokens, cache_formats(dtype))
    if spec.has_mla:
        assert page_bytes(data["mla"]["16"], 4096) == kv_bytes_per_sequence(spec, 4096, cache_formats("fp16"))


def test_chart_command_writes_html_and_png(tmp_path):
    html, png = tmp_path / "c.html", tmp_path / "c.png"
    assert main(["chart", "smollm2-135m", "--kv-cache-memory", "2GiB", "-o", str(html), "--png", str(png)]) == 0
    text = html.read_text()
    assert "<script src" not in text and "http" not in text.split("<script id")[1]  # self-contained, no CDN
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _browser():
    webdriver = require_module("selenium.webdriver")
    chromium, driver = require_browser()
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_exported_terms_count_a_linear_attention_state_once_per_sequence():
    """Qwen3-Next's linear layers (a fixed state), Llama 4's chunks, Gemma 4's two layer shapes."""
    from kvlab.plan.hf_config import spec_from_hf_config
    qwen3_next = dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, vocab_size=151936)
    llama4 = dict(model_type="llama4_text", hidden_size=5120, num_hidden_layers=48, attention_chunk_size=8192)
    gemma4 = dict(model_type="gemma4_text", hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
                  num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024)
    for config in (qwen3_next, llama4, gemma4):  # at the model's own KV heads: the model itself
        spec = spec_from_hf_config(config, "m")
        data = chart_data(spec, 4096, 1, 40 * GIB)
        for tokens in (0, 1, 9000, 300_000):
            assert page_bytes(data["variants"][str(spec.kv_heads)]["16"], tokens) == \
                kv_bytes_per_sequence(spec, tokens, cache_formats("fp16"))


def test_png_crossings_are_the_planners_longest_context():
    card = plan(preset("llama-3-8b"), PlanRequest(context=8192, batch=8, device=device("h100-sxm")))
    data = chart_data(preset("llama-3-8b"), 8192, 8, card["cache_budget_bytes"])
    mha = plan(preset("llama-3-8b").with_kv_heads(32), PlanRequest(context=8192, batch=8, device=device("h100-sxm")))
    assert (card["max_context"], mha["max_context"]) == (53_348, 13_337)  # the README's table
    assert data["crossings"] == {"chosen": 53_348, "mha": 13_337}


def _set(browser, element_id, value, event="input"):
    """Move a slider (or type into a field) the way a user's drag does: set the value, fire the event."""
    browser.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                           "e.dispatchEvent(new Event(arguments[2]));", element_id, str(value), event)


def test_page_in_headless_chromium_agrees_with_plan_after_moving_controls(tmp_path):
    from selenium.webdriver.common.by import By

    html = tmp_path / "chart.html"
    assert main(["chart", "llama-3-8b", "--gpu", "h100-sxm", "--context", "8192", "--batch", "8",
                 "-o", str(html)]) == 0
    browser = _browser()
    try:
        browser.get(html.as_uri())

        def shown(element_id):
            return browser.find_element(By.ID, element_id).text.replace(",", "")

        def attribute(element_id, name):
            return browser.find_element(By.ID, element_id).get_attribute(name)

        card = plan(preset("llama-3-8b"), PlanRequest(context=8192, batch=8, device=device("h100-sxm")))
        mha = plan(preset("llama-3-8b").with_kv_heads(32),
                   PlanRequest(context=8192, batch=8, device=device("h100-sxm")))
        assert int(shown("seats")) == card["seats"]
        assert int(shown("max-context")) == card["max_context"] == 53_348
        # the x-axis reaches past the crossing, and both crossings are marked inside the plot at their token counts
        assert float(attribute("plot", "data-x-max")) > card["max_context"]
        for name, expected in (("chosen", card["max_context"]), ("mha", mha["max_context"])):
            assert int(attribute(f"crossing-{name}", "data-tokens")) == expected
            assert 70 <= float(attribute(f"crossing-{name}", "cx")) <= 940
        assert float(attribute("crossing-mha", "cx")) < float(attribute("crossing-chosen", "cx"))
        # each legend sample uses its line's stroke pattern: MQA dotted, MHA dashed, chosen solid
        for name, dash in (("mqa", "2 4"), ("mha", "8 5"), ("chosen", "")):
            sample = browser.find_element(By.CSS_SELECTOR, f"#legend-{name} line")
            assert sample.get_attribute("stroke-dasharray") == attribute(f"line-{name}", "stroke-dasharray") == dash

        # sliders: KV heads from 8 down to 2 (the divisors 1, 2, 4, 8, 16, 32), precision to 8 bits
        assert attribute("kv-heads-slider", "max") == "5" and attribute("kv-heads", "value") == "8"
        _set(browser, "kv-heads-slider", 1)
        _set(browser, "bits-slider", 2)
        assert attribute("kv-heads", "value") == "2" and attribute("bits", "value") == "8"
        _set(browser, "context", 16384)
        budget = browser.find_element(By.ID, "budget")
        budget.clear()
        budget.send_keys("9")
        expected = plan(preset("llama-3-8b").with_kv_heads(2),
                        PlanRequest(context=16384, batch=8, kv_cache_dtype="fp8", kv_cache_memory=9 * GIB))
        assert int(shown("seats")) == expected["seats"]
        assert int(shown("max-context")) == expected["max_context"]
        assert float(shown("cache-gib")) == round(expected["kv_bytes_batch"] / GIB, 2)
        assert float(attribute("context-slider", "value")) == 14

        # the context slider is log2 of the tokens; a typed KV-head count snaps to the nearest divisor
        _set(browser, "context-slider", 17)
        assert attribute("context", "value") == "131072"
        _set(browser, "kv-heads", 3, "change")
        assert attribute("kv-heads", "value") == "4" and attribute("kv-heads-slider", "value") == "2"
        expected = plan(preset("llama-3-8b").with_kv_heads(4),
                        PlanRequest(context=131072, batch=8, kv_cache_dtype="fp8", kv_cache_memory=9 * GIB))
        assert float(shown("cache-gib")) == round(expected["kv_bytes_batch"] / GIB, 2)
        assert int(shown("max-context")) == expected["max_context"]
        assert float(attribute("plot", "data-x-max")) > expected["max_context"]
    finally:
        browser.quit()


def test_page_counts_a_linear_attention_state_as_the_planner_does(tmp_path):
    """Qwen3-Next: 36 Gated DeltaNet layers add a fixed state per sequence; the page's seats and crossing agree."""
    import json as json_module
    from selenium.webdriver.common.by import By
    from kvlab.plan.hf_config import load_hf_config

    config = tmp_path / "qwen3-next" / "config.json"
    config.parent.mkdir()
    config.write_text(json_module.dumps(dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48,
                                             vocab_size=151936)))
    html = tmp_path / "chart.html"
    assert main(["chart", str(config.parent), "--kv-cache-memory", "3GiB", "--batch", "64", "--context", "2048",
                 "-o", str(html)]) == 0
    expected = plan(load_hf_config(str(config.parent)), PlanRequest(context=2048, batch=64, kv_cache_memory=3 * GIB))
    assert expected["state_bytes_per_sequence"] > 0
    browser = _browser()
    try:
        browser.get(html.as_uri())
        assert int(browser.find_element(By.ID, "seats").text.replace(",", "")) == expected["seats"]
        assert int(browser.find_element(By.ID, "max-context").text.replace(",", "")) == expected["max_context"]
        assert float(browser.find_element(By.ID, "cache-gib").text) == round(expected["kv_bytes_batch"] / GIB, 2)
    finally:
        browser.quit()

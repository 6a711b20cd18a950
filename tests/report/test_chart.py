"""The chart page: its numbers are the planner's, before and after a control moves (headless Chromium)."""

import shutil

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
    return sum(per_token * (tokens if window is None else min(tokens, window)) for per_token, window in terms)


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


def test_page_in_headless_chromium_agrees_with_plan_after_moving_controls(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    html = tmp_path / "chart.html"
    assert main(["chart", "llama-3-8b", "--gpu", "h100-sxm", "--context", "8192", "--batch", "8",
                 "-o", str(html)]) == 0
    browser = _browser()
    try:
        browser.get(html.as_uri())

        def shown(element_id):
            return browser.find_element(By.ID, element_id).text.replace(",", "")

        card = plan(preset("llama-3-8b"), PlanRequest(context=8192, batch=8, device=device("h100-sxm")))
        assert int(shown("seats")) == card["seats"]
        assert int(shown("max-context")) == card["max_context"]

        Select(browser.find_element(By.ID, "kv-heads")).select_by_value("2")
        Select(browser.find_element(By.ID, "bits")).select_by_value("8")
        context = browser.find_element(By.ID, "context")
        context.clear()
        context.send_keys("16384")
        budget = browser.find_element(By.ID, "budget")
        budget.clear()
        budget.send_keys("9")
        expected = plan(preset("llama-3-8b").with_kv_heads(2),
                        PlanRequest(context=16384, batch=8, kv_cache_dtype="fp8", kv_cache_memory=9 * GIB))
        assert int(shown("seats")) == expected["seats"]
        assert int(shown("max-context")) == expected["max_context"]
        assert float(shown("cache-gib")) == round(expected["kv_bytes_batch"] / GIB, 2)
    finally:
        browser.quit()

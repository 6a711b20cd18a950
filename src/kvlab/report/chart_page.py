"""Write the self-contained chart page: the HTML template with the planner's numbers inlined."""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any


def render_chart_html(data: dict[str, Any]) -> str:
    template = resources.files("kvlab.report").joinpath("chart.html").read_text(encoding="utf-8")
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # safe inside <script>
    return template.replace("__TITLE__", html.escape(data["model"])).replace("__DATA__", payload)

"""Layers point one way: no package imports one above it (function-level imports included).

The order as built: plan (stdlib only) < cache < nn < train < checkpoints (which reads the
trainer's checkpoint format) < engine < server; the fleet simulator and draft training sit on
the engine, evaluations on the lab; then bench (measures, writes JSON) < report (renders JSON)
< studies (measure and report) < commands (the parsers) < cli. report/ renders and measures
nothing, so beyond the order it imports none of the lab or the engine (no model, cache,
checkpoint, trainer, engine or server code): only kvlab.plan's arithmetic, bench's constants and
the JSON. Every package has its place:
a new upward import fails here, naming the file. (kvlab.files and kvlab.errors are stdlib-only
modules every layer may use.)
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"
TOP = {"bench", "report", "studies", "commands", "cli", "__main__"}
ABOVE = {
    "plan": {"nn", "cache", "checkpoints", "train", "engine", "server", "fleet", "evals", "draft"} | TOP,
    "cache": {"nn", "checkpoints", "train", "engine", "server", "fleet", "evals", "draft"} | TOP,
    "nn": {"checkpoints", "train", "engine", "server", "fleet", "evals", "draft"} | TOP,
    "checkpoints": {"engine", "server", "fleet", "evals", "draft"} | TOP,
    "train": {"checkpoints", "engine", "server", "fleet", "evals", "draft"} | TOP,
    "engine": {"server", "fleet", "evals", "draft"} | TOP,
    "server": {"fleet", "evals", "draft"} | TOP,
    "fleet": {"server", "evals", "draft"} | TOP,
    "evals": {"engine", "server", "fleet", "draft"} | TOP,
    "draft": {"server", "fleet", "evals"} | TOP,
    "bench": TOP - {"bench"},
    # report renders JSON: nothing that builds a model, a cache, an engine or a server, directly
    "report": TOP - {"bench", "report"} | {"nn", "cache", "checkpoints", "train", "engine", "server", "fleet", "evals",
                                           "draft"},
    "studies": {"commands", "cli", "__main__"},
    "commands": {"cli", "__main__"},
}


def kvlab_imports(path: Path) -> set[str]:
    """The kvlab sub-packages a module imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found |= {name.split(".")[1] for name in names if name.startswith("kvlab.")}
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_package_imports_a_layer_above_it(package):
    files = sorted((SRC / package).rglob("*.py"))
    assert files, f"no package kvlab.{package}"
    upward = {f"{path.relative_to(SRC)} imports kvlab.{name}"
              for path in files for name in kvlab_imports(path) & ABOVE[package]}
    assert not upward, sorted(upward)


def test_every_package_has_a_place():
    packages = {path.name for path in SRC.iterdir() if (path / "__init__.py").is_file()}
    assert packages <= set(ABOVE) | {"cli", "__main__"}, sorted(packages - set(ABOVE))


def test_the_rule_catches_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvlab.commands.plan_args import model_from_args\n")
    assert kvlab_imports(module) & ABOVE["fleet"] == {"commands"}


def test_a_report_module_that_builds_an_engine_fails(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def render():\n    from kvlab.engine.engine import LLMEngine\n    import kvlab.nn.config\n")
    assert kvlab_imports(module) & ABOVE["report"] == {"engine", "nn"}

"""kvlab: inference-aware model design.

`kvlab.plan` is pure arithmetic (stdlib only); `kvlab.nn` and `kvlab.cache` are the PyTorch
lab built on it. Import the sub-package you need: this top level imports nothing heavy.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from kvlab import LLM, SamplingParams` without importing torch for `kvlab plan`."""
    if name in ("LLM", "SamplingParams", "EngineConfig", "LLMEngine"):
        from kvlab import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")

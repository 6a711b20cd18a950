"""The serving engine: continuous batching over one paged KV pool (see engine.py), and the offline LLM API."""

from kvlab.engine.engine import EngineConfig, LLMEngine
from kvlab.engine.llm import LLM
from kvlab.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "SamplingParams"]

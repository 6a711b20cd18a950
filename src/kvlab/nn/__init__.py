"""PyTorch modules: RoPE, grouped-query attention, MLA, norms, MLPs and a config-driven decoder.

May import kvlab.plan and kvlab.cache, nothing higher.
"""

from kvlab.nn.config import ModelConfig
from kvlab.nn.generate import generate, sample
from kvlab.nn.model import Decoder

__all__ = ["ModelConfig", "Decoder", "generate", "sample"]

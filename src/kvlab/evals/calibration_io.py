"""Where a kvquant calibration comes from for an eval: --kv-calibration, or beside the model."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional


def calibration_loader(model_path: str, explicit: Optional[Path]) -> Callable:
    """A function (setting, model) -> the calibration the setting needs, or None when it needs none."""
    def load(setting, model):
        if not setting.is_kvquant:
            return None
        from kvlab.cache.kvquant_calibration import default_calibration_path, load_calibration
        path = explicit or default_calibration_path(model_path, setting.kv_heads, setting.method)
        return load_calibration(path, model.config)
    return load

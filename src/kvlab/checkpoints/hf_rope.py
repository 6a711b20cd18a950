"""A config.json's RMS-norm epsilon and RoPE base, checked: what every HF loader here reads.

kvlab's RoPE is the default kind only; a scaled RoPE (linear, dynamic, YaRN, llama3) would load
and then compute another function, so it is refused rather than ignored.
"""

from __future__ import annotations

from kvlab.plan.errors import PlanError


def check_rope_kind(rope: dict, where: str = "rope_parameters") -> None:
    """Refuse any RoPE but the default kind (`rope_type`, or 4.x's `type`)."""
    if not isinstance(rope, dict):
        raise PlanError(f"config.json's {where} must be an object, got {rope!r}")
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise PlanError(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")


def norm_eps_and_rope_base(data: dict) -> tuple[float, float]:
    """(rms_norm_eps, rope_theta) of config.json `data`, with transformers' defaults (1e-6, 10000)."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    check_rope_kind(rope)
    eps, theta = data.get("rms_norm_eps", 1e-6), data.get("rope_theta", rope.get("rope_theta", 10000.0))
    for key, value in (("rms_norm_eps", eps), ("rope_theta", theta)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"config.json's {key} must be a positive number, got {value!r}")
    return float(eps), float(theta)

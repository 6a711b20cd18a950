"""reports/real-models, second model (what is measured; kvlab.report.real_models_gemma lays it out): Gemma 3 270M, MQA with five sliding layers to each global one.

It answers the question SmolLM2 cannot: what a cache format does to a model that already keeps
one KV head and a 512-token window on 15 of its 18 layers, at 4,096-token passkey prompts where
only the three global layers can reach the key. The rows are SmolLM2's formats on the original
model, KVQuant with its own calibration (pre-RoPE keys rotated on read with each layer's table:
Gemma's sliding layers use RoPE base 10,000, its global ones 1,000,000), and a sinks + window
policy that turns the global layers into windowed ones too. Not here: KV-head conversions (it has
one KV head already), and the engine's columns (kvlab's engine refuses sliding-window models: its
pool keeps every layer's blocks).
"""

from __future__ import annotations

from kvlab.bench.real_models_study import Study
from kvlab.evals.setting import KVSetting

WINDOW, SINKS = 512, 4  # its own sliding width, now on the global layers as well

STUDY = Study(
    model="gemma-3-270m", results="gemma3-results.json",
    settings=(KVSetting("fp16"), KVSetting("fp8"), KVSetting("int8"), KVSetting("int4"), KVSetting("kivi4"),
              KVSetting("kivi2"), KVSetting("int4", pre_rope=True), KVSetting("kvquant4"), KVSetting("kvquant3"),
              KVSetting("fp16", window=WINDOW, sinks=SINKS)),
    lengths=(512, 2048, 4096),
    passkey_first=("fp16", f"fp16 sink{SINKS}+win{WINDOW}", "kivi2", "int4", "fp8", "int8", "kivi4"),
    calibration="gemma-3-270m.kvquant.safetensors")

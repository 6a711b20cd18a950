"""reports/real-models' second model, what is measured: Gemma 3 270M (MQA, five sliding layers to each global
one) under SmolLM2's formats, its own KVQuant calibration and a sinks + window policy; kvlab.report.real_models_gemma
says why and lays the rows out."""

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
    calibration="gemma-3-270m.kvquant.safetensors", engine_runs="gemma3-engine_throughput.json")

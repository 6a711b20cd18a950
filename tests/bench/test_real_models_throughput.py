"""The real-models report's throughput column: one engine run per served setting, kept and shown."""

import json

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
from kvlab.evals.setting import KVSetting
from kvlab.bench import real_models_throughput as throughput
from needs import STORIES, require_file


def test_measured_settings_are_every_one_but_the_uptrained_conversion():
    assert throughput.served(KVSetting("fp16")) and throughput.served(KVSetting("int8"))
    assert throughput.served(KVSetting("fp16", window=256, sinks=4)) and throughput.served(KVSetting("kivi2"))
    assert throughput.served(KVSetting("kvquant3")) and throughput.served(KVSetting("int4", pre_rope=True))
    for setting in (KVSetting("fp16", kv_heads=1), KVSetting("fp16", mla_rank=16, mla_rope=4)):
        assert throughput.served(setting) and throughput.converted(setting)  # on dense weights
    assert not throughput.converted(KVSetting("kvquant3"))
    assert not throughput.served(KVSetting("fp16", kv_heads=1, method="mean", uptrain_steps=160))


def test_a_run_is_stored_with_its_workload_and_shown_once(tmp_path):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    settings = [KVSetting("fp16"), KVSetting("fp16", kv_heads=1, method="mean", uptrain_steps=160)]
    assert throughput.pending(tmp_path, settings) == [KVSetting("fp16")]
    figures = throughput.measure(tmp_path, str(STORIES), KVSetting("fp16"), threads=1)
    assert figures["num_requests"] == throughput.REQUESTS
    assert figures["output_tokens"] == throughput.REQUESTS * throughput.OUTPUT_LEN  # ignore_eos: every token
    assert figures["prefix_cached_tokens"] == 0  # the warm-up's prompt is not among the measured ones
    assert figures["block_size"] == DEFAULT_BLOCK_SIZE  # recorded: the report's runs use the engine's default
    stored = json.loads((tmp_path / throughput.FILE).read_text())
    assert stored["workload"]["input_len"] == throughput.INPUT_LEN and "fp16" in stored["rows"]
    assert throughput.pending(tmp_path, settings) == []
    from kvlab.report.real_models_engine import cell
    assert cell(throughput.load(tmp_path)["rows"]["fp16"]).startswith(f"{figures['output_tokens_per_s']:.1f}")
    assert cell(throughput.load(tmp_path)["rows"].get("kvquant3")) == "–"
    assert cell({"output_tokens_per_s": 9.04, "decode_path": "module by module", "weights": "dense"}) == \
        "9.0 (module by module, dense weights)"


def test_a_setting_the_engine_refuses_is_recorded_in_its_studys_file(tmp_path):
    """Gemma 3's runs live in their own file; a setting the engine refuses (a KIVI pool on sliding layers here
    stands for any refusal: stories260K has none, so the file's row is what measure writes on refusal) is a cell
    with the engine's one line, and is not pending again."""
    require_file(STORIES, "../shared/models/stories260K.gguf")
    file = "gemma3-engine_throughput.json"
    refused = KVSetting("kvquant4")  # no calibration given: the engine refuses in one line
    row = throughput.measure(tmp_path, str(STORIES), refused, threads=1, calibration=None, file=file)
    assert "refused" in row and "\n" not in row["refused"]
    assert throughput.pending(tmp_path, [refused], file) == [] and throughput.pending(tmp_path, [refused]) == [refused]
    from kvlab.report.real_models_engine import cell
    assert cell(throughput.load(tmp_path, file)["rows"]["kvquant4"]) == f"not served: {row['refused']}"


def test_only_names_steps_by_key_prefix():
    from kvlab.bench.real_models import step_keys

    assert step_keys(None)("smollm2:fp16") and step_keys("")("uptrain")
    wanted = step_keys("throughput:kivi,smollm2:kvquant4")
    assert wanted("throughput:kivi2") and wanted("throughput:kivi4") and wanted("smollm2:kvquant4")
    assert not wanted("throughput:fp16") and not wanted("uptrain") and not wanted("gemma:kvquant4")
    assert step_keys("gemma-throughput:")("gemma-throughput:int8") and not step_keys("gemma:")("gemma-throughput:x")

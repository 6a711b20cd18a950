"""`kvlab serve --kv-cache-dtype kvquant4` starts, answers the openai client, and gives `LLM`'s greedy text."""

from __future__ import annotations

import pytest

from needs import STORIES, require_file
from server_helpers import Served


def test_a_kvquant_server_answers_as_llm_does(tmp_path):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    openai = pytest.importorskip("openai")
    from kvquant_helpers import random_calibration
    from kvlab import LLM, SamplingParams
    from kvlab.cache.kvquant_calibration import save_calibration
    from kvlab.checkpoints.resolve import load_checkpoint

    path = str(tmp_path / "stories.kvquant.safetensors")
    save_calibration(random_calibration(load_checkpoint(STORIES).model.config), path)
    flags = ("--kv-cache-dtype", "kvquant4", "--kv-calibration", path, "--kv-cache-memory", "4MiB")
    served = Served(str(STORIES), *flags, "--max-num-seqs", "4")
    try:
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="none")
        answer = client.completions.create(model=served.name, prompt="Once upon a time", max_tokens=16,
                                           temperature=0).choices[0].text
    finally:
        assert served.stop() == 0
    llm = LLM(str(STORIES), kv_cache_dtype="kvquant4", kv_calibration=path, kv_cache_memory="4MiB", max_num_seqs=4)
    assert answer == llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text

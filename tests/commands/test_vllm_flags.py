"""vLLM's common flags on kvlab's commands, with their CPU meaning: --gpu-memory-utilization,
--tensor-parallel-size / --pipeline-parallel-size (1 only), and `kvlab generate --top-p`."""

import pytest
import torch

from kvlab.cli import main
from kvlab.engine import EngineConfig
from kvlab.engine.errors import RequestError
from kvlab.engine.memory_budget import utilization_budget
from kvlab.nn.generate import sample
from kvlab.nn.sampling import top_p_filter

from needs import STORIES, require_file


def test_gpu_memory_utilization_is_a_share_of_host_memory_less_what_the_process_holds():
    gib = 2**30
    assert utilization_budget(0.5, available=10 * gib, total=16 * gib, resident=1 * gib) == 7 * gib
    with pytest.raises(RequestError, match="only 3.00 GiB are free"):  # asks 8, the process 1 + 2 free
        utilization_budget(0.5, available=2 * gib, total=16 * gib, resident=1 * gib)
    with pytest.raises(RequestError, match="leaves nothing"):
        utilization_budget(0.05, available=10 * gib, total=16 * gib, resident=1 * gib)


@pytest.mark.parametrize("kwargs,param", [({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                          ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                                          ({"pipeline_parallel_size": 4}, "pipeline_parallel_size")])
def test_engine_config_refuses_what_one_cpu_process_cannot_do(kwargs, param):
    with pytest.raises(RequestError) as error:
        EngineConfig(**kwargs)
    assert error.value.param == param


def test_the_flags_reach_the_engine_and_a_refusal_is_one_line(capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    code = main(["bench", "throughput", str(STORIES), "--tensor-parallel-size", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "only 1 is supported" in err and len(err.strip().splitlines()) == 1
    code = main(["bench", "throughput", str(STORIES), "-tp", "1", "--gpu-memory-utilization", "0.0001",
                 "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--gpu-memory-utilization" in err and len(err.strip().splitlines()) == 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.8))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(top_p_filter(logits, 0.81))[0].tolist() == [True, True, True, False]
    draws = {int(sample(logits, 1.0, generator=torch.Generator().manual_seed(s), top_p=0.5)) for s in range(30)}
    assert draws == {0}


def test_generate_takes_top_p(capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    runs = []
    for _ in range(2):
        assert main(["generate", str(STORIES), "--prompt", "Once upon a time", "--max-tokens", "12",
                     "--temperature", "0.9", "--top-p", "0.5", "--seed", "3", "--threads", "1"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].startswith("Once upon a time")
    with pytest.raises(SystemExit):
        main(["generate", str(STORIES), "--top-p", "1.5"])
    assert "expected a number in (0, 1]" in capsys.readouterr().err

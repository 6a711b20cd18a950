"""The scheduler on its own, driven by a virtual clock: the batch-size-or-wait-cap rule and preemption."""

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import Scheduler, SchedulerConfig
from kvlab.engine.sequence import Sequence


def seq(name: str, arrival: float, prompt_len: int = 5, max_tokens: int = 4) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), arrival)


def test_a_batch_forms_when_full_or_when_the_oldest_has_waited_max_wait():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_wait_ms=100, max_model_len=64), BlockManager(32, 4))
    sched.add(seq("a", 0.0))
    sched.add(seq("b", 0.02))
    assert not sched.schedule(0.05) and sched.next_deadline() == 0.1
    assert [s.request_id for s in sched.schedule(0.1).seqs] == ["a", "b"]  # the oldest waited 100 ms
    sched2 = Scheduler(SchedulerConfig(max_num_seqs=3, max_wait_ms=1000, max_model_len=64), BlockManager(32, 4))
    for i in range(3):
        sched2.add(seq(f"r{i}", 0.0))
    assert len(sched2.schedule(0.001).seqs) == 3  # full: no need to wait


def test_zero_wait_admits_at_once_up_to_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64), BlockManager(32, 4))
    for i in range(3):
        sched.add(seq(f"r{i}", 0.0))
    assert [s.request_id for s in sched.schedule(0.0).seqs] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_out_of_blocks_preempts_the_newest_by_recompute():
    blocks = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=64), blocks)
    a, b = seq("a", 0.0, prompt_len=8, max_tokens=8), seq("b", 0.1, prompt_len=8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step = sched.schedule(0.2)
    assert step.num_tokens == [8, 8] and blocks.num_free == 0
    for s in step.seqs:  # as the runner would: all prompt tokens computed, one token sampled
        s.num_computed += 8
        s.output_ids.append(9)
    step = sched.schedule(0.3)  # each needs a 9th slot, a third block; only freeing b's two gives a one
    assert [s.request_id for s in step.seqs] == ["a"] and step.preempted == [b]
    assert b.num_computed == 0 and not b.block_table and sched.waiting[0] is b and b.preemptions == 1

"""How many threads a step runs on, chosen by measuring: all of them on a quiet machine, one when
the cores are shared.

The C step's threads meet at a few hundred OpenMP barriers per step (and torch's own products at
their own). On a quiet machine each barrier costs microseconds; when another process holds one of
the cores, a thread that waits at a barrier for a descheduled partner loses a scheduler quantum,
and a step slows far more than its fair share: SmolLM2's batch-1 decode ran at 2.6 tok/s beside
one busy process with two threads and at 83 with one (`kvlab measure`, an AMD EPYC with 2 cores).
One thread has no barriers to lose: beside a busy process it keeps about half its quiet speed.

`ThreadGovernor` picks per kind of step (a key the caller gives, e.g. decode at 4 rows) between
the machine's threads and one: it times each step, keeps a moving average per choice, runs the
other choice now and then to see whether the machine changed (after 16 steps, then twice as long
each time it loses again, up to 1,024, and never more often than keeps its runs to a tenth of the
time: on a shared machine one step on all threads can cost a hundred steps on one), and uses the
faster. One thread is tried first: on a quiet machine that first step costs under twice a step,
where the other order could cost a hundred. A large step (LARGE_STEP_TOKENS fed tokens or more:
a prompt, compute-bound, a few per run) is not governed and always runs on all threads: tried
on one thread first, a 2,048-token prefill of 16 requests cost 6.6 s against about 3 on two, a
third of a whole 16-request run (`kvlab bench shared-cpu` caught it), and beside a busy core its
few barriers cost it less than the lost core would. torch and the C
kernels share one OpenMP runtime (torch's libgomp is loaded first), so `torch.set_num_threads`
governs both. `KVLAB_THREADS=fixed` or an explicit thread count (`--threads N`, `threads=` in
`LLM(...)`, both through `fix_threads`) turns it off: every step then runs on the threads set.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Hashable, Iterator

import torch

FIRST_PROBE, LAST_PROBE = 16, 1024  # steps of one kind between runs of the other choice: doubled while it loses
PROBE_SHARE = 0.1  # at most this share of the time goes to runs of the losing choice
SMOOTHING = 0.3  # weight of the newest time in a choice's moving average
LARGE_STEP_TOKENS = 64  # steps feeding this many tokens or more try all threads first (module doc)
_FIXED: list[int] = []  # the thread count a user set (fix_threads), which turns the governor off


def fix_threads(threads: int) -> None:
    """Run every step on `threads` threads: the user chose, so no governor overrides it."""
    torch.set_num_threads(threads)
    _FIXED[:] = [threads]


def governed() -> bool:
    """Whether new governors choose per step (no `fix_threads` call, KVLAB_THREADS is not `fixed`)."""
    return not _FIXED and os.environ.get("KVLAB_THREADS", "adaptive") != "fixed"


class ThreadGovernor:
    """Chooses, per kind of step, the thread count that has been faster lately (module doc)."""

    def __init__(self, threads: int | None = None, adaptive: bool | None = None) -> None:
        self.threads = threads or torch.get_num_threads()
        if adaptive is None:
            adaptive = governed()
        self.adaptive = adaptive and self.threads > 1
        self.choices = (1, self.threads)  # one thread tried first (module doc)
        self.times: dict[Hashable, dict[int, float]] = {}
        self.waits: dict[Hashable, list[float]] = {}  # per kind: [steps to the next probe, the interval, its time]
        self.single_threaded_steps = 0  # how often one thread was chosen (provenance, tests)

    def best(self, key: Hashable) -> int | None:
        """The faster choice for `key` so far (None until both have run)."""
        seen = self.times.get(key, {})
        return min(self.choices, key=seen.__getitem__) if len(seen) == len(self.choices) else None

    def choose(self, key: Hashable) -> int:
        """The thread count for the next step of kind `key`."""
        if not self.adaptive:
            return self.threads
        seen = self.times.get(key, {})
        for threads in self.choices:  # each choice once before comparing
            if threads not in seen:
                return threads
        best = self.best(key)
        other = self.choices[1] if best == self.choices[0] else self.choices[0]
        steps, _, last = self.waits[key]
        if steps <= 0 and time.perf_counter() - last >= seen[other] / PROBE_SHARE:
            return other
        return best

    def record(self, key: Hashable, threads: int, seconds: float) -> None:
        """A step of kind `key` took `seconds` on `threads`. The choice in use is smoothed; a probe of
        the other one replaces its figure (the machine may have changed since it last ran)."""
        seen = self.times.setdefault(key, {})
        best = self.best(key)
        wait = self.waits.setdefault(key, [FIRST_PROBE, FIRST_PROBE, time.perf_counter()])
        if threads == best:
            seen[threads] = (1 - SMOOTHING) * seen[threads] + SMOOTHING * seconds
            wait[0] -= 1
        else:
            seen[threads] = seconds
            if best is not None:  # a probe: lost again, wait twice as long; won, start over
                wait[1] = min(LAST_PROBE, 2 * wait[1]) if self.best(key) == best else FIRST_PROBE
                wait[0], wait[2] = wait[1], time.perf_counter()
        self.single_threaded_steps += threads == 1

    @contextmanager
    def step(self, key: Hashable, tokens: int = 1) -> Iterator[int]:
        """Run the body (a step feeding `tokens` tokens) on the chosen threads, time it, restore the
        threads. A large step runs on all threads, unrecorded (module doc)."""
        large = tokens >= LARGE_STEP_TOKENS
        threads = self.threads if large else self.choose(key)
        if threads != self.threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
        finally:
            elapsed = time.perf_counter() - start
            if threads != self.threads:
                torch.set_num_threads(self.threads)
            if self.adaptive and not large:
                self.record(key, threads, elapsed)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the body's torch operations on one thread, then restore the count: for the small ones around
    a step (sampling over the vocabulary, logits processing), whose parallel regions gain little on a
    quiet machine and lose most on a shared one. Served, the event loop and the client wake at every
    token on the cores the step uses; a region that waits at its barrier for a descheduled partner
    then loses a scheduler quantum: sampling 16 rows of SmolLM2's 49,152 scores took 98 ms on two
    threads and 25 on one beside other work on an AMD EPYC with 2 cores, and a 16-row greedy argmax
    16 ms against 3."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def step_kind(rows: int, tokens: int) -> tuple[int, int]:
    """A coarse key for a step: rows and fed tokens in powers of two (steps of one kind cost alike)."""
    return rows.bit_length(), tokens.bit_length()

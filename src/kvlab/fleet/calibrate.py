"""`kvlab fleet calibrate`: time the real engine's steps here and fit the step cost the simulator uses.

The engine (kvlab.engine.LLMEngine, the one `kvlab serve` runs) is loaded with the settings of
the server to be predicted, prefix caching off so every measured prompt is really computed.
Decode: for each batch size and context, that many requests with random prompts are admitted
and their pure decode steps are timed one by one. Prefill: single prompts of each chunk size,
and the admission steps of the decode runs, give steps that feed prompt tokens. Each timed step
is stored with its shape, and two least-squares fits (kvlab.fleet.step_cost.LinearCost) are
written with provenance: a pure-decode one against batch and context, and one for steps with
prefill against tokens and attention pairs.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from kvlab.fleet.step_cost import LinearCost, chunk_pairs


def _shape(scheduled) -> dict:
    shape = {"decode_seqs": 0, "decode_ctx": 0, "prefill_tokens": 0, "prefill_pairs": 0}
    for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
        if n == 1 and seq.remaining == 1:
            shape["decode_seqs"] += 1
            shape["decode_ctx"] += seq.num_computed
        else:
            shape["prefill_tokens"] += n
            shape["prefill_pairs"] += chunk_pairs(seq.num_computed, n)
    return shape


def timed_steps(engine, limit: int) -> list[dict]:
    """Step `engine` up to `limit` times, timing each; the scheduler's choice is read before the step runs."""
    samples = []
    scheduler = engine.scheduler
    original = scheduler.schedule
    seen: list = []

    def spy(now):  # the step's shape, as the engine's own scheduler chose it
        step = original(now)
        seen.append(_shape(step))
        return step

    scheduler.schedule = spy
    try:
        for _ in range(limit):
            if not engine.has_unfinished():
                break
            started = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - started
            if seen and (seen[-1]["decode_seqs"] or seen[-1]["prefill_tokens"]):
                samples.append({**seen[-1], "seconds": seconds})
            seen.clear()
    finally:
        scheduler.schedule = original
    return samples


def measure(engine, batches: Sequence[int], contexts: Sequence[int], chunks: Sequence[int], decode_steps: int,
            seed: int = 0, progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    from kvlab.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    samples: list[dict] = []

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab - 100, size=n)]

    point = 0
    for chunk in chunks:  # one prompt, one prefill step (four times: the first warms the path)
        point += 1
        for attempt in range(4):
            seq = engine.add_request(prompt(chunk), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
            got = timed_steps(engine, 4)
            if attempt:
                samples += [dict(s, point=point) for s in got]
            engine.abort(seq.request_id)
        if progress:
            progress(f"prefill {chunk}")
    for context in contexts:
        for batch in batches:
            if batch * (context + decode_steps + 2) > engine.blocks.num_blocks * engine.blocks.block_size:
                continue
            seqs = [engine.add_request(prompt(context), SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True,
                                                                       temperature=0)) for _ in range(batch)]
            got = timed_steps(engine, 10_000)
            point += 1
            samples += [dict(s, point=point) if not s["prefill_tokens"] else s
                        for s in got if s["prefill_tokens"] or s["decode_seqs"] == batch]
            for seq in seqs:
                engine.abort(seq.request_id)
            if progress:
                progress(f"decode batch {batch} at {context}")
    return samples


def _medians(samples: list[dict]) -> list[dict]:
    """One row per step shape at batch x context granularity: the median time of its repeats.

    This machine is shared: a step now and then takes several times its usual time because another
    process held the cores. The median of a point's repeats is its typical cost; a spike is not.
    """
    groups: dict[tuple, list[dict]] = {}
    for index, s in enumerate(samples):  # repeats of one point share its "point" tag
        key = (s["point"], s["decode_seqs"], bool(s["prefill_tokens"])) if "point" in s else (index,)
        groups.setdefault(key, []).append(s)
    rows = []
    for group in groups.values():
        times = sorted(g["seconds"] for g in group)
        middle = group[len(group) // 2]
        rows.append({**{k: middle[k] for k in ("decode_seqs", "decode_ctx", "prefill_tokens", "prefill_pairs")},
                     "seconds": float(np.median(times)), "repeats": len(group)})
    return rows


def fit(samples: list[dict]) -> tuple[LinearCost, dict]:
    """Least squares per regime on per-point medians (negative coefficients clipped to 0 and the rest
    refitted; points more than 3x the median relative error off refitted without), and its error."""
    def solve(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
        keep = list(range(rows.shape[1]))
        while True:
            coef, *_ = np.linalg.lstsq(rows[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                full = np.zeros(rows.shape[1])
                full[keep] = np.maximum(coef, 0)
                return full
            keep.pop(int(np.argmin(coef)))

    rows = _medians(samples)
    decode = [s for s in rows if not s["prefill_tokens"]]
    mixed = [s for s in rows if s["prefill_tokens"]]
    if len(decode) < 3 or len(mixed) < 3:
        raise ValueError("too few timed steps to fit (need 3 decode and 3 prefill steps)")
    xd = np.array([[1, s["decode_seqs"], s["decode_ctx"]] for s in decode], float)
    yd = np.array([s["seconds"] for s in decode])
    xm = np.array([[1, s["prefill_tokens"] + s["decode_seqs"], s["prefill_pairs"] + s["decode_ctx"] + s["decode_seqs"]]
                   for s in mixed], float)
    ym = np.array([s["seconds"] for s in mixed])
    def robust(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, int]:
        coef = solve(x, y)
        error = np.abs(x @ coef - y) / y
        keep = error <= 3 * max(np.median(error), 0.05)
        if keep.sum() >= x.shape[1] + 1 and not keep.all():
            coef = solve(x[keep], y[keep])
        return coef, int((~keep).sum())

    (cd, dropped_d), (cm, dropped_m) = robust(xd, yd), robust(xm, ym)
    cost = LinearCost(*cd, *cm)
    err_d = np.abs(xd @ cd - yd) / yd
    err_m = np.abs(xm @ cm - ym) / ym
    quality = {"decode_points": len(decode), "prefill_points": len(mixed), "decode_outliers": dropped_d,
               "prefill_outliers": dropped_m,
               "decode_median_abs_error": float(np.median(err_d)),
               "decode_p90_abs_error": float(np.percentile(err_d, 90)),
               "prefill_median_abs_error": float(np.median(err_m)),
               "prefill_p90_abs_error": float(np.percentile(err_m, 90))}
    return cost, quality

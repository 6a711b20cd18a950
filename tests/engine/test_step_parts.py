"""A step in three parts (begin, run, end), so a server takes requests while the model runs."""

import asyncio
import threading

from engine_helpers import assert_pool_free, greedy, make_engine, reference, run_all


def test_a_request_added_while_the_model_runs_joins_the_next_step(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer)
    engine.add_request("Once upon a time", greedy(12), "a")
    planned = engine.begin_step()
    engine.add_request("The little dog", greedy(12), "b")  # between scheduling and the model's run
    assert [seq.request_id for seq in planned.scheduled.seqs] == ["a"]
    got: dict[str, list[int]] = {}
    for delta in engine.end_step(planned, engine.run_step(planned)):
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
    run_all(engine, got)
    for rid, prompt in (("a", "Once upon a time"), ("b", "The little dog")):
        assert got[rid] == reference(stories_model, stories_tokenizer, prompt, 12)
    assert_pool_free(engine)


def test_the_server_thread_takes_requests_and_defers_aborts_during_a_step(stories_model, stories_tokenizer):
    from kvlab.server.async_engine import AsyncEngine

    engine = make_engine(stories_model, stories_tokenizer)
    inside, release = threading.Event(), threading.Event()
    run = engine.runner.run

    def held_run(step):  # the first model run waits until the test lets it go
        if not release.is_set():
            inside.set()
            assert release.wait(30)
        return run(step)

    engine.runner.run = held_run
    server = AsyncEngine(engine)
    server.start()

    async def scenario():
        _, first = server.submit("Once upon a time", greedy(8), "first")
        assert await asyncio.to_thread(inside.wait, 30)  # the model is running the first step now
        _, second = server.submit("The little dog", greedy(8), "second")  # the lock is free: no wait
        server.abort("first")  # its blocks are being written: freed after the step
        assert server.stepping and server.deferred_aborts == ["first"] and "first" in engine.requests
        release.set()
        tokens = []
        while True:
            delta = await asyncio.wait_for(second.get(), 30)
            tokens += delta.token_ids
            if delta.finished:
                return tokens

    try:
        tokens = asyncio.run(scenario())
    finally:
        release.set()
        server.stop()
    assert tokens == reference(stories_model, stories_tokenizer, "The little dog", 8)
    assert_pool_free(engine)

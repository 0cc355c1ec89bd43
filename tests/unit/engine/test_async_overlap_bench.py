"""benchmarks/async_overlap.py at a tiny size, so the harness cannot rot silently: the
stand-in's device time is inside every timed step, every timed step decodes one token
per sequence, and the report (rounds, table, profile) prints."""
from __future__ import annotations

from benchmarks import async_overlap

T = 0.001  # the stand-in's device time: the only wait in these tests


def test_measure_times_decode_steps_around_the_stand_in(tmp_path):
    model = async_overlap.write_model(tmp_path, vocab=64)
    engine = async_overlap.build_engine(model, "sync", max_batch=4, max_model_len=32, device_s=T)
    assert not engine.executor.threaded
    try:
        r = async_overlap.measure(engine, "sync", 4, steps=5, warmup=1, prompt_len=4)
        assert not engine.has_unfinished()
    finally:
        engine.close()
    assert len(r.step_s) == 5 and len(r.device_s) == 5
    assert r.tokens == 4 * 5
    assert min(r.device_s) >= T and min(r.step_s) >= T  # the device wait is part of each timed step
    assert all(step >= dev for step, dev in zip(r.step_s, r.device_s))
    # prefill, 1 warm-up, 5 timed, the finishing step: one forward each
    assert engine.runner.model.forwards == 1 + 1 + 5 + 1


def test_main_prints_rounds_table_and_profile(capsys):
    assert async_overlap.main(["--batches", "1", "3", "--rounds", "1", "--steps", "3", "--warmup", "1",
                               "--device-ms", "1", "--vocab", "64", "--profile", "3", "--profile-top", "5"]) == 0
    out = capsys.readouterr().out
    assert "round 0   sync batch    1" in out and "round 0   sync batch    3" in out
    assert "round 0  async batch    1" in out and "x" in out.split("medians over rounds")[1]
    assert "medians over rounds" in out
    assert "host time per decode step at batch 3" in out and "cProfile over 3 decode steps" in out


def test_async_mode_overlaps_and_decodes_the_same_tokens(tmp_path):
    """The async mode plans each step while the previous one runs: every timed step
    still gives one token per sequence, no forward is wasted (length is known ahead),
    and the engine counts the steps as overlapped."""
    model = async_overlap.write_model(tmp_path, vocab=64)
    engine = async_overlap.build_engine(model, "async", max_batch=4, max_model_len=32, device_s=T)
    try:
        assert engine.executor.threaded
        r = async_overlap.measure(engine, "async", 4, steps=5, warmup=1, prompt_len=4)
        assert not engine.has_unfinished()
    finally:
        engine.close()
    assert r.tokens == 4 * 5 and len(r.step_s) == 5
    assert engine.runner.model.forwards == 1 + 1 + 5 + 1
    assert engine.step_counts["overlapped"] == 1 + 1 + 5 + 1 and not engine.step_counts["synchronous"]


def test_queued_device_model_waits_at_the_host_copy(tmp_path):
    """The queued (GPU-like) stand-in: the forward call returns at once, and each step's
    results are collected no earlier than its forward's completion -- so a synchronous
    step still takes at least T, and the device work queued by consecutive steps runs
    back to back (T each, whatever the host does meanwhile)."""
    import time

    model = async_overlap.write_model(tmp_path, vocab=64)
    for mode in ("sync", "async"):
        engine = async_overlap.build_engine(model, mode, max_batch=4, max_model_len=32, device_s=T,
                                            device_model="queue")
        stand_in = engine.runner.model
        assert isinstance(stand_in, async_overlap.QueuedDeviceStandIn)
        started = time.perf_counter()
        stand_in(engine.runner.model._hidden[:1], None, None, None)  # a bare call queues, does not wait
        assert time.perf_counter() - started < T
        try:
            r = async_overlap.measure(engine, mode, 4, steps=5, warmup=1, prompt_len=4)
            assert not engine.has_unfinished()
        finally:
            engine.close()
        assert r.tokens == 4 * 5
        # Five timed steps queue five forwards of T back to back: the timed loop cannot
        # finish before the device did (the last collect waits for it).
        assert sum(r.step_s) >= 4 * T
        if mode == "sync":
            assert min(r.step_s) >= T  # each step waits for its own forward


def test_main_runs_each_device_model(capsys):
    assert async_overlap.main(["--batches", "2", "--rounds", "1", "--steps", "2", "--warmup", "1",
                               "--device-ms", "1", "--vocab", "64", "--device-models", "sleep", "queue"]) == 0
    out = capsys.readouterr().out
    assert "device model 'sleep'" in out and "device model 'queue'" in out
    assert out.count("medians over rounds") == 2

"""inproc.step drives a scheduler as EngineCore does, including where EngineCore waits.

EngineCore.step and step_with_batch_queue (vLLM 0.32 v1/engine/core.py) block on the model's
output (`future.result()`) between schedule() and update_from_output(); bench.scale's device
wait (`Shape.gpu_wait_s`) is a sleep in that place, and a settler thread works there.
"""

from __future__ import annotations

import pytest

from engine_integration import inproc


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_device_wait_falls_between_schedule_and_update_from_output(async_scheduling: bool) -> None:
    with inproc.running_scheduler(num_blocks=64, kvhint=False, async_scheduling=async_scheduling) as scheduler:
        calls: list[str] = []
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def scheduled(*a, **k):  # type: ignore[no-untyped-def]
            calls.append("schedule")
            return schedule(*a, **k)

        def updated(*a, **k):  # type: ignore[no-untyped-def]
            calls.append("update")
            return update(*a, **k)

        scheduler.schedule, scheduler.update_from_output = scheduled, updated
        scheduler.add_request(inproc.make_request("r0", list(range(40)), max_tokens=4))
        for _ in range(8):
            inproc.step(scheduler, device_wait=lambda: calls.append("wait"))
        assert calls.count("update") >= 4
        # Every output delivered was waited for first, and only then: the wait comes right
        # before each update_from_output, after the schedule() that produced the batch.
        for i, call in enumerate(calls):
            if call == "update":
                assert calls[i - 1] == "wait"
            if call == "wait":
                assert calls[i + 1] == "update" and "schedule" in calls[:i]

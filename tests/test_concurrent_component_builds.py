"""Component builds are serialised across the process.

The engine loads a task's components on worker threads (so a first request's weight load
does not stall the event loop), and a seeded random init re-seeds torch's global RNG: two
instances built at once would each draw from the other's seed. ``ModelInstance`` holds one
process-wide lock over every build, so concurrent loads give the weights a lone load gives.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

import fv_kernel.model.instance as instance_module
from fv_kernel.api import InstanceOptions, ModelInstance
from fv_kernel.testing.toy import toy_card


def _instance(seed: int, seeded: threading.Event, other_seeded: threading.Event, wait: float) -> ModelInstance:
    """An instance whose one component is a seeded draw that yields between seeding and drawing,
    as a real init does (it allocates and initialises module after module)."""

    def load(component_id: str) -> torch.Tensor:
        # Seeds the global RNG as a real init does (no fork_rng here: restoring the state on exit
        # would hide the smear whenever the other build exits first). The test forks it around both.
        torch.manual_seed(seed)
        seeded.set()
        # Without the lock the other build seeds in this window; with it, the first build waits
        # it out alone (the other cannot seed before this build ends, so any wait is correct).
        other_seeded.wait(wait)
        time.sleep(0.05)
        return torch.randn(8)

    return ModelInstance(card=toy_card("toy-dit"), options=InstanceOptions(), component_loader=load, ops_builder=lambda _: {})


def _build_two_at_once(wait: float) -> tuple[torch.Tensor, torch.Tensor]:
    first_seeded, second_seeded = threading.Event(), threading.Event()
    instances = (_instance(1, first_seeded, second_seeded, wait), _instance(2, second_seeded, first_seeded, wait))
    threads = [threading.Thread(target=i.component, args=("dit",)) for i in instances]
    with torch.random.fork_rng():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    return instances[0].components["dit"], instances[1].components["dit"]


def _alone(seed: int) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.randn(8)


def test_concurrent_seeded_builds_equal_lone_builds() -> None:
    first, second = _build_two_at_once(wait=1.0)
    assert torch.equal(first, _alone(1)) and torch.equal(second, _alone(2))


def test_negative_control_without_the_process_lock_builds_smear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instance_module, "_COMPONENT_BUILDS", contextlib.nullcontext())
    # Without the lock nothing stops the other build from seeding: wait for it, however loaded the machine.
    first, second = _build_two_at_once(wait=60.0)
    assert not (torch.equal(first, _alone(1)) and torch.equal(second, _alone(2)))

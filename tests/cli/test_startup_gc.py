"""stagewise.startup_gc: a command pauses the cyclic collector while it starts, then freezes what
start-up left and collects again."""

import gc

import pytest

from stagewise import startup_gc


@pytest.fixture
def collector():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()  # back into the oldest generation
    startup_gc._paused = False
    gc.enable() if was else gc.disable()


def test_pause_then_settle_freezes_start_up_and_collects_again(collector):
    startup_gc.pause()
    assert not gc.isenabled()
    start_up = [[i] for i in range(1000)]  # long-lived objects made while starting
    frozen_before = gc.get_freeze_count()
    startup_gc.settle()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(start_up)
    assert not any(gc.is_tracked(x) and x in gc.get_objects(generation=2) for x in start_up[:3])
    startup_gc.settle()  # twice: nothing more happens
    assert gc.isenabled()


def test_settle_without_pause_changes_nothing(collector):
    frozen = gc.get_freeze_count()
    startup_gc.settle()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_collector_the_caller_turned_off_stays_off(collector):
    gc.disable()
    frozen = gc.get_freeze_count()
    startup_gc.pause()
    startup_gc.settle()
    assert not gc.isenabled() and gc.get_freeze_count() == frozen

"""The trainer's estimate of what a stop signal costs against its launcher's grace
(megatron_klear/training/stop_grace.py); the line it prints from a real run is checked in
tests/distributed/test_preemption.py."""

from megatron_klear.training.stop_grace import StopGrace


def test_rl_counts_its_update_or_push_and_sft_its_whole_step_plus_the_last_save():
    rl = StopGrace(300.0)
    rl.step({"time/train_s": 120.0, "time/weight_sync_s": 8.0}, wall_s=1500.0)  # generation: cut, not counted
    rl.step({"time/train_s": 90.0, "time/weight_sync_s": 140.0}, wall_s=1400.0)
    assert (rl.uncut_what, rl.uncut_s) == ("a push", 140.0)
    assert rl.cost_s is None and rl.saved(100.0) is None  # 240 s <= 300 s
    line = rl.saved(170.0)  # a slower save: 310 s > 300 s
    assert line.startswith("warning: a stop signal can now cost 310 s (a push 140 s")
    assert "SHUTDOWN_TIMEOUT=300 s" in line and "170 s as the last one took" in line
    assert rl.saved(500.0) is None  # said once
    sft = StopGrace(60.0)
    sft.step({"loss": 1.0}, wall_s=45.0)
    assert sft.saved(20.0).startswith("warning: a stop signal can now cost 65 s (a step 45 s")


def test_the_grace_comes_from_the_launchers_variable_and_unknown_says_nothing():
    assert StopGrace.from_env({"SHUTDOWN_TIMEOUT": "540"}).grace_s == 540.0
    for env in ({}, {"SHUTDOWN_TIMEOUT": ""}, {"SHUTDOWN_TIMEOUT": "soon"}):
        g = StopGrace.from_env(env)
        g.step({}, wall_s=1e6)
        assert g.grace_s is None and g.saved(1e6) is None

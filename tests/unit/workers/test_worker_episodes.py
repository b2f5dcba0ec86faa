"""Episodes played on a rollout worker (a real worker process; the trainer in this process, one rank): an
environment that fails under env_errors 'stop' stops the run with the row and the environment's own message, the
same error the trainer's ranks raise when they play the episodes themselves (tests/unit/envs/test_episodes.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer"))
from _support import RolloutWorkers, free_address  # noqa: E402
from _trainer_args import train_args  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.trainer import build_trainer  # noqa: E402


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_failing_environment_on_a_worker_stops_the_run_naming_the_row(tiny, dist_single, tmp_path, staleness):
    address = free_address()
    workers = RolloutWorkers(str(tmp_path), [address], delay=0.0)
    trainer = None
    try:
        trainer = build_trainer(parse_args(train_args(
            tiny, str(tmp_path / "run"), environment="_envs:raising", max_turns=2, max_steps=2,
            per_device_generation_batch_size=2, per_device_training_batch_size=2, rollout_workers=1,
            rollout_address=address, max_staleness=staleness, rollout_timeout_s=60)))
        with pytest.raises(Exception, match=r"iteration 0: environment step 1 for row 0 \(prompt .*the tool is "
                                            r"broken"):
            trainer.step()
    finally:
        if trainer is not None:
            trainer.engine.generator.close()  # what the run's shutdown does: the worker is told to stop
        codes = workers.wait()
    assert codes == [0]  # the worker answered the failure and stopped when told, not crashed

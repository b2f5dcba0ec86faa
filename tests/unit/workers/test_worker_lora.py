"""A LoRA actor's rollouts from a worker (a real worker process; the trainer in this process, one rank): the
broadcast carries the adapter merged into the plain weights, so after an update the worker samples what the
trainer scores (its generation-time log-probs equal the trainer's recompute) and the run equals the colocated one."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer"))
from _support import RolloutWorkers, free_address  # noqa: E402
from _trainer_args import train_args  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.trainer import build_trainer  # noqa: E402

FLAGS = dict(actor_lora_dim=4, actor_lora_alpha=8.0, actor_learning_rate=3e-2, critic_learning_rate=1e-3,
             do_sample="false", max_steps=2, seed=3, per_device_generation_batch_size=4,
             per_device_training_batch_size=2)
VOLATILE = ("time/", "throughput/", "memory/")


def test_a_lora_actor_through_a_worker_equals_the_colocated_run(tiny, dist_single, tmp_path):
    colocated = build_trainer(parse_args(train_args(tiny, str(tmp_path / "colocated"), **FLAGS))).train()
    address = free_address()
    workers = RolloutWorkers(str(tmp_path), [address], delay=0.0)
    trainer = None
    try:
        trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path / "worker"), rollout_workers=1,
                                                      rollout_address=address, **FLAGS)))
        remote = trainer.train()
    finally:
        if trainer is not None:
            trainer.engine.generator.close()
        codes = workers.wait()
    assert codes == [0]
    # the adapter moved the policy after the first update (against the base model as reference)...
    assert remote[1]["objective/kl"] > 1e-4 and remote[1]["rollout/logprob_diff_max"] < 1e-5
    # ...and the worker decoded with it: every metric of both iterations equals the colocated run's
    for a, b in zip(remote, colocated, strict=True):
        for k, v in b.items():
            if not k.startswith(VOLATILE) and isinstance(v, float):
                assert abs(a[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, a[k], v)

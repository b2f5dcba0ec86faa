from rlhf_engine.trainer.evaluation import Evaluator


class _DS:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_eval_shards_are_equal_sized_and_count_each_prompt_once():
    n, world = 7, 3
    shards = [Evaluator(_DS(n), 2, r, world) for r in range(world)]
    assert [len(s.indices) for s in shards] == [3, 3, 3]  # same number of generate calls on every rank
    counted = [i for s in shards for i, real in zip(s.indices, s.real) if real]
    assert sorted(counted) == list(range(n))  # repeats fill the last shard but are not counted
    assert sum(not r for s in shards for r in s.real) == 2


def test_an_evaluation_call_takes_as_many_prompts_as_a_training_call_has_rows():
    """One greedy response per prompt: the eval's calls hold the rows the memory plan budgets for a generate call
    (prompts x n_samples_per_prompt), not the training call's prompt count (4x the calls at 4 samples)."""
    from types import SimpleNamespace

    from rlhf_engine.config.generation import BatchConfig
    from rlhf_engine.trainer.ppo_setup import evaluator

    batch = BatchConfig(per_device_generation_batch_size=8, n_samples_per_prompt=4)
    plan = SimpleNamespace(eval_prompts=_DS(40), cfg=SimpleNamespace(batch=batch))
    ev = evaluator(plan, SimpleNamespace(dist=SimpleNamespace(rank=1, world_size=2)))
    assert ev.batch_size == 32 and len(ev.indices) == 20
    assert evaluator(SimpleNamespace(eval_prompts=None, cfg=plan.cfg), None) is None

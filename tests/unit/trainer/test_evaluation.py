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

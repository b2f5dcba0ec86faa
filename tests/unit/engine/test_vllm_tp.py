"""engine/generation/vllm_tp.py: which ranks share an engine, how a group's requests are merged and its answers
handed back, the plan's refusals of a tensor-parallel size that cannot split the run (each naming the flag), and the
KV budget of one member. The real engine at tensor parallel 2 runs in the vLLM job (test_vllm_training.py); the
group's collectives on real ranks in tests/distributed/test_engine_groups.py."""
import pytest
from transformers import LlamaConfig

from rlhf_engine.config import TrainConfig
from rlhf_engine.errors import ConfigError
from rlhf_engine.engine.generation.vllm_memory import default_kv_cache_bytes, kv_bytes_per_token
from rlhf_engine.engine.generation.vllm_tp import group_members, local_world_size, merge, own_slice, tp_problems


def test_groups_are_consecutive_ranks():
    assert group_members(0, 2) == [0, 1] and group_members(1, 2) == [0, 1] and group_members(5, 2) == [4, 5]
    assert group_members(6, 4) == [4, 5, 6, 7] and group_members(3, 1) == [3]


def test_merge_keeps_member_order_and_each_member_gets_its_own_rows_back():
    per_member = [([[1, 2], [3]], [4, 5], [11, 12]), ([], [], []), ([[6]], [7], [13])]
    prompts, limits, seeds, counts = merge(per_member)
    assert (prompts, limits, seeds, counts) == ([[1, 2], [3], [6]], [4, 5, 7], [11, 12, 13], [2, 0, 1])
    answers = ["a", "b", "c"]
    assert [own_slice(answers, counts, i) for i in range(3)] == [["a", "b"], [], ["c"]]
    with pytest.raises(ValueError, match="answered 2 rows for 3 requests"):
        own_slice(answers[:2], counts, 0)
    with pytest.raises(ValueError, match="disagree in length"):
        merge([([[1]], [4, 5], [1])])


@pytest.mark.parametrize("size, world, backend, heads, kv, servers, local, fix", [
    (2, 4, "vllm", 4, 4, False, None, None),
    (2, 4, "vllm", 4, 1, False, None, None),  # one KV head, replicated on both members
    (1, 3, "lean", 3, 3, False, None, None),  # 1: nothing to check whatever the backend
    (2, 3, "vllm", 4, 4, False, None, "3 ranks do not split"),
    (4, 8, "vllm", 4, 4, False, 2, "span two nodes"),
    (2, 4, "vllm", 6, 3, False, None, "3 key-value heads"),
    (4, 4, "vllm", 6, 6, False, None, "6 attention heads"),
    (2, 4, "lean", 4, 4, False, None, "generation_backend vllm"),
    (2, 4, "vllm", 4, 4, True, None, "--tensor-parallel-size"),
])
def test_the_plan_refuses_a_size_that_cannot_split_the_run(size, world, backend, heads, kv, servers, local, fix):
    config = LlamaConfig(hidden_size=32 * heads, num_attention_heads=heads, num_key_value_heads=kv)
    found = tp_problems(size, world, backend, config, servers, local)
    if fix is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0][:2] == ("vllm_tensor_parallel_size", size) and fix in found[0][2], found


def test_a_member_holds_its_share_of_the_kv_heads_for_its_group_s_rows():
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert kv_bytes_per_token(cfg, 4) == 2 * 2 * 2 * 32 * 4  # keys and values, layers, KV heads, head size, fp32
    assert kv_bytes_per_token(cfg, 4, tp=2) == 2 * 2 * 1 * 32 * 4
    assert kv_bytes_per_token(cfg, 4, tp=4) == 2 * 2 * 1 * 32 * 4  # 2 KV heads over 4 members: replicated, one each
    # 80 rows per rank, 2 ranks to the group: 160 rows of 100 tokens, one 128-token block each plus one, a quarter
    # more
    assert default_kv_cache_bytes(cfg, 4, rows=80, max_len=100, tp=2) == int(1.25 * 160 * 2 * 128 * 512)


def test_the_flag_is_a_positive_whole_number():
    for bad in (0, 1.5):
        cfg = TrainConfig()
        cfg.actor.model_name_or_path = "some/actor"
        cfg.engine.vllm_tensor_parallel_size = bad
        with pytest.raises(ConfigError, match="vllm_tensor_parallel_size"):
            cfg.validate()


def test_the_ranks_of_a_node_as_either_launcher_says():
    assert local_world_size({"LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun, our SLURM environment
    assert local_world_size({"LOCAL_SIZE": "4"}) == 4  # the deepspeed launcher
    assert local_world_size({}) is None and local_world_size({"LOCAL_SIZE": "x"}) is None

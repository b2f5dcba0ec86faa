"""Engine extensions on 2 ranks (one launch of tests/distributed/scripts/engine_ext_checks.py): LoRA at ZeRO 2 and
3 (only adapters train, reference = base model, merged exports), the EMA of a ZeRO-3 actor (closed form, local
partition updates, export), and ZeRO-3 generation by both backends held whole (replica, gather-once) or fetched per
layer (collective counts, equal outputs, the replica after training, ranks that stop at different lengths). The same checks at ZeRO 0, gradient checkpointing and the Hybrid Engine's CPU refusal
run in process: tests/unit/engine/test_lora_ema.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from _support import SCRIPTS, check, launch, make_tiny_setup

TOL = 1e-5


def sharpen(model_dir: str, factor: float = 6.0) -> None:
    """Scale the weight matrices of the causal LM in `model_dir` so that greedy decoding is not one repeated token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_ext")
    setup = make_tiny_setup(str(root / "models"), arch="gpt2", pad_is_eos=True, n_prompts=4)
    sharpen(setup.actor)
    out = str(root / "result.json")
    proc = launch(os.path.join(SCRIPTS, "engine_ext_checks.py"),
                  ["--actor", setup.actor, "--reward", setup.reward, "--out", out, "--workdir", str(root)],
                  nproc=2, launcher="fork", timeout=300, env={"TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")})
    if proc.returncode != 0:
        text = proc.stdout + "\n" + proc.stderr
        at = text.find("Traceback")
        if at >= 0:
            raise AssertionError(f"engine_ext_checks.py failed (rc={proc.returncode}):\n{text[at:at + 5000]}")
    check(proc)
    with open(out) as f:
        return json.load(f)


# ---- LoRA ------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name,stage,wrapper", [("lora_z2", 2, "DeepSpeedZeroOptimizer"),
                                                ("lora_z3", 3, "DeepSpeedZeroOptimizer_Stage3")])
def test_lora_trains_only_the_adapters(ext, name, stage, wrapper):
    res = ext[name]
    assert ext["world_size"] == 2
    assert res["engines"] == ["actor", "critic", "reward"]  # no reference engine: the actor without its adapter
    assert res["stages"]["actor"] == stage and res["wrapper"] == wrapper
    for role in ("actor", "critic"):
        keys = res["keys"][role]
        adapters = {k for k in keys if "lora_" in k}
        head = {k for k in keys if k.endswith("score.weight") or k == "head.weight"} if role == "critic" else set()
        assert adapters and all(n in adapters or n.endswith("score.weight") for n in res["trainable"][role])
        changed = set(res["changed"][role])
        assert changed == adapters | head, (role, sorted(changed ^ (adapters | head)))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["lora_z2", "lora_z3"])
def test_lora_reference_is_the_base_model_and_exports_are_merged(ext, name):
    res = ext[name]
    assert max(res["ref_vs_base"]) <= TOL, res["ref_vs_base"]  # every rank, after two steps
    assert min(res["actor_vs_base"]) > 1e-3  # the adapter moved the actor
    assert all(res["requires_grad_after_ref"])
    ex = res["export"]
    assert "error" not in ex, ex.get("error")
    assert ex["adapter_keys"] == []
    assert ex["actor_max_diff"] <= TOL and ex["critic_max_diff"] <= TOL, ex


# ---- EMA -------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_ema_of_a_zero3_actor_is_the_closed_form_average(ext):
    res = ext["z3_ema"]
    assert res["stages"]["ema"] == 3 and res["ema_wrapper"] == "DeepSpeedZeRoOffload"
    assert all(res["partitions_equal"])  # each rank updates its own partition from the actor's same one
    assert res["partition_numel"][0] > 0
    assert res["updated"] == [True, True, True]
    assert res["ema_keys_equal_actor_keys"]
    assert res["ema_closed_form_max_diff"] <= 1e-6, res["ema_closed_form_max_diff"]
    assert res["ema_vs_last_actor_max_diff"] > 1e-4  # negative control: the EMA is not the last actor
    assert res["ema_export_max_diff"] == 0.0
    assert res["ema_forward_vs_export"] <= TOL  # the engine's own forward uses the updated weights


# ---- gather-once generation ------------------------------------------------------------------------------------
def _gathers(counts: dict) -> int:
    return sum(v for k, v in counts.items() if "gather" in k)


HELD_COLLECTIVES = {"ds.all_gather_into_tensor", "ds.all_gather"}  # the gathers of the weights, nothing else


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["hf", "lean"])
def test_zero3_generation_modes_fetch_once_per_call_and_agree(ext, backend):
    res = ext["z3_ema"]
    for rank, gen in enumerate(res["generation"]):
        run = {f"{m}_{n}": gen[f"{backend}_{m}_{n}"] for m in ("off", "on", "replica") for n in (2, 8)}
        assert [run[f"{m}_2"]["mode"] for m in ("off", "on", "replica")] == ["per_layer", "gathered", "replica"]
        # the same greedy tokens every way, and the same as the other backend
        for n in (2, 8):
            assert run[f"on_{n}"]["responses"] == run[f"off_{n}"]["responses"] == run[f"replica_{n}"]["responses"]
            assert run[f"off_{n}"]["responses"] == gen[f"hf_off_{n}"]["responses"], (rank, backend, n)
        assert len(run["on_8"]["responses"][0]) >= 7  # up to 8 new tokens really were generated
        per_layer = [_gathers(run[f"off_{n}"]["counts"]) for n in (2, 8)]
        # per-layer: every new token fetches every layer again (and the ranks agree once per token to stop together)
        assert per_layer[1] >= 8 * res["layers"] and per_layer[1] - per_layer[0] >= 6 * res["layers"], per_layer
        assert run["off_8"]["counts"].get("torch.all_reduce", 0) >= 7
        for mode in ("on", "replica"):
            # held whole: each parameter gathered once per call (DeepSpeed gathers a list parameter by parameter),
            # whatever the number of tokens, and no other collective
            once = [_gathers(run[f"{mode}_{n}"]["counts"]) for n in (2, 8)]
            assert once[0] == once[1] == res["actor_params"], (rank, mode, once, res["actor_params"])
            assert per_layer[1] > 4 * once[1]
            assert set(run[f"{mode}_8"]["counts"]) <= HELD_COLLECTIVES, run[f"{mode}_8"]["counts"]


@pytest.mark.distributed
def test_the_replica_follows_training(ext):
    for gen in ext["z3_ema"]["generation"]:
        after, before = gen["trained_replica"], gen["lean_replica_8"]
        assert after["responses"] == gen["trained_off"]["responses"]
        assert torch.allclose(torch.tensor(after["logprobs"]), torch.tensor(gen["trained_off"]["logprobs"]), atol=TOL)
        # negative control: the step did change the model (a stale replica would still give `before`)
        if after["responses"] == before["responses"]:
            assert (torch.tensor(after["logprobs"]) - torch.tensor(before["logprobs"])).abs().max() > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["hf_on", "lean_replica"])
def test_held_actor_ranks_may_stop_at_different_lengths(ext, run):
    uneven = [u[run] for u in ext["z3_ema"]["uneven"]]
    assert [u["max_new"] for u in uneven] == [1, 8]
    assert uneven[0]["width"] == 1 and uneven[1]["width"] > 2  # rank 0 finished first; nobody waited for anybody
    for u, gen in zip(uneven, ext["z3_ema"]["generation"]):
        assert set(u["counts"]) <= HELD_COLLECTIVES, u["counts"]
        # the prefixes of the same model's 8-token responses (these calls follow the extra training step)
        assert [row[: len(r)] for row, r in zip(gen["trained_off"]["responses"], u["responses"])] == u["responses"]



@pytest.mark.distributed
def test_a_replica_that_fails_on_one_rank_sends_every_rank_to_the_same_path(ext):
    """The replica cannot be built on rank 1 only (an injected out-of-memory error): both ranks decide together and
    gather in place, and the launch finishes (a rank left on the replica path would wait in a collective the other
    never enters, until the launch's timeout)."""
    runs = ext["z3_ema"]["replica_fails_on_rank1"]
    assert [r["mode"] for r in runs] == ["gathered", "gathered"]
    assert runs[0]["error"] == "another rank could not build its replica"
    assert runs[1]["error"].startswith("OutOfMemoryError: injected on rank 1")
    for r in runs:
        assert r["responses"] == r["gathered"]

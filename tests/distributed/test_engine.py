"""RLHFEngine: placements (ZeRO 0/2/3, mixed, offload), cross-placement agreement, generation, training, exports, and
the positions where log-probs, values and scores are read.

Two multi-rank launches (tiny GPT-2 with pad == EOS and absolute positions; tiny Llama with rotary positions and
pad != EOS) run tests/distributed/scripts/engine_checks.py, which builds the placements one after the other and writes
its raw numbers to a JSON file; the tests below assert on them. The position tests at the end run in this process on
one rank.

The actors' weights are scaled up (x6) after random init so that greedy decoding is not one token repeated: a tiny
random model with the default init just echoes its last prompt token, which makes "same tokens" a weak check.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from _support import SCRIPTS, check, launch, make_tiny_setup

TOL = 1e-5
GPT2_PLACEMENTS = ["z0", "z2", "z3", "mixed", "z2off", "z3off"]
LLAMA_PLACEMENTS = ["z0", "z3", "mixed"]
EXPECTED = {  # placement -> {role: (stage, optimizer wrapper, offload optimizer, offload params)}
    "z0": {"actor": (0, "AdamW", False, False), "critic": (0, "AdamW", False, False),
           "reference": (0, None, False, False), "reward": (0, None, False, False)},
    "z2": {"actor": (2, "DeepSpeedZeroOptimizer", False, False), "critic": (2, "DeepSpeedZeroOptimizer", False, False),
           "reference": (0, None, False, False), "reward": (0, None, False, False)},
    "z3": {"actor": (3, "DeepSpeedZeroOptimizer_Stage3", False, False),
           "critic": (3, "DeepSpeedZeroOptimizer_Stage3", False, False),
           "reference": (3, "DeepSpeedZeRoOffload", False, False), "reward": (3, "DeepSpeedZeRoOffload", False, False)},
    # actor 3 / critic 2: the reference follows the actor (3), the reward the critic (2 -> 0: eval-only is 0 or 3)
    "mixed": {"actor": (3, "DeepSpeedZeroOptimizer_Stage3", False, False),
              "critic": (2, "DeepSpeedZeroOptimizer", False, False),
              "reference": (3, "DeepSpeedZeRoOffload", False, False), "reward": (0, None, False, False)},
    "z2off": {"actor": (2, "DeepSpeedZeroOptimizer", True, False), "critic": (2, "DeepSpeedZeroOptimizer", True, False),
              "reference": (0, None, False, False), "reward": (0, None, False, False)},
    "z3off": {"actor": (3, "DeepSpeedZeroOptimizer_Stage3", True, True),
              "critic": (3, "DeepSpeedZeroOptimizer_Stage3", True, False),
              "reference": (3, "DeepSpeedZeRoOffload", False, True), "reward": (3, "DeepSpeedZeRoOffload", False, False)},
}


def sharpen(model_dir: str, factor: float = 6.0) -> None:
    """Scale every weight matrix of the causal LM in `model_dir` (in place)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    model.save_pretrained(model_dir)


def _default_ext_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")


def _listing(path: str):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


def run_checks(root, arch: str, placements: list, export: list, alone: list, negative_control: bool) -> dict:
    setup = make_tiny_setup(str(root / "models"), arch=arch, pad_is_eos=arch == "gpt2", n_prompts=4)
    sharpen(setup.actor)
    out = str(root / "result.json")
    ext_dir = str(root / "torch_extensions")  # must stay absent: no C++ op may be JIT-built (shm comm, adam, ...)
    default_before = _listing(_default_ext_dir())
    args = ["--actor", setup.actor, "--reward", setup.reward, "--out", out, "--workdir", str(root),
            "--placements", ",".join(placements), "--export", ",".join(export), "--alone", ",".join(alone)]
    if negative_control:
        args.append("--negative_control")
    proc = launch(os.path.join(SCRIPTS, "engine_checks.py"), args, nproc=2, launcher="fork", timeout=420,
                  env={"TORCH_EXTENSIONS_DIR": ext_dir})
    if proc.returncode != 0:  # show the first rank's traceback, not only the tail of the launcher's log
        text = proc.stdout + "\n" + proc.stderr
        at = text.find("Traceback")
        if at >= 0:
            raise AssertionError(f"engine_checks.py failed (rc={proc.returncode}):\n{text[at:at + 5000]}")
    check(proc)
    with open(out) as f:
        res = json.load(f)
    res["_ext_dir_after"] = _listing(ext_dir)
    res["_default_ext"] = (default_before, _listing(_default_ext_dir()))
    res["_stdout_tail"] = proc.stdout[-2000:]
    return res


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    return run_checks(tmp_path_factory.mktemp("engine_gpt2"), "gpt2", GPT2_PLACEMENTS, export=["z0", "z3"],
                      alone=["z0", "z3"], negative_control=True)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return run_checks(tmp_path_factory.mktemp("engine_llama"), "llama", LLAMA_PLACEMENTS, export=["z3"],
                      alone=["z0"], negative_control=False)  # rotary: a uniform position shift changes nothing


@pytest.fixture(params=["gpt2", "llama"])
def run(request):
    return request.getfixturevalue(f"{request.param}_run")


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---- building ------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_placements_build_with_the_right_optimizers_and_no_jit(run):
    assert run["world_size"] == 2
    for name, res in run["placements"].items():
        for role, (stage, wrapper, off_opt, off_param) in EXPECTED[name].items():
            built = res["built"][role]
            assert res["stages"][role] == stage, (name, role)
            assert built["wrapper"] == wrapper, (name, role, built)
            assert built["optimizer"] == ("AdamW" if role in ("actor", "critic") else None), (name, role, built)
            if role in ("actor", "critic"):  # DeepSpeed's flag is only meaningful where ZeRO can offload
                assert built["offload_optimizer"] == off_opt, (name, role, built)
            assert built["offload_param"] == off_param, (name, role, built)
    # torch_adam and the shm-op switch: not one C++ extension was built, not even its folder was made
    assert run["ext_after"] is None and run["_ext_dir_after"] is None, run["_ext_dir_after"]
    before, after = run["_default_ext"]
    assert before == after, "something was built under ~/.cache/torch_extensions"


@pytest.mark.distributed
def test_weights_after_loading_equal_the_folders(run):
    for name, res in run["placements"].items():
        for role, diff in res["start_vs_folder"].items():
            assert diff == {"missing": [], "differ": []}, (name, role, diff)


# ---- forwards ------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_forwards_agree_across_placements(run):
    """Same weights, same hand-made rollout: every placement gives the ZeRO-0 numbers (fp32, 1e-5)."""
    base = run["placements"]["z0"]["fixed"]
    layout = run["placements"]["z0"]["fixed_layout"]
    for rank, lay in enumerate(layout):
        assert lay["response_lengths"] == [4, 6] and lay["ended_with_eos"] == [True, False]
        lp = _t(base[rank]["actor_logprobs"])
        assert lp.shape == (2, 6)
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6], dtype=torch.bool)
        assert (lp[mask] < 0).all() and (lp[~mask] == 0).all()
        assert (_t(base[rank]["critic_values"])[~mask] == 0).all()
        assert _t(base[rank]["critic_values"])[mask].abs().min() > 0
        assert len(base[rank]["reward_scores"]) == 2
    for name, res in run["placements"].items():
        for rank in range(2):
            for key, ref in base[rank].items():
                diff = (_t(res["fixed"][rank][key]) - _t(ref)).abs().max().item()
                assert diff <= TOL, f"{name} rank {rank} {key}: max |diff| {diff:.3g} vs z0"
        # the actor and the (untrained) reference are the same weights
        assert (_t(res["fixed"][0]["actor_logprobs"]) - _t(res["fixed"][0]["ref_logprobs"])).abs().max() <= TOL


@pytest.mark.distributed
def test_dropping_position_ids_changes_gpt2_logprobs(gpt2_run):
    """Negative control: without position ids, left-padded rows of an absolute-position model are off."""
    diffs = gpt2_run["placements"]["z0"]["no_position_ids_max_diff_padded_rows"]
    assert all(d is not None and d > 1e-2 for d in diffs), diffs


# ---- generation ----------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_greedy_generation_is_the_same_everywhere(run):
    """ZeRO-3 (synced ranks) == ZeRO-0 == plain HF generation of each prompt alone, token for token."""
    plan = run["plan"]
    prompts, expected = plan["prompts"], plan["expected"]
    for rank in range(2):  # prompts of different lengths on each rank: the batch is left-padded
        lengths = [len(p) for p in prompts[rank]]
        assert max(lengths) - min(lengths) >= 3, lengths
    # rank 0's responses end at the extra stop token after 2-3 tokens, rank 1's run to the maximum (8): under ZeRO-3
    # rank 0 has to keep joining rank 1's forward passes
    assert all(r[-1] == plan["stop_token"] and 2 <= len(r) <= 3 for r in expected[0])
    assert all(len(r) == 8 and plan["stop_token"] not in r for r in expected[1])
    for name, res in run["placements"].items():
        for rank in range(2):
            g = res["generated"][rank]
            assert g["responses"] == expected[rank], (name, rank)
            assert g["position_ids_ok"]
            assert g["ended"] == [rank == 0] * 2
            assert g["width"] == max(len(r) for r in expected[rank])
        if "alone" in res:  # the engine itself, one prompt at a time with no padding
            assert res["alone"] == expected, name
    assert {n for n, r in run["placements"].items() if "alone" in r} >= {"z0"}


# ---- training ------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_training_moves_actor_and_critic_only(run):
    for name, res in run["placements"].items():
        assert res["optimizer_steps"] == {"actor": 2, "critic": 2}, name
        after = res["after_training"]
        assert after["reward"]["frozen"], name
        # the reference carries the actor's requires_grad flags (the same matmul kernels, engine/freezing.py), yet
        # is never trained
        assert after["reference"]["flags"] == after["actor"]["flags"], name
        for role in ("reference", "reward"):
            assert after[role]["changed_buffers_or_params"] == [], (name, role)  # bit-identical
            assert after[role]["keys_equal"], (name, role)
        for role in ("actor", "critic"):
            assert after[role]["n_params"] >= 20, (name, role)
            assert after[role]["unchanged"] == [], (name, role, after[role]["unchanged"])
            assert after[role]["keys_equal"], (name, role)
        # the trained weights moved the outputs
        moved = (_t(res["post_training"][0]["actor_logprobs"]) - _t(res["fixed"][0]["actor_logprobs"])).abs().max()
        assert moved > 1e-3, name


@pytest.mark.distributed
def test_training_steps_agree_across_placements(run):
    """Two AdamW steps from the same weights on the same data: ZeRO 0/2/3 (and offload) stay together."""
    base = run["placements"]["z0"]["post_training"]
    for name, res in run["placements"].items():
        for rank in range(2):
            for key in ("actor_logprobs", "critic_values"):
                diff = (_t(res["post_training"][rank][key]) - _t(base[rank][key])).abs().max().item()
                assert diff <= 1e-4, f"{name} rank {rank} {key} after training: {diff:.3g}"


# ---- export --------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_exports_reload_with_from_pretrained(run):
    exported = {n: r["export"] for n, r in run["placements"].items() if "export" in r}
    assert "z3" in exported
    for name, ex in exported.items():
        assert "error" not in ex, f"{name}: reloading the export failed:\n{ex['error']}"
        for role in ("actor", "critic"):
            assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(ex["files"][role]), (name, ex)
        assert ex["actor_max_diff"] <= TOL and ex["critic_max_diff"] <= TOL, (name, ex)
        assert ex["actor_logprobs_nonzero"]
        assert ex["critic_num_labels"] == 1
        assert ex["tokenizer_len"] == 512 and ex["tokenizer_pad"] == run["pad_token_id"]
    assert len({json.dumps(ex["n_params"], sort_keys=True) for ex in exported.values()}) == 1


# ---- positions, in process (one rank) -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["tiny", "tiny_llama"])
def engine_1rank(request, dist_single):
    from rlhf_engine.config import TrainConfig
    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    setup = request.getfixturevalue(request.param)
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = setup.actor
    cfg.reward.model_name_or_path = setup.reward  # the critic starts from it too: the same head
    cfg.generation.max_prompt_seq_len, cfg.generation.max_answer_seq_len = 8, 8
    cfg.batch.experience_micro_batch_size = 1
    return request.param, setup, RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))


def test_scores_values_and_logprobs_are_read_at_the_right_positions(engine_1rank):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_engine.rollout import Rollout, pad_prompts

    which, setup, e = engine_1rank
    eos, pad = int(e.tokenizer.eos_token_id), e.pad_token_id
    assert eos == 0 and pad == {"tiny": 0, "tiny_llama": 1}[which]  # the GPT-2 setup has pad == EOS
    # row 0: 4 prompt tokens, answer "11 12 EOS" then filler; row 1: 2 prompt tokens (left-padded), 5 answer tokens
    # and no EOS (truncated). P = 4, R = 5, L = 9.
    ids, mask = pad_prompts([[5, 6, 7, 8], [9, 10]], pad)
    gen = torch.tensor([[11, 12, eos, pad, pad], [13, 14, 15, 16, 17]])
    r = Rollout.from_generation(ids, mask, gen, e.stop_token_ids, pad)
    assert r.sequences.tolist() == [[5, 6, 7, 8, 11, 12, eos, pad, pad], [pad, pad, 9, 10, 13, 14, 15, 16, 17]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6, 6], [0, 0, 0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(r.position_ids, positions)
    score_index = [6, 8]  # row 0: its EOS (the last real token); row 1: the last token of the truncated answer
    value_index = [3, 4, 5, 6, 7]  # P - 1 + t for t = 0..4: the state before action t
    lengths = [3, 5]

    rm = AutoModelForSequenceClassification.from_pretrained(setup.reward).eval()
    with torch.no_grad():
        out = rm(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=positions,
                 output_hidden_states=True)
        head = rm.score(out.hidden_states[-1]).squeeze(-1)  # [B, L]: the score head at every position
    scores = e.reward_scores(r)
    want = torch.stack([head[0, score_index[0]], head[1, score_index[1]]])
    assert torch.allclose(scores, want, atol=TOL, rtol=0), (scores, want)
    # negative control: one token earlier (where HF's own pooling, the last token != pad, lands when pad == EOS).
    # (Index 7 would give the same number: a padding token equal to EOS, at the same position id, attending to the
    # same real tokens, has the same hidden state.)
    assert (scores[0] - head[0, 5]).abs() > 1e-4

    values = e.critic_values(r)
    assert values.shape == (2, 5)
    for b in range(2):
        for t in range(5):
            want = head[b, value_index[t]] if t < lengths[b] else torch.tensor(0.0)
            assert abs(values[b, t].item() - want.item()) <= TOL, (b, t, values[b, t], want)

    lm = AutoModelForCausalLM.from_pretrained(setup.actor).eval()
    with torch.no_grad():
        logits = lm(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=positions).logits
    logprobs = e.actor_logprobs(r)
    for b in range(2):
        for t in range(5):
            token = r.sequences[b, 4 + t]
            want = torch.log_softmax(logits[b, value_index[t]].float(), -1)[token] if t < lengths[b] else 0.0
            assert abs(logprobs[b, t].item() - float(want)) <= TOL, (b, t)

    # the training forwards read the same positions, and without dropout (the folders were saved with dropout 0.1)
    train_lp, _ = e.actor_forward(r)
    train_v = e.critic_forward(r)
    assert (train_lp.detach() - logprobs).abs().max() <= TOL
    assert (train_v.detach() - values).abs().max() <= TOL
    e.engines["actor"].zero_grad()
    e.engines["critic"].zero_grad()

"""Steps 1 and 2 on 2 CPU ranks (gloo) through the real entry points, then PPO on their outputs.

* One launch of forked ranks (tests/distributed/scripts/entry_points.py; the launcher is not under test here: the
  learning job runs these scripts under the deepspeed launcher) calls launch/train_sft.py's and
  launch/train_reward.py's `main` one after the other: SFT (ZeRO 3, gradient accumulation 2) on a tiny repeated
  dataset, then a reward model started from the SFT output (ZeRO 2, margin 0.2) on a separable synthetic preference set.
  The tests read their metrics.jsonl and exported models.
* In this process (one rank): the PPO engine's score of a rollout equals the step-2 scorer's score of the same token
  ids, laid out as a step-2 pair batch (other rows, other padding, one forward of chosen + rejected).
* The "Three steps" block of docs/three-steps.md, run as written with bash (a tiny model as BASE, PPO cut to two
  iterations): SFT -> reward model -> PPO through launch/*.py, each loading the previous step's output, on the shipped
  example data.

Tiny GPT-2 models (absolute positions) and a pad == EOS tokenizer made by the test.
"""
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from _support import ROOT, SCRIPTS, check, clean_env, launch, make_tiny_setup
from rlhf_engine.outputs.metrics import read_metrics

SFT_FALL = 0.5  # mean training loss of the last epoch <= SFT_FALL x the first step's loss
SFT_EVAL_FALL = 0.7  # held-out loss after the last epoch <= SFT_EVAL_FALL x after the first epoch (repeated rows)
RM_EVAL_ACCURACY = 0.9  # held-out accuracy after the last epoch, separable set
RM_TRAIN_ACCURACY = 0.9  # mean training accuracy of the last epoch
SCORE_TOL = 1e-6  # PPO score vs step-2 score for identical ids
# a pseudo-random ~2/7 of the vocabulary also ends a PPO response, so rollout lengths differ (as in test_ppo_trainer)
STOP_IDS = [t for t in range(3, 512) if (t * 2654435761) % 7 < 2]


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _flags(**kw):
    out = []
    for k, v in kw.items():
        out += [f"--{k}", str(v)]
    return out


@pytest.fixture(scope="module")
def steps12(tmp_path_factory):
    from rlhf_engine.assets import tiny_prompts

    root = tmp_path_factory.mktemp("steps12")
    setup = make_tiny_setup(str(root / "models"), n_prompts=16)
    # step 1 data: 8 distinct (prompt, response) rows, each 6 times
    rng = random.Random(3)
    base = tiny_prompts(8, seed=3)
    pairs = [(p, " ".join(rng.sample(p.split(), len(p.split())))) for p in base]  # the prompt's words, shuffled
    sft = _jsonl(root / "sft.jsonl", [{"prompt": p, "response": r} for p, r in pairs * 6])
    # step 2 data: the same random words in both responses; the chosen one ends with "good good", the rejected with
    # "bad bad"
    prompts = tiny_prompts(48, seed=5)
    words = [" ".join(w.split()[:3]) for w in tiny_prompts(48, seed=6)]
    prefs = _jsonl(root / "prefs.jsonl", [{"prompt": p, "chosen": w + " good good", "rejected": w + " bad bad"}
                                          for p, w in zip(prompts, words)])
    out_sft, out_rm = str(root / "sft"), str(root / "rm")
    common = dict(max_prompt_seq_len=64, max_answer_seq_len=48, seed=7, prompt_template="Q: {prompt}\nA:")
    # SFT holds out 9 rows: rank 0 evaluates 5 (batches 4 + 1), rank 1 4 (batch 4, then a masked padding row), so
    # the ranks' ZeRO-3 forwards stay paired
    sft_argv = _flags(model_name_or_path=setup.actor, data_path=sft, output_dir=out_sft, zero_stage=3, eval_split=0.19,
                      per_device_training_batch_size=2, gradient_accumulation_steps=2, per_device_eval_batch_size=4,
                      num_train_epochs=6, learning_rate=5e-3, **common)
    rm_argv = _flags(model_name_or_path=os.path.join(out_sft, "model"), data_path=prefs, output_dir=out_rm,
                     zero_stage=2, eval_split=0.25, per_device_training_batch_size=4, per_device_eval_batch_size=5,
                     num_train_epochs=5, learning_rate=2e-3, margin=0.2, **common)
    spec = _jsonl(root / "spec.json", [])
    with open(spec, "w") as f:
        json.dump({"runs": [["train_sft.py", sft_argv], ["train_reward.py", rm_argv]]}, f)
    proc = launch(os.path.join(SCRIPTS, "entry_points.py"), ["--spec", spec], nproc=2, launcher="fork", timeout=420)
    check(proc)
    return dict(setup=setup, sft_dir=out_sft, rm_dir=out_rm, sft=read_metrics(out_sft), rm=read_metrics(out_rm),
                prompt_template=common["prompt_template"], stdout=proc.stdout)


# ---- step 1 ---------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_sft_loss_falls_and_each_epoch_is_evaluated(steps12):
    recs = steps12["sft"]
    # 48 rows, 9 held out; mini-batch 2 x 2 per rank x 2 ranks = 8: 4 steps per epoch (7 rows dropped), 6 epochs
    assert [r["iteration"] for r in recs] == list(range(24))
    assert [r["epoch"] for r in recs] == [e for e in range(6) for _ in range(4)]
    first, last_epoch = recs[0]["sft/loss"], [r["sft/loss"] for r in recs[-4:]]
    assert sum(last_epoch) / 4 <= SFT_FALL * first, (first, last_epoch)
    evals = [r for r in recs if "sft/eval_loss" in r]
    assert [r["iteration"] for r in evals] == [3, 7, 11, 15, 19, 23]  # the last step of every epoch
    for r in evals:
        assert r["sft/eval_ppl"] == pytest.approx(math.exp(r["sft/eval_loss"]), rel=1e-9)
    assert evals[-1]["sft/eval_loss"] <= SFT_EVAL_FALL * evals[0]["sft/eval_loss"]
    assert all(r["sft/tokens"] > 0 and r["sft/lr"] == pytest.approx(5e-3) for r in recs)
    assert recs[-1]["system/optimizer_steps"] == 24


@pytest.mark.distributed
def test_sft_writes_the_run_files_and_a_causal_lm_that_reloads(steps12):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = steps12["sft_dir"]
    for name in ("config.json", "command.txt", "metrics.jsonl", "metrics.png", "ds_config_actor.json"):
        assert os.path.isfile(os.path.join(d, name)), name
    with open(os.path.join(d, "ds_config_actor.json")) as f:
        ds = json.load(f)
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_accumulation_steps"] == 2
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["response_column"] == "response"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"))  # consolidated from ZeRO 3
    assert type(model).__name__ == "GPT2LMHeadModel"
    before = AutoModelForCausalLM.from_pretrained(steps12["setup"].actor)
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, before.transformer.h[0].attn.c_attn.weight)
    assert AutoTokenizer.from_pretrained(os.path.join(d, "model")).eos_token_id == 0


# ---- step 2 ---------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_reward_model_separates_held_out_pairs(steps12):
    recs = steps12["rm"]
    # 48 pairs, 12 held out; 4 pairs per rank x 2 ranks = 8: 4 steps per epoch, 5 epochs
    assert len(recs) == 20
    evals = [r for r in recs if "rm/eval_accuracy" in r]
    assert [r["iteration"] for r in evals] == [3, 7, 11, 15, 19]
    final = evals[-1]
    assert final["rm/eval_accuracy"] >= RM_EVAL_ACCURACY, evals
    assert final["rm/score_gap"] > 0.2  # at least the margin
    assert final["rm/score_gap"] == pytest.approx(final["rm/chosen_score"] - final["rm/rejected_score"], abs=1e-5)
    assert sum(r["rm/accuracy"] for r in recs[-4:]) / 4 >= RM_TRAIN_ACCURACY
    assert sum(r["rm/loss"] for r in recs[-4:]) / 4 < recs[0]["rm/loss"]
    assert evals[-1]["rm/eval_loss"] < evals[0]["rm/eval_loss"]


@pytest.mark.distributed
def test_reward_model_is_exported_as_a_sequence_classifier(steps12):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    d = os.path.join(steps12["rm_dir"], "model")
    config = AutoConfig.from_pretrained(d)
    assert config.architectures == ["GPT2ForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id == 0
    AutoModelForSequenceClassification.from_pretrained(d)
    with open(os.path.join(steps12["rm_dir"], "ds_config_reward.json")) as f:
        assert json.load(f)["zero_optimization"]["stage"] == 2


# ---- PPO scores == step-2 scores ----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_ppo_engine_scores_a_rollout_exactly_as_step_2_does(steps12, dist_single, tmp_path):
    """Generate with the SFT model in the PPO engine, score with its reward role; then lay the same token ids out as a
    step-2 pair batch (other order, other padding, chosen + rejected in one forward) and score it with the reward
    trainer's scorer. Identical within 1e-6. Negative control: DeepSpeed-Chat's read position (the token before the
    EOS when pad == EOS) gives other scores."""
    from rlhf_engine.cli import parse_args
    from rlhf_engine.config import RewardTrainConfig, RoleConfig, SupervisedConfig
    from rlhf_engine.data.prompts import PromptDataset, collate_prompts, load_prompt_data
    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine
    from rlhf_engine.engine.role_engine import build_role_engine, rollout_inputs
    from rlhf_engine.rollout import gather_at
    from rlhf_engine.trainer.reward_model import RewardModelTrainer

    sft_model, rm_model = os.path.join(steps12["sft_dir"], "model"), os.path.join(steps12["rm_dir"], "model")
    cfg = parse_args(_flags(actor_model_name_or_path=sft_model, reward_model_name_or_path=rm_model,
                            data_path=steps12["setup"].prompts, prompt_template=steps12["prompt_template"],
                            max_prompt_seq_len=64, max_answer_seq_len=12, output_dir=str(tmp_path / "ppo"))
                     + ["--stop_token_ids"] + [str(t) for t in STOP_IDS])
    engine = RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
    tok = engine.tokenizer
    prompts = load_prompt_data(cfg.data, tok, 64, verbose=False).train
    B = 8
    ids, mask = collate_prompts(prompts, list(range(B)), tok.pad_token_id)
    torch.manual_seed(0)
    rollout = engine.generate(ids, mask)
    lengths = rollout.response_lengths.tolist()
    assert len(set(lengths)) > 1 and min(lengths) >= 1  # uneven responses: the re-padding differs
    ppo = engine.reward_scores(rollout)  # experience micro-batches of 4 rows

    # step 2: the same ids as preference rows, collated and scored by the reward trainer's own methods
    rows_p = [ids[i][mask[i].bool()].tolist() for i in range(B)]
    rows_r = [rollout.responses[i, :n].tolist() for i, n in enumerate(lengths)]
    # batch order; row i's "rejected" is row other[i]'s response (behind prompt i: rows of other lengths in the batch)
    order, other = [5, 2, 7, 0, 3, 6, 1, 4], [4, 1, 6, 3, 0, 7, 2, 5]
    pairs = PromptDataset(rows_p, [[1] * len(p) for p in rows_p], [""] * B,
                          extra={"chosen": rows_r, "rejected": [rows_r[other[i]] for i in range(B)]})
    rm_engine, _ = build_role_engine(RoleConfig(), rm_model, kind="scalar", stage=0, dtype="fp32", train=True,
                                     batch=SupervisedConfig(per_device_training_batch_size=B), world_size=1,
                                     eval_micro_batch_size=B, num_training_steps=1, pad_token_id=tok.pad_token_id)
    step2 = RewardModelTrainer(None, rm_engine, cfg=RewardTrainConfig(), dist=dist_single, tokenizer=tok)
    batch = step2.collate(pairs, order)
    assert batch.rollout.prompt_length != rollout.prompt_length or batch.rollout.response_width != \
        rollout.response_width or batch.rollout.batch_size != B
    with torch.no_grad():
        s = step2.scores(batch.rollout)
        loss, _ = step2.forward_loss(batch, None)  # the training path reads the same scores
    assert torch.isfinite(loss)
    diff = (s[:B] - ppo[order]).abs().max().item()  # chosen rows
    print(f"max |PPO score - step-2 score| = {diff:.3g}")
    assert diff <= SCORE_TOL, diff
    # and the rows re-padded on their own (one row per batch) give the same scores too
    for i in (0, 3):
        single = step2.collate(pairs, [i])
        with torch.no_grad():
            assert abs(step2.scores(single.rollout)[0].item() - ppo[i].item()) <= SCORE_TOL
    # negative control: one position earlier (where DeepSpeed-Chat reads when pad == EOS) is another score
    with torch.no_grad():
        per_pos = rm_engine(**rollout_inputs(rollout))
    two = [i for i, n in enumerate(lengths) if n >= 2]
    earlier = gather_at(per_pos, rollout.score_index() - 1)
    assert (earlier[two] - ppo[two]).abs().max().item() > 1e-3


# ---- the three steps of docs/three-steps.md, as written -----------------------------------------------------------
def _readme_block() -> str:
    with open(os.path.join(ROOT, "docs", "three-steps.md")) as f:
        text = f.read()
    m = re.search(r"<!-- three-steps:begin -->\n```bash\n(.*?)```\n<!-- three-steps:end -->", text, re.S)
    assert m, "docs/three-steps.md lost its three-steps block"
    return m.group(1)


@pytest.mark.slow  # the learning job's run of the README's flow (100 s on 2 cores); each step has its own default test
@pytest.mark.learning
@pytest.mark.distributed
def test_readme_three_steps_run_end_to_end(tmp_path):
    """SFT -> reward model -> PPO through launch/*.py exactly as docs/three-steps.md writes them, on examples/data,
    each step loading the previous step's output. Changes: BASE is a tiny model, runs/ lies in tmp, the deepspeed
    launcher gets a free port, and PPO runs 2 iterations instead of 50."""
    setup = make_tiny_setup(str(tmp_path / "models"), n_prompts=4)
    block = _readme_block()
    assert block.count("deepspeed --num_gpus 2 launch/") == 3
    base_line = next(line for line in block.splitlines() if line.startswith("BASE="))
    block = block.replace(base_line, f"BASE={setup.actor}")
    runs = str(tmp_path / "runs")
    block = block.replace(" runs/", f" {runs}/")
    assert "runs/" not in block.replace(f"{runs}/", "")
    bindir = os.path.dirname(sys.executable)
    shim = f"""set -euo pipefail
deepspeed() {{
  local port extra=()
  port=$("{sys.executable}" -c 'from rlhf_engine.engine.distributed import free_port; print(free_port())')
  case "$*" in *train_ppo.py*) extra=(--max_steps 2);; esac
  "{bindir}/deepspeed" --master_port "$port" "$@" "${{extra[@]}}"
}}
"""
    script = tmp_path / "three_steps.sh"
    script.write_text(shim + block)
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=540)
    check(proc)
    sft, rm, ppo = (os.path.join(runs, n) for n in ("sft", "reward", "ppo"))
    assert os.path.isfile(os.path.join(sft, "model", "model.safetensors"))
    assert os.path.isfile(os.path.join(rm, "model", "model.safetensors"))
    s_recs, r_recs, p_recs = read_metrics(sft), read_metrics(rm), read_metrics(ppo)
    # 60 rows: SFT holds out 6 -> 54 / (8 x 2 ranks) = 3 steps per epoch x 3; the reward model holds out 12 ->
    # 48 / 16 = 3 steps x 2
    assert len(s_recs) == 9 and sum("sft/eval_loss" in r for r in s_recs) == 3
    assert len(r_recs) == 6 and sum("rm/eval_accuracy" in r for r in r_recs) == 2
    assert all(math.isfinite(r["sft/loss"]) for r in s_recs) and all(0 <= r["rm/accuracy"] <= 1 for r in r_recs)
    assert [r["iteration"] for r in p_recs] == [0, 1] and all(math.isfinite(r["objective/score"]) for r in p_recs)
    with open(os.path.join(ppo, "config.json")) as f:
        flat = json.load(f)
    assert flat["actor_model_name_or_path"] == os.path.join(sft, "model")
    assert flat["reward_model_name_or_path"] == os.path.join(rm, "model")
    assert flat["prompt_template"] == "Question: {prompt}\nAnswer:\n"  # bash's $'...' gave real newlines

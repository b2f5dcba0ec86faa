"""TRL's GRPOTrainer on the settings of examples/grpo_arithmetic.yaml: the yardstick of bench/trl_side_by_side.py.

    .venv-trl/bin/python bench/trl_grpo/run.py --model_dir DIR --out run.json [--iterations 12] [--learning_rate 1e-4]

Runs in its own environment (bash bench/trl_grpo/install.sh); from the checkout it loads only the reward
(rlhf_engine/rewards/math_answer.py) and the freezing (rlhf_engine/engine/freezing.py), by file, so that both sides
score and freeze with the same code. The settings, matched to the example's:

* the model folder the project converts SmolLM2-135M-Instruct into (`--model_dir`), fp32 on the CPU;
* examples/data/arithmetic.jsonl, each row one user message through the tokenizer's chat template;
* the top 4 of 30 blocks and the final norm trained (freeze_below_top 4);
* 8 prompts x 4 samples per generation round, 32 new tokens at most, temperature 0.7 (no top-k, no top-p);
* two optimizer steps of 16 responses per round (the example's per_device_training_batch_size 16 over 32), one pass;
* PPO's clip 0.2, no KL term (TRL builds no reference at beta 0), advantages over each group's std, the token mean
  over each step's tokens;
* torch's fused AdamW (as the project's engines on CPU), betas (0.9, 0.95), eps 1e-8, no weight decay, a constant
  learning rate 1e-4, gradients clipped at 1.0;
* seed 1234.

An iteration is one generation round (two optimizer steps). Per iteration it writes the wall time (between the
ends of every second optimizer step, the first from the start of training), the accuracy of the round's 32
responses (their mean reward, read in the reward call) and the phases: generation (TRL's sampling call), the rest
of its generate-and-score (old log-probs, rewards, advantages), and training (the rest of the iteration).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(name, value)

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_module(relpath: str):
    """A file of the checkout as a module of its own (the package's __init__ would import DeepSpeed)."""
    spec = importlib.util.spec_from_file_location(os.path.basename(relpath)[:-3], os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ScoredRounds:
    """The reward TRL calls once per generation round: the project's exact_answer, recording each round's
    accuracy."""

    __name__ = "exact_answer"

    def __init__(self, exact_answer):
        self.exact_answer, self.accuracy = exact_answer, []

    def __call__(self, prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [float(r) for r in self.exact_answer(prompts, texts, answer)]
        self.accuracy.append(sum(rewards) / len(rewards))
        return rewards


class StepEnds(TrainerCallback):
    def __init__(self):
        self.start, self.ends = None, []

    def on_train_begin(self, args, state, control, **_):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **_):
        self.ends.append(time.perf_counter())


def timed(obj, method: str, into: list) -> None:
    """Record the wall time of each call of `obj.method`."""
    inner = getattr(obj, method)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    setattr(obj, method, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--learning_rate", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--work_dir", default="")
    a = ap.parse_args()
    reward = ScoredRounds(project_module("rlhf_engine/rewards/math_answer.py").exact_answer)
    freezing = project_module("rlhf_engine/engine/freezing.py")
    with open(os.path.join(ROOT, "examples/data/arithmetic.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                       for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    freezing.freeze_below_top(model, 4)
    args = trl.GRPOConfig(
        output_dir=a.work_dir or os.path.join(os.path.dirname(os.path.abspath(a.out)), "trl_work"),
        per_device_train_batch_size=16, gradient_accumulation_steps=1, steps_per_generation=2, num_generations=4,
        num_iterations=1, max_steps=2 * a.iterations, max_completion_length=32, temperature=0.7, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="bnpo", scale_rewards="group", mask_truncated_completions=False,
        learning_rate=a.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
        bf16=False, fp16=False, use_cpu=True, use_vllm=False, gradient_checkpointing=False, seed=a.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    clock = StepEnds()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[clock])
    generate, score = [], []  # TRL's sampling call; its whole generate-and-score (sampling included)
    timed(trainer, "_generate_single_turn", generate)
    timed(trainer, "_generate_and_score_completions", score)
    trainer.train()
    marks = [clock.start] + clock.ends[1::2]  # an iteration ends with its second optimizer step
    iteration = [b - a_ for a_, b in zip(marks, marks[1:])]
    out = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                        "datasets": datasets.__version__},
           "iterations": len(iteration), "seed": a.seed, "learning_rate": a.learning_rate,
           "time/iteration": iteration, "time/generate": generate,
           "time/experience": [s - g for s, g in zip(score, generate)],
           "time/train": [i - s for i, s in zip(iteration, score)],
           "accuracy": reward.accuracy, "median_iteration_s": statistics.median(iteration)}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

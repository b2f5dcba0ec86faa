"""Steps 1 and 2: supervised fine-tuning and reward-model training."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import Problems
from .data import DataConfig
from .fields import DTYPES, check_choice, check_positive, is_number, opt
from .role import RoleConfig
from .run import LoggingConfig, RunConfig


# ---- steps 1 and 2: supervised fine-tuning and reward-model training ------------------------------------------------
LONG_RESPONSE_POLICIES = ("error", "skip", "truncate")


@dataclass
class SupervisedConfig:
    """Training loop of steps 1 and 2 (SFT and reward model): epochs, batches, sequence lengths."""

    num_train_epochs: int = opt(1, "Passes over the training data.")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = run every epoch).")
    per_device_training_batch_size: int = opt(8, "Samples (SFT) or pairs (reward model) per rank in one "
                                              "forward/backward (micro-batch).")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step: a mini-batch is "
                                           "per_device_training_batch_size x gradient_accumulation_steps per rank.")
    per_device_eval_batch_size: int = opt(8, "Samples or pairs per rank in one evaluation forward.")
    max_prompt_seq_len: int = opt(256, "Longest prompt in tokens after templates (the PPO flag of the same name; "
                                  "longer prompts follow long_prompt_policy).")
    max_answer_seq_len: int = opt(256, "Longest response in tokens, its appended EOS included (the PPO flag of the "
                                  "same name: PPO generates at most this many tokens); longer ones follow "
                                  "long_response_policy.")
    long_response_policy: str = opt("error", "Responses longer than max_answer_seq_len tokens (EOS included): "
                                    "'error' (stop, naming them), 'skip' (drop the row and count it) or 'truncate' "
                                    "(keep the first max_answer_seq_len tokens, no EOS, like a PPO response cut at "
                                    "the length limit).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        names = ("num_train_epochs", "per_device_training_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size", "max_prompt_seq_len", "max_answer_seq_len")
        check_positive(p, prefix, self, *names)
        check_positive(p, prefix, self, "max_steps", allow_zero=True)
        for n in names + ("max_steps",):
            if is_number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")
        check_choice(p, prefix, self, "long_response_policy", LONG_RESPONSE_POLICIES)

    @property
    def mini_batch_size(self) -> int:
        """Samples (or pairs) per rank per optimizer step."""
        return self.per_device_training_batch_size * self.gradient_accumulation_steps


@dataclass
class _SupervisedRun:
    """Fields shared by SFTConfig and RewardTrainConfig (their flags are flat: --model_name_or_path, --zero_stage)."""

    # `flag_prefix=""`: the one model's fields are flat flags; `critic_init_from` means nothing here
    model: RoleConfig = opt(None, "The model trained (its RoleConfig fields as flat flags; zero_stage None = 0).",
                            flag_prefix="", skip_flags=("init_from", "use_chat_template"))
    train: SupervisedConfig = opt(None, "Epochs, batches, lengths.")
    data: DataConfig = opt(None, "Training data.")
    logging: LoggingConfig = opt(None, "Metrics sinks besides metrics.jsonl.")
    run: RunConfig = opt(None, "Run directory, checkpoints and resume, timeouts, preemption signals.")
    seed: int = opt(1234, "Seed: data order (seed + epoch) and any new weights (a new score head).")

    default_output_dir = "runs/step"  # each step's own (a class attribute, not a field)

    def __post_init__(self) -> None:
        # the one model: dtype auto unless told otherwise (no run-level dtype here), a fine-tuning learning rate
        for name, make in (("model", lambda: RoleConfig(dtype="auto", learning_rate=1e-5)), ("train", SupervisedConfig),
                           ("data", DataConfig), ("logging", LoggingConfig),
                           ("run", lambda: RunConfig(output_dir=self.default_output_dir))):
            if getattr(self, name) is None:
                setattr(self, name, make())

    def _validate_common(self, p: Problems) -> None:
        self.model.validate(p)
        if not self.model.model_name_or_path:
            p.add("model_name_or_path", "", "give a local model folder or hub id")
        if not self.model.dtype:
            p.add("dtype", "", f"must be one of {', '.join(DTYPES)}")
        if self.model.offload_params is True and self.model.zero_stage is None:
            p.add("offload_params", True, "parameter offload needs ZeRO stage 3 and zero_stage defaults to 0: set "
                  "zero_stage 3 (or drop offload_params)")
        self.train.validate(p)
        self.data.validate(p)
        self.logging.validate(p)
        if not self.data.data_path:
            p.add("data_path", self.data.data_path, "give a .jsonl/.json/.parquet/.csv file (or a blend)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            p.add("seed", self.seed, "must be an integer")
        self.run.validate(p)

    def validate(self):
        p = Problems()
        self._validate_common(p)
        self._validate_own(p)
        p.raise_if_any()
        return self

    def _validate_own(self, p: Problems) -> None:
        pass

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _column(p: Problems, obj: Any, name: str) -> None:
    v = getattr(obj, name)
    if not isinstance(v, str) or not v:
        p.add(name, v, "must name a column")


@dataclass
class SFTConfig(_SupervisedRun):
    """Step 1: supervised fine-tuning of a causal LM on (prompt, response) rows; the loss is on response tokens
    (and their EOS) only."""

    response_column: str = opt("response", "Column holding the response the model learns to write after the prompt "
                               "(the tokenizer's EOS is appended, as PPO responses end with it).")

    default_output_dir = "runs/sft"  # <output_dir>/model: train_ppo.py's --actor_model_name_or_path

    def _validate_own(self, p: Problems) -> None:
        _column(p, self, "response_column")
        if self.response_column == self.data.prompt_column:
            p.add("response_column", self.response_column, "must differ from prompt_column")


@dataclass
class RewardTrainConfig(_SupervisedRun):
    """Step 2: a pairwise reward model on (prompt, chosen, rejected) rows: loss = mean over pairs of
    -log sigmoid(score(chosen) - score(rejected) - margin), each score read at the response's EOS."""

    chosen_column: str = opt("chosen", "Column holding the preferred response.")
    rejected_column: str = opt("rejected", "Column holding the dispreferred response.")
    margin: float = opt(0.0, "Margin m of the loss -log sigmoid(s_chosen - s_rejected - m): > 0 asks for a score gap "
                        "of at least about m (0 = the plain Bradley-Terry loss).")

    # <output_dir>/model: a *ForSequenceClassification, the --reward_model_name_or_path of train_ppo.py, the critic
    default_output_dir = "runs/reward"

    def _validate_own(self, p: Problems) -> None:
        _column(p, self, "chosen_column")
        _column(p, self, "rejected_column")
        cols = [self.data.prompt_column, self.chosen_column, self.rejected_column]
        if len(set(cols)) < 3:
            p.add("rejected_column" if self.chosen_column != self.rejected_column else "chosen_column",
                  cols, "prompt_column, chosen_column and rejected_column must be three different columns")
        if not is_number(self.margin) or self.margin < 0:
            p.add("margin", self.margin, "must be >= 0")

"""PPO-ptx (InstructGPT): a language-modelling loss on unsupervised text added to the actor's loss."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problems
from .fields import check_positive, opt


@dataclass
class PtxConfig:
    """The unsupervised text of PPO-ptx and its weight; off unless unsupervised_dataset_name is given."""

    unsupervised_dataset_name: str = opt("", "PPO-ptx (InstructGPT): unsupervised text whose language-modelling loss "
                                         "is added to the actor loss: a local .txt file (one document per line), a "
                                         ".jsonl/.json/.parquet/.csv file with the column unsup_text_column, or a hub "
                                         "dataset name; '' = ptx off. Documents are cut to max_prompt_seq_len + "
                                         "max_answer_seq_len tokens.")
    unsup_text_column: str = opt("text", "Column holding the documents of a table-format unsupervised_dataset_name.")
    unsup_coef: float = opt(27.8, "ptx weight gamma: actor loss = policy loss + gamma x ptx loss, where the ptx loss "
                            "is the mean negative log-likelihood per token (nats/token) of the mini-batch's "
                            "unsupervised tokens on all ranks, as the policy loss is a per-token mean. 27.8 = "
                            "InstructGPT's and DeepSpeed-Chat's value. Used only with unsupervised_dataset_name.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.unsupervised_dataset_name, str):
            p.add("unsupervised_dataset_name", self.unsupervised_dataset_name, "must be a path or dataset name")
        if not isinstance(self.unsup_text_column, str) or not self.unsup_text_column:
            p.add("unsup_text_column", self.unsup_text_column, "must name a column")
        check_positive(p, "", self, "unsup_coef", allow_zero=True)

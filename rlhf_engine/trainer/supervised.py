"""The loop and run recipe shared by steps 1 and 2 (trainer/sft.py, trainer/reward_model.py): one trained model, built
with the engine, data, config, logging and export pieces PPO uses.

Recipe (`build_supervised`): validate -> distributed -> model preflight (no weights) -> tokenizer -> data (checked,
tokenized as PPO tokenizes prompts) -> sampler (batch arithmetic) -> output-dir policy, config.json, command.txt ->
`build_role_engine` -> `RunLogger`. Every cheap check runs before any weight is read.

Loop (`SupervisedTrainer.train`): epoch e draws `PromptSampler`'s permutation (seed + e; the same on every rank, rank r
takes its slice of each global mini-batch; the short last global batch is dropped), read through a `DataCursor`. Per
optimizer step, the rank's mini-batch is cut into `per_device_training_batch_size` micro-batches; the loss of each is
its sum over this rank's tokens (SFT) or pairs (reward model) divided by the GLOBAL count of the mini-batch (one
all-reduce), and `backward_global` undoes DeepSpeed's rank and accumulation averaging, exactly as in PPO. One metrics
record per optimizer step (`iteration` = its 0-based index); the last step of each epoch also carries the held-out
evaluation (when `eval_split` > 0). At the end the model is exported to `<output_dir>/model` in Hugging Face format.

Checkpoints (`save_interval` N > 0): every N optimizer steps and at the end, with PPO's `Checkpointer` (folder layout,
COMPLETE marker, keep_last, per-rank state: step counter, data position, random generators); the DeepSpeed engine
(module, optimizer, LR schedule) goes to `<checkpoint>/model/`. `--resume` continues exactly where one stopped, and
refuses a checkpoint of another run (`state.supervised_fingerprint`), as PPO does.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Optional

import torch

from ..cli import flat_dict
from ..data.prompts import PromptData, PromptDataset, PromptSampler
from ..data.supervised import eval_shards
from ..engine import all_reduce, barrier, init_distributed, load_tokenizer
from ..engine.checkpointing import load_trained, save_trained
from ..engine.preflight import RolePlan, plan_model
from ..engine.role_engine import backward_global, build_role_engine, export_engine, write_ds_config
from ..outputs.run_logger import RunLogger
from .metric_sums import MetricSums
from .run import prepare_run_dir, setup_logging
from .state import (Checkpointer, DataCursor, after_resume_cleanup, resolve_and_check,
                    supervised_fingerprint)

log = logging.getLogger(__name__)
MODEL_DIR = "model"  # <output_dir>/model: the exported Hugging Face folder
CHECKPOINT_TAG = "model"  # <checkpoint>/model/: the DeepSpeed engine's part of a checkpoint


class OneEngine:
    """The one DeepSpeed engine of a supervised run, as `state.Checkpointer` sees an engine."""

    def __init__(self, ds: Any, dist: Any):
        self.ds, self.dist = ds, dist

    def save(self, path: str) -> list:
        save_trained(self.ds, path, CHECKPOINT_TAG)
        return [CHECKPOINT_TAG]

    def load(self, path: str) -> list:
        load_trained(self.ds, path, CHECKPOINT_TAG)
        return [CHECKPOINT_TAG]


class SupervisedTrainer:
    """One model, one loss. Subclasses set the class attributes and implement `load_data`, `collate`, `count`,
    `forward_loss` and the two record builders."""

    name = ""  # metrics namespace: "sft" or "rm"
    kind = ""  # build_role_engine kind: "causal_lm" or "scalar"
    role = ""  # ds_config_<role>.json: the PPO role this model becomes
    plot_keys: tuple = ()
    bar_keys: tuple = ()

    def __init__(self, cfg: Any, dist: Any, engine: Any, plan: RolePlan, tokenizer: Any, data: PromptData,
                 sampler: PromptSampler, logger: RunLogger, total_steps: int):
        self.cfg, self.dist, self.engine, self.plan, self.tokenizer = cfg, dist, engine, plan, tokenizer
        self.data, self.sampler, self.logger, self.total_steps = data, sampler, logger, total_steps
        self.pad_token_id, self.eos_token_id = int(tokenizer.pad_token_id), int(tokenizer.eos_token_id)
        self.records: list[dict] = []
        self.iteration = 0  # optimizer steps taken (the metrics' "iteration")
        self.cursor = DataCursor(sampler) if sampler is not None else None  # None: a scorer only, no training
        self.state_providers = {"data": self.cursor} if self.cursor is not None else {}
        self.checkpointer = Checkpointer(self, fault_hooks=False, engine=OneEngine(engine, dist))

    # ---- what a subclass defines ---------------------------------------------------------------------------
    @classmethod
    def load_data(cls, cfg: Any, tokenizer: Any, verbose: bool) -> PromptData:
        raise NotImplementedError

    def collate(self, dataset: PromptDataset, indices: list[int], row_mask: Optional[list[bool]] = None):
        raise NotImplementedError

    def count(self, batch) -> torch.Tensor:
        """What the loss is normalised by, in this micro-batch (tokens or pairs)."""
        raise NotImplementedError

    def forward_loss(self, batch, denom: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """(loss share, additive detached sums) of one micro-batch; `denom` = the global count (None: local)."""
        raise NotImplementedError

    def train_record(self, sums: dict) -> dict:
        raise NotImplementedError

    def eval_record(self, sums: dict) -> dict:
        raise NotImplementedError

    # ---- loop ----------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.dist.device

    def train_step(self, epoch: int, idx: list[int]) -> dict:
        t0 = time.perf_counter()
        bs = self.cfg.train.per_device_training_batch_size
        micros = [self.collate(self.data.train, idx[i:i + bs]) for i in range(0, len(idx), bs)]
        local = torch.stack([torch.as_tensor(self.count(m), dtype=torch.float64) for m in micros]).sum()
        denom = all_reduce(local.to(self.device)).float()
        sums = MetricSums(self.device)
        self.engine.train()
        for m in micros:
            loss, s = self.forward_loss(m, denom)
            backward_global(self.engine, loss, self.dist.world_size)
            self.engine.step()
            for key, v in s.items():
                sums.add(key, v)
        rec = {"iteration": self.iteration, "epoch": epoch, **self.train_record(sums.reduce()),
               f"{self.name}/lr": float(self.engine.get_lr()[0]),
               "system/optimizer_steps": int(self.engine.global_steps), "time/step": time.perf_counter() - t0}
        return rec

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The held-out metrics over every eval row exactly once (all ranks run the same number of forwards)."""
        ds = self.data.eval
        if ds is None or len(ds) == 0:
            return {}
        was_training = self.engine.training
        self.engine.eval()
        sums = MetricSums(self.device)
        try:
            for idx, valid in eval_shards(len(ds), self.cfg.train.per_device_eval_batch_size, self.dist.rank,
                                          self.dist.world_size):
                _, s = self.forward_loss(self.collate(ds, idx, valid), None)
                for key, v in s.items():
                    sums.add(key, v)
        finally:
            self.engine.train(was_training)
        return self.eval_record(sums.reduce())

    def train(self) -> list[dict]:
        """Steps from `iteration` (0, or where a resumed checkpoint stopped) to `total_steps`, then the export."""
        per_epoch, is_main = self.sampler.batches_per_epoch, self.dist.is_main
        ckpt = self.checkpointer
        while self.iteration < self.total_steps:
            epoch, k, idx = next(self.cursor)
            rec = self.train_step(epoch, idx)
            self.iteration += 1
            if k == per_epoch - 1 or self.iteration >= self.total_steps:  # end of an epoch (or of the run)
                rec.update(self.evaluate())
            self.logger.log(rec)
            self.records.append(rec)
            if is_main:
                log.info("step %d/%d (epoch %d) %s", self.iteration, self.total_steps, epoch,
                         "  ".join(f"{key} {v:.4g}" for key, v in rec.items()
                                   if key.startswith(self.name + "/") and not key.endswith("/lr")
                                   and isinstance(v, float)))
            ckpt.after_iteration()
        if ckpt.save_interval and ckpt.last_saved != self.iteration:
            ckpt.save()
        self.export()
        return self.records

    def export(self, out_dir: Optional[str] = None) -> str:
        """The trained model as a Hugging Face folder (default `<output_dir>/model`). Collective."""
        out_dir = out_dir or os.path.join(self.cfg.output_dir, MODEL_DIR)
        export_engine(self.engine, self.plan.stage, out_dir, self.tokenizer, self.dist.is_main)
        if self.dist.is_main:
            log.info("model written to %s", out_dir)
        return out_dir


def build_supervised(cfg: Any, trainer_cls: type, argv: Optional[list] = None) -> SupervisedTrainer:
    """The recipe in the module docstring: everything checked, then one engine built; returns the trainer."""
    cfg.validate()
    dist = init_distributed(cfg.dist_timeout_minutes)
    setup_logging(dist.is_main)
    t = cfg.train
    plan = plan_model(cfg.model, t.max_prompt_seq_len + t.max_answer_seq_len, name=trainer_cls.role)
    tokenizer = load_tokenizer(cfg.model.tokenizer_name_or_path or plan.path)
    data = trainer_cls.load_data(cfg, tokenizer, verbose=dist.is_main)
    sampler = PromptSampler(len(data.train), t.mini_batch_size, dist.rank, dist.world_size, cfg.seed,
                            batch_field="per_device_training_batch_size x gradient_accumulation_steps")
    per_epoch = sampler.batches_per_epoch
    total = per_epoch * t.num_train_epochs
    if t.max_steps:
        total = min(total, t.max_steps)
    # --resume: the checkpoint found and checked against this run before the run folder changes or a weight loads
    resume_path, fingerprint = resolve_and_check(cfg, dist, supervised_fingerprint(cfg, dist.world_size,
                                                                                   len(data.train)))
    prepare_run_dir(cfg, dist, argv)
    after_resume_cleanup(cfg, dist, resume_path)  # records logged after the checkpoint are logged again
    barrier()
    if dist.is_main:
        n_eval = 0 if data.eval is None else len(data.eval)
        log.info("%s: %d train / %d eval rows; mini-batch %d/rank (%d x %d accumulation) x %d ranks -> %d optimizer "
                 "steps per epoch (%d rows per epoch dropped: short last global batch); %d steps in all",
                 trainer_cls.name, len(data.train), n_eval, t.mini_batch_size, t.per_device_training_batch_size,
                 t.gradient_accumulation_steps, dist.world_size, per_epoch, sampler.dropped_per_epoch, total)
    torch.manual_seed(cfg.seed)  # a new score head depends on the seed only (identical on every rank)
    engine, ds_cfg = build_role_engine(cfg.model, plan.path, kind=trainer_cls.kind, stage=plan.stage,
                                       dtype=plan.dtype, train=True, batch=t, world_size=dist.world_size,
                                       eval_micro_batch_size=t.per_device_eval_batch_size, num_training_steps=total,
                                       pad_token_id=int(tokenizer.pad_token_id))
    if dist.is_main:
        write_ds_config(cfg.output_dir, trainer_cls.role, ds_cfg)
    lg = cfg.logging
    logger = RunLogger(cfg.output_dir, dist.is_main, flat_dict(cfg), wandb_project=lg.wandb_project,
                       wandb_entity=lg.wandb_entity, wandb_run_name=lg.wandb_run_name,
                       wandb_sample_interval=lg.wandb_sample_interval, tensorboard=lg.tensorboard,
                       total_iterations=total, plot_keys=trainer_cls.plot_keys, bar_desc=trainer_cls.name.upper(),
                       bar_keys=trainer_cls.bar_keys, resume=bool(cfg.resume))
    trainer = trainer_cls(cfg, dist, engine, plan, tokenizer, data, sampler, logger, total)
    trainer.checkpointer.fingerprint = fingerprint
    if resume_path:  # last: the random generators are restored right before training continues
        trainer.checkpointer.load(resume_path, force=cfg.resume_force)
        if dist.is_main:
            log.info("resumed from %s at step %d of %d", resume_path, trainer.iteration, total)
    return trainer


def run_supervised(cfg: Any, trainer_cls: type, argv: Optional[list] = None) -> SupervisedTrainer:
    trainer = build_supervised(cfg, trainer_cls, argv)
    with trainer.logger:  # closes wandb / TensorBoard and writes metrics.png, also after a failure
        trainer.train()
    return trainer


def safe_exp(x: float) -> Optional[float]:
    """exp(x), or None (the key is omitted) when it overflows."""
    try:
        return math.exp(x)
    except OverflowError:
        return None

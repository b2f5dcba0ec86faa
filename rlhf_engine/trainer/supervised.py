"""The loop and run recipe shared by steps 1 and 2 (trainer/sft.py, trainer/reward_model.py): one trained model, built
with the engine, data, config, logging and export pieces PPO uses.

Recipe (`build_supervised`): the plan (`trainer/plan.plan_supervised`: validate -> distributed -> model preflight, no
weights -> tokenizer -> data, checked and tokenized as PPO tokenizes prompts -> sampler and step count -> fingerprint
and resume point) -> the run directory (PPO's `prepare_run_dir`) -> `build_role_engine` -> `RunLogger` -> the
trainer. Every cheap check runs before any weight is read.

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
import time
from typing import Any, Optional

import torch

from ..comm import all_reduce
from ..config import flat_dict
from ..data.prompts import PromptData, PromptDataset
from ..data.sampler import DataCursor
from ..data.supervised import eval_shards
from ..engine.checkpointing import load_trained, save_trained
from ..engine.role_engine import backward_global, build_role_engine, export_engine
from ..hooks import TestHooks
from ..outputs.run_logger import RunLogger
from .metric_sums import MetricSums
from .plan import SupervisedPlan, plan_supervised
from .run import prepare_run_dir, write_ds_configs
from .state import Checkpointer, providers_of

log = logging.getLogger(__name__)
CHECKPOINT_TAG = "model"  # <checkpoint>/model/: the DeepSpeed engine's part of a checkpoint


class OneEngine:
    """The one DeepSpeed engine of a supervised run, as `state.Checkpointer` sees an engine."""

    def __init__(self, ds: Any, dist: Any):
        self.ds, self.dist = ds, dist

    def save(self, path: str) -> list:
        save_trained(self.ds, path, CHECKPOINT_TAG)
        return [CHECKPOINT_TAG]

    def load(self, path: str, universal: bool = False) -> list:
        load_trained(self.ds, path, CHECKPOINT_TAG, universal=universal)
        return [CHECKPOINT_TAG]


class SupervisedTrainer:
    """One model, one loss. Subclasses set the class attributes and implement `load_data`, `collate`, `count`,
    `forward_loss` and the two record builders."""

    name = ""  # metrics namespace: "sft" or "rm"
    kind = ""  # build_role_engine kind: "causal_lm" or "scalar"
    role = ""  # ds_config_<role>.json: the PPO role this model becomes
    plot_keys: tuple = ()
    bar_keys: tuple = ()

    def __init__(self, plan: Optional[SupervisedPlan], engine: Any, logger: Optional[RunLogger] = None, *,
                 cfg: Any = None, dist: Any = None, tokenizer: Any = None, hooks: Optional[TestHooks] = None):
        """From the run plan and the engine built from it (resumes last when the plan names a checkpoint). Without a
        plan (a scorer only, no training: tests, evaluation) give `cfg`, `dist` and `tokenizer`."""
        self.plan, self.engine, self.logger = plan, engine, logger
        self.cfg = plan.cfg if plan else cfg
        self.dist = plan.dist if plan else dist
        self.tokenizer = plan.tokenizer if plan else tokenizer
        self.data = plan.data if plan else None
        self.sampler = plan.sampler if plan else None
        self.total_steps = plan.total_steps if plan else 0
        self.pad_token_id, self.eos_token_id = int(self.tokenizer.pad_token_id), int(self.tokenizer.eos_token_id)
        self.records: list[dict] = []
        self.iteration = 0  # optimizer steps taken (the metrics' "iteration")
        self.cursor = DataCursor(self.sampler) if self.sampler is not None else None
        self.state_providers = {"data": self.cursor} if self.cursor is not None else {}
        self.checkpointer = None
        self.hooks = (hooks or TestHooks()).attach(self.dist.rank, lambda: self.iteration)  # TEST HOOKS: all off
        if plan is not None:
            self.checkpointer = Checkpointer(OneEngine(engine, self.dist), providers_of(self), plan.run_dir,
                                             plan.fingerprint, save_interval=self.cfg.run.save_interval,
                                             keep_last=self.cfg.run.keep_last, seed=self.cfg.seed,
                                             save_interval_minutes=self.cfg.run.save_interval_minutes, hooks=self.hooks)
            if plan.resume_path:  # last: the random generators are restored right before training continues
                self.checkpointer.load(plan.resume_path, force=self.cfg.run.resume_force)
                if self.dist.is_main:
                    log.info("resumed from %s at step %d of %d", plan.resume_path, self.iteration, self.total_steps)

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
        ckpt.before_first(self.iteration)  # a preemption during start-up: exit 75, nothing saved
        while self.iteration < self.total_steps:
            epoch, k, idx = next(self.cursor)
            rec = self.train_step(epoch, idx)
            self.iteration += 1
            self.hooks.at("train_step", self.iteration - 1)  # TEST HOOK: after optimizer step `iteration - 1`
            if k == per_epoch - 1 or self.iteration >= self.total_steps:  # end of an epoch (or of the run)
                rec.update(self.evaluate())
            self.logger.log(rec)
            self.records.append(rec)
            if is_main:
                log.info("step %d/%d (epoch %d) %s", self.iteration, self.total_steps, epoch,
                         "  ".join(f"{key} {v:.4g}" for key, v in rec.items()
                                   if key.startswith(self.name + "/") and not key.endswith("/lr")
                                   and isinstance(v, float)))
            ckpt.after_iteration(self.iteration, last=self.iteration >= self.total_steps)  # also: preemption
        if ckpt.save_interval and ckpt.last_saved != self.iteration:
            ckpt.save(self.iteration)
        self.export()
        return self.records

    def export(self, out_dir: Optional[str] = None) -> str:
        """The trained model as a Hugging Face folder (default `<output_dir>/model`). Collective."""
        out_dir = out_dir or self.plan.run_dir.model
        export_engine(self.engine, self.plan.model.stage, out_dir, self.tokenizer, self.dist.is_main)
        if self.dist.is_main:
            log.info("model written to %s", out_dir)
        return out_dir


def build_supervised(cfg: Any, trainer_cls: type, argv: Optional[list] = None,
                     hooks: Optional[TestHooks] = None) -> SupervisedTrainer:
    """The recipe in the module docstring: everything checked, then one engine built; returns the trainer."""
    plan = plan_supervised(cfg, trainer_cls)  # raises before the run directory changes or any weight is read
    prepare_run_dir(plan, argv)
    dist, t, data = plan.dist, cfg.train, plan.data
    if dist.is_main:
        n_eval = 0 if data.eval is None else len(data.eval)
        log.info("%s: %d train / %d eval rows; mini-batch %d/rank (%d x %d accumulation) x %d ranks -> %d optimizer "
                 "steps per epoch (%d rows per epoch dropped: short last global batch); %d steps in all",
                 trainer_cls.name, len(data.train), n_eval, t.mini_batch_size, t.per_device_training_batch_size,
                 t.gradient_accumulation_steps, dist.world_size, plan.sampler.batches_per_epoch,
                 plan.sampler.dropped_per_epoch, plan.total_steps)
    torch.manual_seed(cfg.seed)  # a new score head depends on the seed only (identical on every rank)
    m = plan.model
    engine, ds_cfg = build_role_engine(cfg.model, m.path, kind=trainer_cls.kind, stage=m.stage, dtype=m.dtype,
                                       train=True, batch=t, world_size=dist.world_size,
                                       eval_micro_batch_size=t.per_device_eval_batch_size,
                                       num_training_steps=plan.total_steps, pad_token_id=int(plan.tokenizer.pad_token_id),
                                       matmul=m.matmul)
    write_ds_configs(plan, {trainer_cls.role: ds_cfg})
    logger = RunLogger.from_config(cfg, dist.is_main, flat_dict(cfg), total_iterations=plan.total_steps,
                                   plot_keys=trainer_cls.plot_keys, bar_desc=trainer_cls.name.upper(),
                                   bar_keys=trainer_cls.bar_keys)
    return trainer_cls(plan, engine, logger, hooks=hooks)


def run_supervised(cfg: Any, trainer_cls: type, argv: Optional[list] = None,
                   hooks: Optional[TestHooks] = None) -> SupervisedTrainer:
    trainer = build_supervised(cfg, trainer_cls, argv, hooks)
    with trainer.logger:  # closes wandb / TensorBoard and writes metrics.png, also after a failure
        trainer.train()
    return trainer


def safe_exp(x: float) -> Optional[float]:
    """exp(x), or None (the key is omitted) when it overflows."""
    try:
        return math.exp(x)
    except OverflowError:
        return None

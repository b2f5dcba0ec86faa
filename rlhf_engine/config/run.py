"""Where a run writes and how it survives: the run directory, checkpoints and resume, timeouts, preemption signals,
metrics sinks. One section shared by the PPO, SFT and reward-model configs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import Problems
from .fields import check_positive, is_number, opt


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl: wandb (offline without WANDB_API_KEY), TensorBoard and the plot."""

    wandb_project: str = opt("", "wandb project; '' = wandb off. Files go to <output_dir>/wandb; offline unless "
                             "WANDB_API_KEY is set (and WANDB_MODE is not offline).")
    wandb_entity: str = opt("", "wandb entity (team or user); '' = your default.")
    wandb_run_name: str = opt("", "wandb run name; '' = wandb picks one.")
    wandb_sample_interval: int = opt(10, "Log a wandb table of prompt / response / score every N iterations.")
    tensorboard: bool = opt(False, "Also write TensorBoard scalars to <output_dir>/tensorboard (needs tensorboard or "
                            "tensorboardX installed; otherwise one warning).")
    plot: bool = opt(True, "Write <output_dir>/metrics.png when the run ends (matplotlib: about half a second of the "
                     "main rank's time, the other ranks waiting). Off for sweeps of many short runs read from "
                     "metrics.jsonl or wandb.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "wandb_sample_interval")
        if is_number(self.wandb_sample_interval) and not isinstance(self.wandb_sample_interval, int):
            p.add(prefix + "wandb_sample_interval", self.wandb_sample_interval, "must be a whole number")


PREEMPT_SIGNALS = ("USR1", "USR2", "TERM")


@dataclass
class RunConfig:
    """The run directory, checkpoints and resume, collective timeouts and preemption signals. A "step" below is a PPO
    iteration, or an optimizer step of SFT and reward-model training."""

    output_dir: str = opt("runs/ppo", "Run directory: metrics.jsonl, resolved configs, checkpoints; SFT and "
                          "reward-model runs also export the trained model to <output_dir>/model (Hugging Face "
                          "format).")
    overwrite_output_dir: bool = opt(False, "Start a new run in an output_dir that holds another run: its files "
                                     "are kept, moved aside as <name>.<timestamp>.bak (nothing is deleted or "
                                     "overwritten).")
    resume: str = opt("", "Resume: '' = no; 'auto' = the newest complete checkpoint under <output_dir>/checkpoints "
                      "(none: start at step 0, so a requeued job can always pass it); or a path: a checkpoint folder "
                      "(iter_NNNNNN, with its COMPLETE marker) or a run folder (its newest complete one). Continues "
                      "exactly where the checkpoint stopped (weights, optimizers, schedules, data position, random "
                      "generators, PPO's KL controller).")
    resume_force: bool = opt(False, "Resume although world size, models, seed, data or batch arithmetic differ from "
                             "the checkpoint's run (otherwise refused, naming every differing key); not an exact "
                             "continuation.")
    save_interval: int = opt(0, "Save a checkpoint every N steps to <output_dir>/checkpoints/iter_NNNNNN (0 = only at "
                             "the end). PPO always saves its end; SFT and reward-model runs with 0 keep only the "
                             "exported model.")
    save_interval_minutes: float = opt(0.0, "Also save a checkpoint once M minutes have passed since the last one, "
                                       "at the next step boundary, every rank agreeing (0 = off). For preemptible "
                                       "jobs: bounds the work lost to a kill that comes without a signal. Works "
                                       "beside save_interval.")
    keep_last: int = opt(2, "Keep the newest K complete checkpoints; older complete ones are deleted after a new one "
                         "is complete (0 = keep all). Incomplete folders are never deleted.")
    dist_timeout_minutes: Optional[float] = opt(None, "Timeout of every collective operation (and of the start-up "
                                                "rendezvous), in minutes: a rank that stalls or dies ends the job "
                                                "after this long instead of hanging. None = the DEEPSPEED_TIMEOUT "
                                                "environment variable, else 10 (PyTorch's default).")
    preempt_signals: str = opt("auto", "Signals that ask the run to stop at the next boundary with a complete "
                               "checkpoint (exit 75), comma-separated from USR1, USR2, TERM. 'auto' = USR1, plus TERM "
                               "inside a SLURM job. Outside SLURM TERM keeps its default (the launchers tear a failed "
                               "job's ranks down with it); add TERM for torchrun elastic agents and Kubernetes, whose "
                               "notice is a SIGTERM. The deepspeed launcher sends SIGKILL 30 s after its SIGTERM: see "
                               "docs/checkpoints.md, Preemption, for the time a save needs.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.resume, str):
            p.add(prefix + "resume", self.resume, "must be '' (no), 'auto' or a checkpoint path")
        elif self.resume and self.overwrite_output_dir is True:
            p.add(prefix + "overwrite_output_dir", True, f"cannot be combined with resume ({self.resume!r}): resume "
                  "continues the run in output_dir, overwrite_output_dir starts a new one; drop one of them")
        for n in ("save_interval", "keep_last"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.add(prefix + n, v, "must be a whole number >= 0")
        m = self.save_interval_minutes
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not m >= 0 or m == float("inf"):
            p.add(prefix + "save_interval_minutes", m, "must be a number of minutes >= 0 (0 = off)")
        t = self.dist_timeout_minutes
        if t is not None and not (is_number(t) and t > 0):
            p.add(prefix + "dist_timeout_minutes", t, "must be > 0 (minutes), or None for DEEPSPEED_TIMEOUT / 10")
        value = self.preempt_signals
        names = [n.strip().upper().removeprefix("SIG") for n in str(value).split(",")] if value != "auto" else []
        if not isinstance(value, str) or not value.strip() or any(n not in PREEMPT_SIGNALS for n in names):
            p.add(prefix + "preempt_signals", value, "must be 'auto' or a comma-separated list of "
                  f"{', '.join(PREEMPT_SIGNALS)}")

"""Everything the trainer logs into the run directory: one facade, `RunLogger`. The paths and the output-dir policy
are `run_dir.py`'s; the secret redaction of every file we write is `redact.py`'s.

What `RunLogger` writes (rank 0; other ranks write nothing):

| file | written by |
|---|---|
| `metrics.jsonl` | `RunLogger.log`, one line per iteration (always) |
| `samples.jsonl` | `RunLogger.log_samples`, one line per prompt/response/score (always) |
| `wandb/offline-run-*` or `wandb/run-*` | wandb, when `wandb_project` is set |
| `tensorboard/` | TensorBoard scalars, when `tensorboard` is on and tensorboard or tensorboardX is installed |
| `metrics.png` | `RunLogger.close`: score, KL, response length, policy and value loss vs iteration |

Secrets: `redact` replaces the value of every environment variable whose name contains KEY, TOKEN, SECRET, PASSWORD or
PASSWD (values of 6+ characters; TOKENIZERS_PARALLELISM is no secret) wherever it appears in a string, and the value of
any mapping key / command-line flag named like a secret (`api_key`, `hf_token`, `--wandb-api-key=...`,
`client_secret`, `password`; not `pad_token`-style special-token names). The config given to wandb, config.json,
command.txt and samples.jsonl all go through it, and wandb's own record of the command line (`sys.argv`) is redacted
while wandb starts.

wandb mode: `disabled` if WANDB_MODE=disabled (or WANDB_DISABLED is true); `offline` if WANDB_MODE is offline/dryrun
or WANDB_API_KEY is unset or empty (a key stored by `wandb login` alone is not used: export WANDB_API_KEY to go
online); otherwise `online`, falling back to `offline` with a warning when the online start fails (no network).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, Iterator, Mapping, Optional, Sequence

from .metrics import MetricsWriter, _plain
from .plot import PLOT_KEYS, plot_metrics
from .redact import redact, redact_argv
from .run_dir import RunDir

log = logging.getLogger("rlhf_engine.outputs")

_TRUE = ("1", "true", "yes", "on")

# ---- wandb -------------------------------------------------------------------------------------------------------
def wandb_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """'disabled', 'offline' or 'online' (the module docstring gives the rule)."""
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE", "").strip().lower()
    if mode == "disabled" or env.get("WANDB_DISABLED", "").strip().lower() in _TRUE:
        return "disabled"
    if mode in ("offline", "dryrun") or not env.get("WANDB_API_KEY", "").strip():
        return "offline"
    return "online"


@contextlib.contextmanager
def _redacted_sys_argv() -> Iterator[None]:
    """wandb records sys.argv in its run metadata: show it the redacted command line while it starts."""
    saved = sys.argv
    sys.argv = redact_argv(saved) if saved else saved
    try:
        yield
    finally:
        sys.argv = saved


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class RunLogger:
    """The one metrics facade of a run: metrics.jsonl always, wandb and TensorBoard when asked, a progress bar,
    samples.jsonl, and metrics.png at the end. Every method is a no-op on ranks other than the main one.

        logger = RunLogger(cfg.run.output_dir, dist.is_main, flat_dict(cfg), wandb_project=cfg.logging.wandb_project, ...)
        # or RunLogger.from_config(cfg, dist.is_main, flat_dict(cfg))
        logger.log(record)                                  # record["iteration"]: the step for wandb / TensorBoard
        logger.log_samples(it, prompts, responses, scores)  # samples.jsonl; a wandb table every N iterations
        logger.close()                                      # wandb finish, metrics.png
    """

    # progress-bar postfix: label -> metric key (PPO's; SFT and reward-model runs pass their own)
    BAR_KEYS = (("score", "objective/score"), ("kl", "objective/kl"))

    def __init__(self, output_dir: str, is_main: bool, config: dict, wandb_project: str = "",
                 wandb_entity: str = "", wandb_run_name: str = "", wandb_sample_interval: int = 10,
                 tensorboard: bool = False, total_iterations: int = 0, plot_keys: Sequence[str] = PLOT_KEYS,
                 bar_desc: str = "PPO", bar_keys: Sequence[tuple[str, str]] = BAR_KEYS, resume: bool = False,
                 plot: bool = True):
        self.output_dir, self.is_main = output_dir, is_main
        self.plot_keys, self.bar_keys, self.plot = tuple(plot_keys), tuple(bar_keys), plot
        self.wandb_sample_interval = max(1, int(wandb_sample_interval))
        self.run_dir = RunDir(output_dir)
        self.metrics = MetricsWriter(output_dir, enabled=is_main)
        self.samples_path = self.run_dir.samples
        self.png_path: Optional[str] = None
        self._wandb: Any = None
        self._tb: Any = None
        self._bar: Any = None
        self._closed = False
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        if wandb_project:
            self._wandb = self._start_wandb(wandb_project, wandb_entity, wandb_run_name, config, resume)
        if tensorboard:
            self._tb = self._start_tensorboard()
        if total_iterations:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_iterations, desc=bar_desc, unit="it", dynamic_ncols=True, file=sys.stderr)

    @classmethod
    def from_config(cls, cfg: Any, is_main: bool, config: dict, **kwargs: Any) -> "RunLogger":
        """From a run config (`cfg.run.output_dir`, `cfg.logging.*`, `cfg.run.resume`); `config` is what wandb records (e.g.
        `config.flat_dict(cfg)`); `kwargs` go to the constructor (`total_iterations` for the progress bar, and the
        supervised runs' plot and bar keys)."""
        lg = cfg.logging
        return cls(cfg.run.output_dir, is_main, config, wandb_project=lg.wandb_project, wandb_entity=lg.wandb_entity,
                   wandb_run_name=lg.wandb_run_name, wandb_sample_interval=lg.wandb_sample_interval,
                   tensorboard=lg.tensorboard, resume=bool(cfg.run.resume), plot=lg.plot, **kwargs)

    # ---- sinks -------------------------------------------------------------------------------------------------
    def _start_wandb(self, project: str, entity: str, name: str, config: dict, resume: bool) -> Any:
        """wandb.init inside the run directory. A resumed run continues the wandb run of the run directory (its id is
        kept in <output_dir>/wandb/run_id): one run on the dashboard across preemptions and requeues."""
        try:
            import wandb
        except ImportError:
            log.warning("wandb_project is set but wandb is not installed (pip install wandb); logging to "
                        "metrics.jsonl only")
            return None
        mode = wandb_mode()
        kwargs = dict(project=redact(project), entity=redact(entity) or None, name=redact(name) or None,
                      dir=self.output_dir, config=redact(config), mode=mode)  # wandb writes all of them to disk
        id_file = self.run_dir.wandb_id
        previous = _read_text(id_file) if resume else ""
        if previous:  # the records after the checkpoint come again: wandb keeps the first (equal) values
            kwargs.update(id=previous, resume="allow")
            log.info("wandb continues run %s (%s)", previous, id_file)
        if mode == "offline":
            log.info("wandb runs offline (no WANDB_API_KEY, or WANDB_MODE=offline): files in %s/wandb; upload later "
                     "with `wandb sync`", self.output_dir)
        with _redacted_sys_argv():
            run = None
            try:
                run = wandb.init(**kwargs)
            except Exception as e:
                if mode != "online":
                    log.warning("wandb could not start (%s: %s); logging to metrics.jsonl only", type(e).__name__, e)
                    return None
                log.warning("wandb could not start online (%s: %s); falling back to offline", type(e).__name__, e)
            if run is None:
                try:
                    run = wandb.init(**{**kwargs, "mode": "offline"})
                except Exception as e:
                    log.warning("wandb could not start offline either (%s: %s); logging to metrics.jsonl only",
                                type(e).__name__, e)
                    return None
        if run.id != previous:
            os.makedirs(os.path.dirname(id_file), exist_ok=True)
            with open(id_file, "w") as f:
                f.write(run.id + "\n")
        return run

    def _start_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                log.warning("tensorboard is on but neither tensorboard nor tensorboardX is installed "
                            "(pip install tensorboard); TensorBoard scalars are not written")
                return None
        return SummaryWriter(log_dir=self.run_dir.tensorboard)

    # ---- API -----------------------------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        """One iteration's metrics (`record["iteration"]` is the step): metrics.jsonl, wandb, TensorBoard, bar."""
        if not self.is_main:
            return
        self.metrics.write(record)
        step = int(record["iteration"])
        clean = {k: v for k, v in ((k, _plain(k, v)) for k, v in record.items()) if v is not None}
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._tb is not None:
            for k, v in clean.items():
                if k != "iteration" and _scalar(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.n = min(step + 1, self._bar.total or step + 1)  # absolute: right after a resume too
            post = {name: clean[k] for name, k in self.bar_keys if _scalar(clean.get(k))}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in post.items()}, refresh=False)
            self._bar.refresh()

    write = log  # MetricsWriter-compatible: a RunLogger can stand where the trainer takes a MetricsWriter

    def log_samples(self, iteration: int, prompts: Sequence[str], responses: Sequence[str],
                    scores: Sequence[float]) -> None:
        """Append one line per sample to samples.jsonl; every `wandb_sample_interval` iterations (iteration % N == 0)
        also log a wandb table `samples` of prompt / response / score."""
        if not self.is_main:
            return
        if not len(prompts) == len(responses) == len(scores):
            raise ValueError(f"log_samples: {len(prompts)} prompts, {len(responses)} responses, {len(scores)} scores")
        rows = [[str(p), str(r), _plain("score", s)] for p, r, s in zip(prompts, responses, scores)]
        rows = redact(rows)
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for p, r, s in rows:
                f.write(json.dumps({"iteration": int(iteration), "prompt": p, "response": r, "score": s}) + "\n")
        if self._wandb is not None and int(iteration) % self.wandb_sample_interval == 0:
            import wandb

            table = wandb.Table(columns=["iteration", "prompt", "response", "score"],
                                data=[[int(iteration), p, r, s] for p, r, s in rows])
            self._wandb.log({"samples": table}, step=int(iteration))

    def close(self, failed: bool = False) -> Optional[str]:
        """Finish wandb, close TensorBoard and metrics.jsonl, write metrics.png unless the plot is off (also after a
        failure: the plot of what was logged). Returns the PNG path (None: nothing logged, the plot off, or not the
        main rank). Idempotent."""
        if not self.is_main or self._closed:
            return self.png_path
        self._closed = True
        self.metrics.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=1 if failed else 0)
            except Exception as e:  # never let the sink hide the run's own outcome
                log.warning("wandb finish failed: %s: %s", type(e).__name__, e)
        if not self.plot:
            return None
        try:
            self.png_path = plot_metrics(self.run_dir.metrics, self.run_dir.plot, keys=self.plot_keys)
        except Exception as e:
            log.warning("metrics.png not written: %s: %s", type(e).__name__, e)
        return self.png_path

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)

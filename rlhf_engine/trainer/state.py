"""The trainer's own checkpoint state, per rank, and the checkpoint / resume / export flow of a PPO run.

A checkpoint (layout and marker: rlhf_engine/outputs/checkpoint.py) holds the engines' DeepSpeed state and one
`state_rank<r>.pt` per rank, written by `Checkpointer.save`:

    {"format": 1, "rank": r, "world_size": W, "iteration": n,
     "providers": {"trainer": {"iteration": n}, "rng": {...}, "data": {...}, "kl_controller": {...}, ...}}

The providers are `trainer.state_providers` (name -> object with `state_dict()` / `load_state_dict(state)`) plus
"trainer" and "rng", which this module adds itself; they are taken when the trainer builds its Checkpointer, so a
provider is registered before that. The trainer registers "data" (the prompt `DataCursor`) and
"kl_controller"; a ptx data cursor ("ptx_data") or a reward normalizer ("reward_normalizer") slot in the same way:
register them in `state_providers` and they are saved and restored with every checkpoint. A provider the run has
but the checkpoint lacks is an error on resume (unless --resume_force); one the checkpoint has but the run lacks is
logged and ignored.

"rng" is per rank: python `random`, numpy, the torch CPU generator and, with CUDA, the current device's generator.
It is restored last, after the engines were loaded, right before training continues.
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..comm import all_gather_object, barrier, broadcast_object, run_on_main
from ..errors import ConfigError, Problem
from ..hooks import TestHooks
from ..outputs import checkpoint as ckpt
from .preemption import Boundary

log = logging.getLogger(__name__)

STATE_FORMAT = 1


# ---- providers ---------------------------------------------------------------------------------------------------
class RNGState:
    """This rank's random generators: python `random`, numpy's global generator, torch CPU and (with CUDA) the current
    device. Everything is stored as plain python values and tensors (loads with `weights_only=True`)."""

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"python": random.getstate(),
                 "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(_tuples(state["python"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def rederive_generators(seed: int, rank: int, iteration: int) -> int:
    """Fresh generators for a rank that has no saved ones (a resume on another world size): python, numpy and torch
    seeded with seed + 1_000_003 * iteration + rank, so no iteration repeats another's draws. Returns that seed."""
    value = int(seed) + 1_000_003 * int(iteration) + int(rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    return value


def _tuples(x: Any) -> Any:
    """random.setstate needs tuples (a state that went through a list-producing format is converted back)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


class _Counter:
    """The "trainer" provider: the iteration counter."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"iteration": int(self.trainer.iteration)}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.iteration = int(state["iteration"])


def providers_of(trainer: Any) -> dict:
    """Every state provider of a trainer, in restore order ("rng" last)."""
    out = {"trainer": _Counter(trainer)}
    out.update(getattr(trainer, "state_providers", {}) or {})
    out["rng"] = RNGState()
    return out


# ---- run identity ------------------------------------------------------------------------------------------------
FINGERPRINT_BATCH = ("generation_batches", "n_samples_per_prompt")  # besides the global sizes below


def global_batch_sizes(cfg: Any, world_size: int) -> dict:
    """The batch sizes a resume must keep, over all ranks: prompts per generation step (the data order's global
    batch) and the PPO mini-batch. Another world size resumes when these stay (per-device sizes and gradient
    accumulation absorb the change)."""
    b = cfg.batch
    return {"global_generation_batch_size": b.per_device_generation_batch_size * world_size,
            "global_mini_batch_size": b.mini_batch_size * world_size}


def run_fingerprint(cfg: Any, roles: Mapping[str, Any], world_size: int, num_prompts: int) -> dict:
    """What must not change between a run and its resume, as flat keys named like the flags: the global batch sizes
    (not the world size: another one resumes, `global_batch_sizes`), each role's model (path, ZeRO stage and
    resolved dtype of the trained roles, from the planned `roles`), the reward function, the seed, the data (path
    and usable prompts), the batch arithmetic and PPO epochs (the LR schedule's length depends on them, and on
    max_steps when a role's schedule decays)."""
    fp: dict = {**global_batch_sizes(cfg, world_size), "seed": cfg.seed, "reward_fn": cfg.scoring.reward_fn or cfg.scoring.reward_url,
                "data_path": cfg.data.data_path, "num_prompts": int(num_prompts), "ppo_epochs": cfg.ppo.ppo_epochs,
                "advantage_estimator": cfg.ppo.advantage_estimator, "loss_agg_mode": cfg.ppo.loss_agg_mode}
    for role, plan in roles.items():
        fp[f"{role}_model_name_or_path"] = _norm_path(plan.path)
    if "reference" not in roles:  # none built (nothing reads it): the run's reference all the same, as before
        fp["reference_model_name_or_path"] = _norm_path(cfg.reference.model_name_or_path or roles["actor"].path)
    trained = [r for r, plan in roles.items() if plan.train]
    for role in trained:
        rc = getattr(cfg, role)
        fp[f"{role}_zero_stage"] = roles[role].stage
        fp[f"{role}_dtype"] = roles[role].dtype
        for name in ("lora_dim", "trainable_layers"):  # per-role settings that change the trained weights
            if hasattr(rc, name):
                fp[f"{role}_{name}"] = getattr(rc, name)
    if cfg.engine.enable_ema:
        fp["enable_ema"] = True
    if cfg.env.on:  # only then: single-turn checkpoints resume as they were
        fp.update(environment=cfg.env.environment, max_turns=cfg.env.max_turns,
                  max_episode_tokens=cfg.response_budget)
    if cfg.ppo.policy_loss != "ppo_clip":  # only then: checkpoints from before the registry resume as they were
        fp["policy_loss"] = cfg.ppo.policy_loss
    for name in FINGERPRINT_BATCH:
        fp[name] = getattr(cfg.batch, name)
    if any(getattr(cfg, r).lr_scheduler_type in ("linear", "cosine") for r in trained):
        fp["max_steps"] = cfg.max_steps  # the decaying schedule spans max_steps iterations
    return fp


def supervised_fingerprint(cfg: Any, model: Any, world_size: int, num_rows: int) -> dict:
    """`run_fingerprint` of an SFT or reward-model run (one trained model, its flags flat; `model` its RolePlan)."""
    m, t = cfg.model, cfg.train
    fp = {"global_mini_batch_size": t.mini_batch_size * int(world_size), "seed": cfg.seed,
          "data_path": cfg.data.data_path, "num_rows": int(num_rows), "model_name_or_path": _norm_path(model.path),
          "zero_stage": model.stage, "dtype": model.dtype, "lora_dim": m.lora_dim,
          "trainable_layers": m.trainable_layers}
    if m.lr_scheduler_type in ("linear", "cosine"):  # the decaying schedule spans every step of the run
        fp.update(num_train_epochs=t.num_train_epochs, max_steps=t.max_steps)
    return fp


def _norm_path(path: str) -> str:
    """Local folders compare by absolute path (a relative path from another working directory is the same model);
    hub ids as given."""
    if path and os.path.isdir(os.path.expanduser(path)):
        return os.path.realpath(os.path.expanduser(path))
    return path


# ---- checkpoints -------------------------------------------------------------------------------------------------
class Checkpointer:
    """Checkpoints, resume and the final export of one run (PPO; the SFT / reward-model loop uses save and load).

    * `before_first(it)`: the boundary before this attempt's first iteration: a preemption request ends the run
      (exit 75) with nothing new saved;
    * `after_iteration(it, last)`: a checkpoint every `save_interval` iterations (0 = none between), or once
      `save_interval_minutes` have passed, or on a preemption request, which then ends the run (exit 75) unless
      this was the last iteration (trainer/preemption.py; one tiny collective per call);
    * `finish(it)`: the checkpoint at the end (unless this iteration was just saved) and the export;
    * `save(it)`: engines + per-rank state, barrier, marker (rank 0), rotation (keep_last);
    * `load(path)`: the reverse, into freshly built engines and providers of the same run.

    It takes what it saves: the engine (an RLHFEngine, or anything with `dist`, `save(path) -> roles`,
    `load(path)`, collective), the state providers (`providers_of`: name -> `state_dict()` / `load_state_dict()`,
    "rng" last), the run directory, and the run's fingerprint, written into every marker. `export_dir`: where
    `finish` exports the trained roles (None: no export).
    """

    def __init__(self, engine: Any, providers: Mapping[str, Any], run_dir: Any, fingerprint: Mapping[str, Any], *,
                 save_interval: int = 0, keep_last: int = 0, seed: int = 0, export_dir: Optional[str] = None,
                 save_interval_minutes: float = 0.0, hooks: Optional[TestHooks] = None):
        self.engine, self.providers, self.fingerprint = engine, dict(providers), dict(fingerprint)
        self.root = run_dir.checkpoints
        self.boundary = Boundary(engine.dist, run_dir.root, save_interval_minutes)
        self.save_interval, self.keep_last, self.seed = int(save_interval or 0), int(keep_last or 0), seed
        self.export_dir = export_dir
        self.hooks = hooks or TestHooks()  # a save cut short, providers a resume leaves alone (never in a real run)
        self.last_saved: Optional[int] = None  # iteration of the newest checkpoint this run saved or loaded
        self.resumed_from: Optional[str] = None

    @property
    def dist(self):
        return self.engine.dist

    # ---- when ----------------------------------------------------------------------------------------------------
    def before_first(self, it: int) -> None:
        stop, _ = self.boundary.poll()
        if stop:  # nothing trained in this attempt: the checkpoint it resumed from (if any) is the newest
            raise self.boundary.stop(it, self.resumed_from)

    def after_iteration(self, it: int, last: bool = False) -> Optional[str]:
        path = None
        if self.save_interval and it % self.save_interval == 0 and it != self.last_saved:
            path = self.save(it)
        # polled after that save: a signal that arrived during it is answered without saving twice
        stop, due = self.boundary.poll()
        stop = stop and not last  # the last iteration: the run ends normally (final checkpoint, export)
        if (due or stop) and it != self.last_saved:
            path = self.save(it)
        if stop:
            raise self.boundary.stop(it, path or os.path.join(self.root, ckpt.tag_for(it)))
        return path

    def finish(self, it: int) -> Optional[str]:
        """End of training: the final checkpoint (if not already taken at this iteration), then the export."""
        path = None
        if it != self.last_saved:
            path = self.save(it)
        if self.export_dir:
            self.export(self.export_dir)
        return path

    # ---- save ----------------------------------------------------------------------------------------------------
    def save(self, it: int) -> str:
        dist = self.dist
        it = int(it)
        tag = ckpt.tag_for(it)
        path = os.path.join(self.root, tag)
        t0 = time.perf_counter()
        if dist.is_main:
            ckpt.prepare_tag_dir(self.root, tag)
        barrier()
        roles = self.engine.save(path)  # collective; DeepSpeed writes <path>/<role>/
        self.hooks.at("checkpoint", it)  # TEST HOOK: a save cut short between files
        # the RNG is captured after the engines were saved: exactly what the next iteration starts from
        state = {"format": STATE_FORMAT, "rank": dist.rank, "world_size": dist.world_size, "iteration": it,
                 "providers": {name: p.state_dict() for name, p in self.providers.items()}}
        target = os.path.join(path, ckpt.state_file(dist.rank))
        with open(target + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(target + ".tmp", target)
        barrier()  # every rank has finished every file

        def complete() -> None:  # rank 0: the marker, then the rotation (deleting large folders takes its time)
            ckpt.write_marker(path, {
                "tag": tag, "iteration": it, "world_size": dist.world_size, "roles": roles,
                "state_files": [ckpt.state_file(r) for r in range(dist.world_size)],
                "providers": sorted(state["providers"]), "fingerprint": self.fingerprint or {},
                "files": ckpt.file_sizes(path), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            deleted = ckpt.rotate(self.root, self.keep_last)
            log.info("checkpoint %s saved in %.2fs%s", path, time.perf_counter() - t0,
                     f"; removed {', '.join(os.path.basename(d) for d in deleted)} (keep_last {self.keep_last})"
                     if deleted else "")

        run_on_main(complete, f"complete the checkpoint {path}")
        self.last_saved = it
        self.boundary.saved()
        return path

    # ---- load ----------------------------------------------------------------------------------------------------
    def load(self, path: str, force: bool = False) -> int:
        """Restore a complete checkpoint into the (freshly built) engines and providers: engines, then every
        provider, RNG last. Returns the checkpoint's iteration."""
        dist = self.dist
        meta = ckpt.read_marker(path)
        if meta is None:  # resolve_resume never returns such a folder; a direct call must not load one either
            raise ConfigError([Problem("resume", path, f"is not a complete checkpoint (no {ckpt.MARKER} marker)")],
                              "cannot resume")
        saved_world = int(meta.get("world_size") or dist.world_size)
        elastic = saved_world != dist.world_size  # the fingerprint kept the global batch sizes
        own = os.path.join(path, ckpt.state_file(dist.rank))
        fallback = not elastic and not os.path.isfile(own)
        if fallback and not force:
            raise ConfigError([Problem("resume", path, f"has no {ckpt.state_file(dist.rank)} (it was written by "
                                       f"{meta.get('world_size')} ranks); resume with that many ranks")],
                              "cannot resume")
        # another world size: every provider but the random generators holds the same state on every rank
        state_path = os.path.join(path, ckpt.state_file(0)) if elastic or fallback else own
        try:  # this rank's own state first (small): a corrupt file is named before the engines' weights are read
            state = torch.load(state_path, map_location="cpu", weights_only=True)
            saved = state["providers"]
        except Exception as e:  # noqa: BLE001  (any unreadable state file is a user-facing resume error)
            raise ConfigError([Problem("resume", path, f"{os.path.basename(state_path)} cannot be read "
                                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the "
                                       "checkpoint is corrupt: resume from an earlier one (--resume "
                                       "<output_dir>/checkpoints/iter_NNNNNN) or restore the file")],
                              "cannot resume") from e
        self.engine.load(path, universal=elastic)
        providers = self.providers
        missing = [n for n in providers if n not in saved]
        if missing and not force:
            raise ConfigError([Problem(n, "(not in the checkpoint)", f"the run keeps state {n!r} that the "
                                       f"checkpoint {path} lacks; pass --resume_force to start it fresh")
                               for n in missing], "cannot resume")
        extra = sorted(set(saved) - set(providers))
        if extra and dist.is_main:
            log.warning("checkpoint state not used by this run: %s", ", ".join(extra))
        skip = set(self.hooks.skip_on_resume) | set(missing)
        if fallback:
            skip.add("rng")  # another rank's generators would repeat its samples: this rank starts fresh
            torch.manual_seed(self.seed + dist.rank)
            log.warning("--resume_force: rank %d has no state file in %s; using rank 0's, with fresh random "
                        "generators", dist.rank, path)
        if elastic:
            skip.add("rng")
            seed = rederive_generators(self.seed, dist.rank, int(state["iteration"]))
            if dist.is_main:
                log.warning("resuming %s, written by %d ranks, on %d: optimizer state re-partitioned (DeepSpeed "
                            "universal checkpoint), data position kept; the random generators are re-derived "
                            "(rank r seeds %d + r), so sampling differs from an uninterrupted run",
                            path, saved_world, dist.world_size, seed - dist.rank)
        for name, provider in providers.items():
            if name in skip:
                continue
            if getattr(provider, "strict_on_resume", False):  # data positions: --resume_force remaps them
                provider.load_state_dict(saved[name], strict=not force)
            else:
                provider.load_state_dict(saved[name])
        barrier()
        self.last_saved = int(state["iteration"])
        self.resumed_from = path
        return self.last_saved

    # ---- export --------------------------------------------------------------------------------------------------
    def export(self, out_dir: str) -> list[str]:
        """The final actor and critic (and EMA) as Hugging Face folders `<out_dir>/<role>` (ZeRO-3 consolidated, LoRA
        merged by the engine's export, tokenizer saved). Collective."""
        engine = self.engine
        roles = [r for r in (*engine.trained_roles, "ema") if r in engine.engines]
        for role in roles:
            engine.export(role, os.path.join(out_dir, role))
        if self.dist.is_main:
            log.info("exported %s to %s", ", ".join(roles), out_dir)
        return [os.path.join(out_dir, r) for r in roles]


# ---- resume at build time ----------------------------------------------------------------------------------------
def resolve_and_check(cfg: Any, dist: Any, fingerprint: dict) -> Optional[str]:
    """Before any weight is loaded: find the checkpoint `cfg.run.resume` names (rank 0 decides, every rank follows) and
    compare its run fingerprint with this run's, `fingerprint` (`run_fingerprint` / `supervised_fingerprint`; a
    `ConfigError` naming every differing key unless `cfg.run.resume_force`). Returns the checkpoint path or None."""
    path, why = ckpt.resolve_resume(cfg.run.resume, cfg.run.output_dir) if cfg.run.resume else (None, "")
    path = broadcast_object(path)  # one decision, whatever each rank's view of the disk
    if cfg.run.resume and dist.is_main:
        log.info(why)
    if path:
        meta = ckpt.read_marker(path) or {}
        ckpt.check_fingerprint(meta.get("fingerprint", {}), fingerprint, path, force=bool(cfg.run.resume_force))
        _check_state_files(path, dist, force=bool(cfg.run.resume_force))
    return path


def _check_state_files(path: str, dist: Any, force: bool) -> None:
    """Every rank reads the state file it will resume from (small) before anything is written or moved: an
    unreadable one is a `ConfigError` naming it, raised on every rank alike (one all-gather)."""
    own = os.path.join(path, ckpt.state_file(dist.rank))
    # a rank without a file of its own (another world size, --resume_force) resumes from rank 0's
    target = own if os.path.isfile(own) else os.path.join(path, ckpt.state_file(0))
    problem = ""
    if os.path.isfile(target):  # a missing own file is refused (or tolerated by --resume_force) by Checkpointer.load
        try:
            _ = torch.load(target, map_location="cpu", weights_only=True)["providers"]
        except Exception as e:  # noqa: BLE001  (any unreadable state file is a user-facing resume error)
            problem = f"{os.path.basename(target)} cannot be read ({type(e).__name__}: " \
                      f"{str(e).splitlines()[0] if str(e) else ''})"
    bad = [p for p in all_gather_object(problem) if p]
    if bad:
        raise ConfigError([Problem("resume", path, f"{'; '.join(bad)}; the checkpoint is corrupt: resume from an "
                                   "earlier one (--resume <output_dir>/checkpoints/iter_NNNNNN) or restore the file")],
                          "cannot resume")


def after_resume_cleanup(cfg: Any, dist: Any, path: Optional[str]) -> None:
    """Rank 0, once the run directory is prepared: metrics/samples logged after the checkpoint are moved aside
    (they are logged again), and later checkpoints of the abandoned timeline too (so `--resume auto` never goes
    back to them)."""
    if not cfg.run.resume or not dist.is_main:
        return
    it = int((ckpt.read_marker(path) or {}).get("iteration", 0)) if path else 0
    ckpt.trim_after_resume(cfg.run.output_dir, it)
    if path and os.path.realpath(os.path.dirname(path)) == os.path.realpath(ckpt.checkpoints_root(cfg.run.output_dir)):
        ckpt.abandon_newer(os.path.dirname(path), it)

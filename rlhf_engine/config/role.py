"""One model's settings (actor, critic, reference, reward; the one model of steps 1 and 2)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import Problems
from .fields import CPU_BF16_MATMUL as MODES, DTYPES, SCHEDULERS, check_choice, check_positive, is_number, opt


@dataclass
class RoleConfig:
    """One model role (actor, critic, reference or reward) and how its DeepSpeed engine is placed."""

    model_name_or_path: str = opt("", "Local folder or hub id of the model (required for actor; see each role).")
    tokenizer_name_or_path: str = opt("", "Tokenizer folder or hub id ('' = the model's). PPO reward role: the reward "
                                      "model's own tokenizer when its vocabulary differs from the actor's (rows are "
                                      "decoded and re-encoded for it); '' = it reads the actor's token ids.")
    zero_stage: Optional[int] = opt(None, "ZeRO stage 0-3. None: actor/critic 0; reference/reward follow 3 when "
                                    "their trained counterpart uses 3, else 0 (eval-only engines must be 0 or 3).")
    offload: bool = opt(False, "Offload optimizer state (trained roles) or parameters (eval-only roles) to CPU.")
    offload_params: bool = opt(False, "Also offload parameters to CPU (ZeRO-3 only).")
    dtype: str = opt("", "auto, fp32, bf16 or fp16 ('' = the run's dtype; auto = bf16 on GPUs that support it, fp16 "
                     "on other GPUs, fp32 on CPU).")
    cpu_bf16_matmul: str = opt("auto", "bf16 on a CPU: how the Linear layers multiply. fp32 = widen the bf16 "
                               "operands (exact), use the fp32 kernel (fp32 accumulation, as a bf16 kernel's) and "
                               "round the product to bf16: weights, activations and gradients stay bf16; native = "
                               "PyTorch's bf16 kernels, which on a CPU without bf16 instructions measured up to 80x "
                               "slower (docs/configuration.md, bf16 on a CPU); auto = fp32 on a CPU whose flags "
                               "hold neither avx512_bf16 nor amx_bf16, else native. No effect on a GPU or for "
                               "fp32/fp16. Every role should resolve to the actor's (KL exactly 0 at lr 0 needs the "
                               "same kernels).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory (trained roles).")
    trainable_layers: int = opt(0, "Train only the top N transformer blocks (+ final norm and score head); the "
                                "embeddings and lower blocks stay frozen, so backward stops early (0 = train all).")
    learning_rate: float = opt(1e-6, "Peak learning rate (trained roles).")
    weight_decay: float = opt(0.0, "AdamW weight decay (trained roles).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = opt("constant", "Learning-rate schedule: " + ", ".join(SCHEDULERS) + ".")
    num_warmup_steps: int = opt(0, "Warm-up optimizer steps of the schedule.")
    gradient_clipping: float = opt(1.0, "Clip the global gradient norm to this value (0 = off).")
    use_chat_template: bool = opt(False, "reward only: score each sample as a conversation (the data's prompt as the "
                                  "user turn, the response as the assistant turn) through the reward tokenizer's "
                                  "chat template (tokenizer_name_or_path, else the reward model's own), instead of "
                                  "the actor's prompt text followed by the response.")
    init_from: str = opt("", "critic only: 'reward' (default: the reward model's weights) or 'actor' (the actor's "
                         "backbone with a new scalar head).")
    ds_config: str = opt("", "Optional DeepSpeed JSON merged over the built config of this role (keys validated).")
    lora_dim: int = opt(0, "LoRA rank (peft) of a trained role; 0 = off (full fine-tuning). With LoRA only the adapter "
                        "weights train (and the critic's scalar head); exports merge the adapter into plain weights.")
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_dim.")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA input. Must be 0 in PPO (old log-probs come from eval-mode "
                              "forwards, the update from training forwards: dropout would make the ratio differ from "
                              "1 at lr 0); steps 1 and 2 allow it.")
    lora_target_modules: str = opt("all-linear", "Modules that get an adapter: 'all-linear' (every Linear / Conv1D "
                                   "layer of the backbone; never the LM head or the score head) or comma-separated "
                                   "module names or name suffixes, e.g. 'q_proj,v_proj' or 'c_attn'.")
    attn_implementation: str = opt("auto", "Attention kernel, passed to transformers: auto = transformers' default "
                                   "(sdpa); or eager, sdpa, flash_attention_2, ... (every role should use the same "
                                   "one as the actor's reference for KL 0 at lr 0).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.attn_implementation, str) or not self.attn_implementation:
            p.add(prefix + "attn_implementation", self.attn_implementation, "name an attention implementation "
                  "(auto, eager, sdpa, ...)")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            p.add(prefix + "zero_stage", self.zero_stage, "must be 0, 1, 2 or 3")
        check_choice(p, prefix, self, "cpu_bf16_matmul", MODES)
        if self.dtype and self.dtype not in DTYPES:
            p.add(prefix + "dtype", self.dtype, f"must be one of {', '.join(DTYPES)} (or '' for the run's dtype)")
        check_positive(p, prefix, self, "learning_rate", "weight_decay", "num_warmup_steps", "gradient_clipping", "trainable_layers",
                  allow_zero=True)
        check_positive(p, prefix, self, "adam_eps")
        for n in ("adam_beta1", "adam_beta2"):
            if not (is_number(getattr(self, n)) and 0.0 <= getattr(self, n) < 1.0):
                p.add(prefix + n, getattr(self, n), "must lie in [0, 1)")
        check_choice(p, prefix, self, "lr_scheduler_type", SCHEDULERS)
        if self.offload_params and self.zero_stage not in (3, None):
            p.add(prefix + "offload_params", True, f"parameter offload needs zero_stage 3 (got {self.zero_stage})")
        if not (isinstance(self.lora_dim, int) and not isinstance(self.lora_dim, bool) and self.lora_dim >= 0):
            p.add(prefix + "lora_dim", self.lora_dim, "must be a whole number >= 0 (0 = LoRA off)")
        check_positive(p, prefix, self, "lora_alpha")
        if not (is_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0):
            p.add(prefix + "lora_dropout", self.lora_dropout, "must lie in [0, 1)")
        if not isinstance(self.lora_target_modules, str) or not [t for t in self.lora_target_modules.split(",")
                                                                 if t.strip()]:
            p.add(prefix + "lora_target_modules", self.lora_target_modules,
                  "give 'all-linear' or comma-separated module names")
        if self.lora_dim and getattr(self, "trainable_layers", 0):
            p.add(prefix + "lora_dim", self.lora_dim, f"cannot be combined with {prefix}trainable_layers "
                  f"({self.trainable_layers}): LoRA freezes every base weight; use one of them")

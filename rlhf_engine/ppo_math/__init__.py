"""PPO math for RLHF: log-probs, KL penalties, rewards, GAE, losses, KL controllers. Pure functions of tensors.

Imports torch only (and ``logit_kernels``, the torch-only chunked fp32 log-prob/entropy kernels behind
:func:`logprobs_from_logits` and :func:`entropy_from_logits`). Everything is computed in fp32 whatever the input
dtype (bf16/fp16 inputs are upcast; fp64 inputs are computed in fp32 too), and every result is fp32.

One module per concern; every public name is re-exported here (import from ``rlhf_engine.ppo_math``):

* ``checks.py``: the private input checks every function below shares;
* ``logprobs.py``: log-probs and entropy from logits, ``mask_stop_tokens_`` / ``STOP_MASK_VALUE``;
* ``kl.py``: the KL estimators (``KL_ESTIMATORS``) and ``kl_penalty``;
* ``advantages.py``: ``compute_rewards``, ``last_action_index``, ``compute_gae``, ``masked_whiten``;
* ``corrections.py``: ``rollout_correction`` and its modes;
* ``policy_losses.py``: ``policy_loss`` (PPO clip), ``gspo_loss``, ``cispo_loss``;
* ``losses.py``: ``loss_token_weights`` / ``LOSS_AGG_MODES``, ``kl_loss``, ``value_loss``;
* ``supervised_losses.py``: ``sft_loss``, ``pairwise_loss``;
* ``kl_controllers.py``: ``FixedKLController``, ``AdaptiveKLController``.

Conventions
-----------
* Per-token tensors cover the response actions only and have shape ``[B, R]`` (batch, response length).
* ``action_mask[b, t] == 1`` iff response token ``t`` of row ``b`` is a token the model wrote (EOS included). A
  single-turn response is right-padded, so its mask row reads ``1 ... 1 0 ... 0``; a multi-turn episode's row has
  holes ``1 1 0 0 1 1 0 0`` where observation and chat-template tokens sit (context: real tokens, no actions). Every
  function here takes either: per-token terms are computed at actions only, the score lands on the LAST action, and
  GAE and discounted returns pass over the holes (the next action's value is the next state's). Masks may be bool,
  integer or floating tensors holding only 0/1.
* Values at masked (padding) positions of any input are junk and never influence any result: inputs are selected
  with ``torch.where`` (not multiplied by the mask, so even NaN/inf junk cannot leak), and every per-token output is
  exactly 0 at padding.
* Bad input (shape/dtype mismatch, non-0/1 masks, out-of-range hyperparameters, unknown estimator names) raises
  ``ValueError`` naming the argument. Data-dependent checks (mask values, label range, finite scores) are batched into
  one host sync per call. The functions a trainer calls per micro-batch (:func:`logprobs_from_logits`,
  :func:`policy_loss`, :func:`value_loss`) take ``check=False`` to skip them for tensors already validated (each sync
  makes the host wait for the device instead of queueing the next kernels); shape, dtype and hyperparameter checks
  need no sync and always run.

Token-level loss aggregation across micro-batches and ranks
-----------------------------------------------------------
``policy_loss`` / ``value_loss`` return ``sum over real tokens of per-token loss / num_tokens``, where the trainer
passes ``num_tokens`` = the GLOBAL real-token count of the whole mini-batch (all micro-batches of all ranks). Then,
with shards ``s`` holding token sets ``T_s``,

    sum_s loss_s = sum_s (sum_{t in T_s} l_t) / N = (sum_t l_t) / N,   N = sum_s |T_s|,

which is exactly the full-batch token mean; gradients add up the same way (gradient accumulation sums, and the
data-parallel all-reduce must then SUM, or average with the world size folded into N). The naive alternative,
averaging per-shard means ``(1/S) sum_s (sum_{t in T_s} l_t) / |T_s|``, weights each token by ``1/(S |T_s|)``, so
tokens of short shards count more than tokens of long shards; it equals the full-batch mean only when all shards hold
the same number of tokens. With ``num_tokens=None`` the local token count is used (a plain local mean).

Stats are returned as detached 0-dim fp32 tensors (no host sync). Means (``approx_kl``, ``clipfrac``, ``ratio_mean``)
are local; to combine them across shards weight each by its ``tokens``; ``ratio_max``/``ratio_min`` combine with
MAX/MIN.
"""
from .advantages import compute_gae, compute_rewards, last_action_index, masked_whiten
from .corrections import RENAMED_CORRECTIONS, ROLLOUT_CORRECTIONS, rollout_correction
from .kl import KL_ESTIMATORS, kl_penalty
from .kl_controllers import AdaptiveKLController, FixedKLController
from .logprobs import (STOP_MASK_VALUE, entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits,
                       mask_stop_tokens_)
from .losses import LOSS_AGG_MODES, kl_loss, loss_token_weights, value_loss
from .policy_losses import cispo_loss, gspo_loss, policy_loss
from .supervised_losses import pairwise_loss, sft_loss

__all__ = [
    "KL_ESTIMATORS",
    "STOP_MASK_VALUE",
    "logprobs_from_logits",
    "logprobs_and_entropy_from_logits",
    "entropy_from_logits",
    "mask_stop_tokens_",
    "masked_whiten",
    "kl_penalty",
    "compute_rewards",
    "compute_gae",
    "last_action_index",
    "policy_loss",
    "LOSS_AGG_MODES",
    "loss_token_weights",
    "kl_loss",
    "ROLLOUT_CORRECTIONS",
    "RENAMED_CORRECTIONS",
    "gspo_loss",
    "cispo_loss",
    "rollout_correction",
    "value_loss",
    "sft_loss",
    "pairwise_loss",
    "FixedKLController",
    "AdaptiveKLController",
]

"""Train only the top of a model: freeze the embeddings and every transformer block below the top `k`.

Backward then stops at the lowest trainable block, which is what makes a 135M-parameter PPO run fit a laptop CPU.
"""
from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of transformer blocks of a Hugging Face decoder (Llama-style `layers`, GPT-2-style `h`)."""
    lists = [m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.split(".")[-1] in
             ("layers", "h", "blocks", "layer")]
    if not lists:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} (looked for a ModuleList "
                         "named layers, h, blocks or layer); train every layer instead (trainable_layers 0)")
    return max(lists, key=len)


def freeze_below_top(model: nn.Module, k: int, keep_trainable: tuple[str, ...] = ("score", "norm", "ln_f")) -> int:
    """Freeze every parameter except the top `k` blocks and the modules named in `keep_trainable` (final norm, score
    head). Returns the number of trainable parameters. k <= 0 leaves the model as it is."""
    if k <= 0:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = transformer_blocks(model)
    model.requires_grad_(False)
    for block in list(blocks)[-k:]:
        block.requires_grad_(True)
    block_ids = {id(m) for m in blocks.modules()}
    for name, module in model.named_modules():
        # the final norm / head sit outside the blocks; a norm inside a frozen block stays frozen
        if name.split(".")[-1] in keep_trainable and id(module) not in block_ids:
            module.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def mirror_requires_grad(model: nn.Module, like: nn.Module) -> int:
    """Give `model`'s parameters the requires_grad flags of `like`'s parameters of the same name; returns how many
    names matched.

    For the frozen reference of an actor with the same architecture. ATen's matmul picks its kernel by these flags
    even under no_grad: a [B, T, H] input against a weight that requires grad is folded into one mm, otherwise it
    runs as bmm, and the two round differently on some CPUs (a left-padded, sliced logits_to_keep input on an AMD
    EPYC gave actor-reference KL -8.9e-8 at identical weights). With the actor's flags the reference runs the actor's
    kernels on the same inputs. Nothing is recorded for backward: its forwards run under no_grad."""
    flags = {n: p.requires_grad for n, p in like.named_parameters()}
    matched = 0
    for name, p in model.named_parameters():
        if name in flags:
            p.requires_grad_(flags[name])
            matched += 1
    return matched

"""What is trained: LoRA adapters on the draft's projections (peft), or, at rank 0, every weight.

LoRA targets every `nn.Linear` inside the decoder layers, found by name on the model itself (q/k/v/o and the
MLP's gate/up/down for the Llama family) rather than from a list per family; the embedding and the LM head stay
frozen (under LoRA). Dropout is 0: the run is then a pure function of the seed, which resuming relies on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from specdec_core.models.transformer import Transformer

if TYPE_CHECKING:
    from peft import PeftModel


def projection_names(model: Transformer) -> list[str]:
    """The distinct names of the Linear layers inside the decoder layers ("q_proj", "down_proj", ...)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.layers.named_modules() if isinstance(module, nn.Linear)}
    )


def trainable(model: Transformer, rank: int, alpha: int | None = None, seed: int = 0) -> nn.Module:
    """The module to train: `model` wrapped with LoRA adapters of `rank` (alpha 2 * rank unless given), or at
    rank 0 `model` itself with every weight trainable. Mutates `model` (adapters are injected into it). The
    adapters' initial weights are drawn from `seed` (peft draws from torch's global generator: forked here, so
    neither the caller's stream nor the adapters depend on what ran before)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if rank == 0:
        return model.requires_grad_(True)
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=0.0,
        target_modules=projection_names(model),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def merged(module: nn.Module) -> Transformer:
    """The plain model with any adapters folded into its weights (peft's `merge_and_unload`)."""
    if isinstance(module, Transformer):
        return module
    return cast("PeftModel", module).merge_and_unload()  # not a Transformer: the PeftModel `trainable` wrapped

"""The trained draft written as a model directory that `models.loader` reads like any other: Hugging Face names
and layout (config.json, model.safetensors, tokenizer and generation config), in the source's dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec_core.models.loader import LoadedModel, parse_dtype
from specdec_core.models.transformer import Transformer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".safetensors.index.json", ".bin.index.json")


def hf_state_dict(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our parameter names back to Hugging Face's ("model." prefixed, the LM head alone not); a tied LM head is
    left out, as the loader re-ties it."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        out[hf_name] = tensor.detach().to(dtype).contiguous()
    return out


def source_dtype(source: LoadedModel) -> torch.dtype:
    """The dtype the source's config names (what it was published in); float32 where it names none."""
    name = source.hf_config.get("torch_dtype") or source.hf_config.get("dtype") or "float32"
    return parse_dtype(str(name).removeprefix("torch."))


def write_draft(model: Transformer, source: LoadedModel, out: Path) -> Path:
    """Write `model` (trained from `source`) to the directory `out`, beside whatever else is there. Every file but
    the weights is the source's own (config, tokenizer, generation config); from a .gguf source they are written
    from its config and tokenizer. config.json goes last: a directory cut short is not taken for a model."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save_file(hf_state_dict(model, source_dtype(source)), out / "model.safetensors", metadata={"format": "pt"})
    if source.path.is_dir():
        for file in sorted(source.path.iterdir()):
            if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(file, out / file.name)
        shutil.copy2(source.path / "config.json", out / "config.json.tmp")
    else:
        source.tokenizer.save_pretrained(out)
        (out / "config.json.tmp").write_text(json.dumps(source.hf_config, indent=2, default=str))
    (out / "config.json.tmp").replace(out / "config.json")
    return out

"""Load a causal LM into our `Transformer`: from a Hugging Face directory, a `specdec models` name, a GGUF file or
a hub id (when a hub is reachable). Also the draft/target tokenizer compatibility check.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_core.errors import InvalidArgument, ModelNotFound, TokenizerMismatch
from specdec_core.models.families import CHECKPOINT_RENAMES, CHECKPOINT_SKIPS, args_from_hf_config
from specdec_core.models.moe import split_fused_experts
from specdec_core.models.transformer import Transformer, rope_inv_freq, window_inv_freq

log = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InvalidArgument("dtype", f"unknown dtype {name!r}; choose bfloat16, float16 or float32") from None


def parse_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("device", f"device {name!r} requested but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgument("device", f"device {name!r} is not supported; choose cpu or cuda")
    return device


@dataclass(frozen=True)
class LoadedTokenizer:
    """A model's tokenizer and what decides where its outputs end, without the weights (the router's share)."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    path: Path  # the model directory or .gguf file
    hf_config: dict[str, Any]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the tokenizer's eos and the generation config's."""
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = self.hf_config.get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if value is not None:
                ids.add(int(value))
        gen = self.path / "generation_config.json" if self.path.is_dir() else None
        if gen is not None and gen.exists():
            value = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(int(v) for v in (value if isinstance(value, list) else [value]) if v is not None)
        return frozenset(ids)


@dataclass(frozen=True)
class LoadedModel(LoadedTokenizer):
    model: Transformer | None = None


def load_tokenizer(source: str | Path) -> LoadedTokenizer:
    """`source`'s tokenizer and config only (no weights read)."""
    from transformers import AutoTokenizer

    path = resolve_source(source)
    _verify_pulled(path, weights=False)
    if path.is_file():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return LoadedTokenizer(tokenizer=tokenizer, path=path, hf_config={})
    cfg = json.loads((path / "config.json").read_text())
    return LoadedTokenizer(tokenizer=AutoTokenizer.from_pretrained(path), path=path, hf_config=cfg)


def load_model(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
) -> LoadedModel:
    """Load `source` (directory, `.gguf` file, `specdec models` name or hub id) as a plain `Transformer`: torch's
    own modules, no kernels (`specdec_core.build.prepare_model` applies sharding and kernels after loading).

    Every failure to find the model raises `ModelNotFound` naming `source` before any weights are read.
    """
    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    path = resolve_source(source)
    _verify_pulled(path, weights=True)
    return (
        _load_gguf(path, torch_dtype, torch_device) if path.is_file() else _load_hf_dir(path, torch_dtype, torch_device)
    )


def resolve_source(source: str | Path) -> Path:
    """Where `source`'s weights are (a directory or a .gguf file); `ModelNotFound` naming it otherwise."""
    source = str(source)
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise ModelNotFound(f"{source!r} is a file but not a .gguf file")
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelNotFound(f"{source!r} has no config.json: not a Hugging Face model directory")
        return path
    from specdec_core.models import store

    resolved = store.resolve_model(source, allow_hub_id=True)
    if resolved is not None:
        return resolved
    return _download_from_hub(source)


def _verify_pulled(path: Path, *, weights: bool) -> None:
    """A directory `specdec models pull` wrote (by name or by path) is re-hashed before it is read
    (`store.verify_cached`): a shared models volume is written by other pods than the one loading."""
    if path.is_dir():
        from specdec_core.models import store

        store.verify_cached(path, weights=weights)


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # the hub raises many types: offline, 404, auth
        raise ModelNotFound(f"model {repo_id!r}: not a local path or known name, and the hub failed: {exc}") from exc


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{str(path)!r} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file, device="cpu"))
    model = _build(cfg, state, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, hf_config=cfg)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("dequantizing %s (slow; `specdec models pull` caches a converted copy)", path)
    kwargs = dict(gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=dtype, quantization_config=GgufConfig(gguf_file=path.name, dequantize=True), **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    cfg = hf.config.to_dict()
    model = _build(cfg, hf.state_dict(), dtype, device)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, hf_config=cfg)


def _build(
    cfg: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Transformer:
    args = args_from_hf_config(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    renames = CHECKPOINT_RENAMES.get(cfg.get("model_type", ""), ())
    weights = {
        _our_name(k, renames): v.to(dtype)
        for k, v in split_fused_experts(state).items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    skips = CHECKPOINT_SKIPS.get(cfg.get("model_type", ""), ())
    weights = {k: v for k, v in weights.items() if not k.startswith(skips)}
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers are not in the checkpoint: rebuild them on the real device.
    model.inv_freq = rope_inv_freq(args)
    model.window_inv_freq = window_inv_freq(args)
    return model.to(device).eval().requires_grad_(False)


def _our_name(hf_name: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    name = hf_name.removeprefix("model.")
    for old, new in renames:
        name = name.replace(old, new)
    return name


def check_tokenizers_compatible(target: Any, draft: Any) -> None:
    """Raise `TokenizerMismatch` unless both tokenizers map the same tokens to the same ids.

    Embedding matrices may be padded beyond the tokenizer (as between Qwen2 sizes); only the tokenizer's own
    range must agree, since that is every id either model can be asked to read or emit.
    """
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    if len(t_vocab) != len(d_vocab):
        raise TokenizerMismatch(
            f"draft and target tokenizers differ in size: target has {len(t_vocab)} tokens, draft {len(d_vocab)}"
        )
    for token, token_id in t_vocab.items():
        other = d_vocab.get(token)
        if other != token_id:
            raise TokenizerMismatch(
                f"draft and target tokenizers differ: token {token!r} is id {token_id} in the target "
                f"and {other} in the draft"
            )

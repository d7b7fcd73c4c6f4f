"""`specdec serve`'s command line in vLLM's words: MODEL, `--speculative-config JSON` and engine flags, each mapped
onto a field of `ServeConfig`, laid over an optional YAML config (`--config FILE`, or CONFIG.yaml in MODEL's place).

Precedence: the config's defaults < the file < MODEL < the flags. `ServeConfig` validates every value, once, with
all of them in place; an error in a value that a flag gave names the flag (`--port: ...`), one in the file names
its key. A flag is offered only where a config field stands behind it: a flag that changed nothing would mislead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deployments.serve_config import DraftConfig, Placement, ServeConfig, dump_config, read_config_file
from specdec_core.drafters import registry as drafters
from specdec_core.environment import AUTH_TOKEN
from specdec_core.errors import InvalidArgument

ConfigPath = tuple[str | int, ...]  # a field of the config: ("draft", "dtype"), ("drafts", 0, "dtype")
SPECULATIVE = "--speculative-config"
CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Setting:
    """One value laid over the file: the field it sets, and what an error in it is called."""

    path: ConfigPath
    value: Any
    flag: str  # "--port", "MODEL"
    key: str | None = None  # the flag's JSON key that gave it ("num_speculative_tokens")

    @property
    def label(self) -> str:
        return self.flag if self.key is None else f'{self.flag}: key "{self.key}"'


@dataclass(frozen=True)
class EngineFlag:
    """A vLLM flag and the config field it sets, with vLLM's meaning."""

    names: tuple[str, ...]
    field: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = str
    action: Any = None
    metavar: str | None = None
    # Also sets the field of that name in each draft of the file (`draft`, every variant of `drafts`) that the
    # --speculative-config did not set: the draft runs beside the target, as in vLLM.
    drafts_too: bool = False

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    @property
    def fields(self) -> str:
        """The fields it sets, as the config's docs name them."""
        return ".".join(self.field) + (f", draft.{self.field[-1]}" if self.drafts_too else "")


DTYPE_NAMES = {"half": "float16", "float": "float32"}  # vLLM's other names; the config's own pass through

ENGINE_FLAGS = (
    EngineFlag(("--port",), ("http_port",), "the HTTP port: the OpenAI-compatible API and health", int),
    EngineFlag(("--grpc-port",), ("grpc_port",), "the gRPC port: specdec.v1.GenerationService", int),
    EngineFlag(
        ("--served-model-name",),
        ("served_model_name",),
        "the model id of the OpenAI API (`model` in requests, /v1/models); default: MODEL",
        metavar="NAME",
    ),
    EngineFlag(
        ("--max-model-len",),
        ("router", "max_seq_len"),
        "a request's prompt plus output tokens, at most",
        int,
        metavar="N",
    ),
    EngineFlag(
        ("--tensor-parallel-size", "-tp"),
        ("target", "tensor_parallel_size"),
        "ranks per target replica",
        int,
        metavar="N",
    ),
    EngineFlag(
        ("--dtype",),
        ("target", "dtype"),
        "bfloat16, float16 (half) or float32 (float): the target's, and the draft's",
        lambda name: DTYPE_NAMES.get(name, name),
        metavar="DTYPE",
        drafts_too=True,
    ),
    EngineFlag(
        ("--max-num-seqs",),
        ("target", "max_sequences"),
        "sessions a replica holds at once (its KV slots): the target's, and the draft's",
        int,
        metavar="N",
        drafts_too=True,
    ),
    EngineFlag(
        ("--enable-prefix-caching",),
        ("prefix_caching",),
        "reuse the KV of ended sessions for prompts that share a prefix (default: on)",
        None,
        argparse.BooleanOptionalAction,
    ),
)

# --speculative-config's keys in vLLM's names -> the draft fields they set. Every other key is the draft's own
# drafting field under its own name (`quantization`, `max_speculative_tokens`, ...); its placement stays in the YAML.
VLLM_SPECULATIVE_KEYS = {
    "model": "model",
    "method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "ngram_max",
    "prompt_lookup_min": "ngram_min",
}
SPECULATIVE_KEYS = {
    **VLLM_SPECULATIVE_KEYS,
    **{
        name: name
        for name in DraftConfig.model_fields
        if name not in Placement.model_fields and name not in VLLM_SPECULATIVE_KEYS.values()
    },
}


@dataclass(frozen=True)
class Resolved:
    config: ServeConfig
    # --api-key: the router's bearer token. Kept out of the config, which --print-config prints.
    api_key: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="the target model (target.model): a `specdec models` name, a hub id, a model directory or a .gguf "
        "file; or a CONFIG.yaml, served as it is",
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML config (deployments/configs/): the flags override it")
    parser.add_argument(
        SPECULATIVE,
        metavar="JSON",
        help=f"the draft (draft.*), vLLM's keys: model, method ({', '.join(drafters.choices())}), "
        "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min; and the draft's own, e.g. quantization",
    )
    for flag in ENGINE_FLAGS:
        options: dict[str, Any] = (
            {"action": flag.action} if flag.action else {"type": flag.type, "metavar": flag.metavar}
        )
        parser.add_argument(*flag.names, dest=flag.dest, help=f"{flag.help} ({flag.fields})", **options)
    parser.add_argument(
        "--api-key",
        help="the bearer token every call to the public API must carry (auth: bearer); the router gets it as "
        "SPECDEC_AUTH_TOKEN, and it is written to no config",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit, serving nothing"
    )


def resolve(args: argparse.Namespace) -> Resolved:
    """The config `args` describe; `InvalidArgument` naming the flag, or the file's key, at fault."""
    config_file, model = _sources(args)
    data = {} if config_file is None else _mapping(read_config_file(config_file))
    laid: list[Setting] = [] if model is None else [Setting(("target", "model"), model, "MODEL")]
    _apply(data, laid)
    # In this order: the engine flags reach the drafts that --speculative-config may have made.
    for gather in (_speculative_settings, _engine_settings):
        settings = gather(args, data, laid)
        _apply(data, settings)
        laid += settings
    if config_file is None and args.api_key is None and not os.environ.get(AUTH_TOKEN):
        # vLLM's rule for a model served from the command line: without a key the API is open. A config file keeps
        # its own rule (bearer unless it says `auth: none`): a router with no token there refuses to start.
        _apply(data, [open_api := Setting(("auth",), "none", "--api-key")])
        laid.append(open_api)
    return Resolved(_validate(data, laid), _api_key(args.api_key))


def printed(resolved: Resolved) -> str:
    """What --print-config prints: YAML that `specdec serve FILE` serves alike."""
    note = "# --api-key is not written here: set SPECDEC_AUTH_TOKEN, or give --api-key again.\n"
    return (note if resolved.api_key else "") + dump_config(resolved.config)


def _sources(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the config file, MODEL). The positional is the config where it names a .yaml or .yml file."""
    positional = args.model
    if positional is not None and Path(positional).suffix.lower() in CONFIG_SUFFIXES and not Path(positional).is_dir():
        if args.config is not None:
            raise InvalidArgument("--config", f"the config is given twice: {positional} and {args.config}")
        return positional, None
    if positional is None and args.config is None:
        raise InvalidArgument("MODEL", "give a model (or a CONFIG.yaml, or --config FILE)")
    return args.config, positional


def _mapping(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidArgument("config", f"expected a mapping of keys, got {type(data).__name__}")
    return data


def _speculative_settings(args: argparse.Namespace, data: dict[str, Any], laid: list[Setting]) -> list[Setting]:
    if args.speculative_config is None:
        return []
    spec = _json_object(args.speculative_config)
    if data.get("drafts") is not None:
        raise InvalidArgument(SPECULATIVE, "the config file serves an A/B of drafts (`drafts:`): change them there")
    unknown = [key for key in spec if key not in SPECULATIVE_KEYS]
    if unknown:
        raise InvalidArgument(SPECULATIVE, f'unknown key "{unknown[0]}"; the keys: {", ".join(SPECULATIVE_KEYS)}')
    settings = [Setting(("draft", SPECULATIVE_KEYS[key]), value, SPECULATIVE, key) for key, value in spec.items()]
    if "method" not in spec:
        if "model" in spec:  # vLLM's rule: a model without a method is a draft model
            settings.insert(0, Setting(("draft", "method"), "draft_model", SPECULATIVE, "model"))
        elif data.get("draft") is None:
            raise InvalidArgument(SPECULATIVE, 'give "model" (a draft model) or "method"')
    return settings + _room_for(spec, data)


def _room_for(spec: dict[str, Any], data: dict[str, Any]) -> list[Setting]:
    """vLLM's num_speculative_tokens is also its largest k: max_speculative_tokens rises to it where it is lower,
    unless the JSON sets max_speculative_tokens too."""
    k = spec.get("num_speculative_tokens")
    if type(k) is not int or "max_speculative_tokens" in spec:
        return []
    draft = data.get("draft")
    largest = (draft if isinstance(draft, dict) else {}).get(
        "max_speculative_tokens", DraftConfig.model_fields["max_speculative_tokens"].default
    )
    if type(largest) is not int or k <= largest:  # a bad value in the file is the file's error
        return []
    return [Setting(("draft", "max_speculative_tokens"), k, SPECULATIVE, "num_speculative_tokens")]


def _json_object(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(SPECULATIVE, f"not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise InvalidArgument(SPECULATIVE, f"expected a JSON object of keys, got {type(spec).__name__}")
    return spec


def _engine_settings(args: argparse.Namespace, data: dict[str, Any], laid: list[Setting]) -> list[Setting]:
    taken = {setting.path for setting in laid}
    settings = [] if args.api_key is None else [Setting(("auth",), "bearer", "--api-key")]
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        settings.append(Setting(flag.field, value, flag.names[0]))
        if flag.drafts_too:
            paths = [(*section, flag.field[-1]) for section in _draft_sections(data)]
            settings += [Setting(path, value, flag.names[0]) for path in paths if path not in taken]
    return settings


def _draft_sections(data: dict[str, Any]) -> list[ConfigPath]:
    """The drafts the config has: `draft`, and each variant of `drafts`. None is made here: a draft section
    that was not there would turn speculation on."""
    sections: list[ConfigPath] = [("draft",)] if isinstance(data.get("draft"), dict) else []
    variants = data.get("drafts")
    if isinstance(variants, list):
        sections += [("drafts", i) for i, variant in enumerate(variants) if isinstance(variant, dict)]
    return sections


def _apply(data: dict[str, Any], settings: list[Setting]) -> None:
    """Write each setting into `data` (mutates it), making the sections it needs."""
    for setting in settings:
        node: Any = data
        for depth, key in enumerate(setting.path[:-1]):
            if isinstance(key, str) and node.get(key) is None:  # absent, or left empty in the YAML
                node[key] = {}
            node = node[key]
            if not isinstance(node, list if isinstance(setting.path[depth + 1], int) else dict):
                where = ".".join(str(part) for part in setting.path[: depth + 1])
                raise InvalidArgument(where, f"expected a mapping of keys, got {type(node).__name__}")
        node[setting.path[-1]] = setting.value


def _api_key(key: str | None) -> str | None:
    if key is not None and not key.strip():
        raise InvalidArgument("--api-key", "must not be empty")
    return key


def _validate(data: dict[str, Any], laid: list[Setting]) -> ServeConfig:
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        problems: dict[str, dict[str, None]] = {}  # label -> its messages, in order, once each
        for error in exc.errors():
            loc = tuple(error["loc"])
            message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            message = message.removeprefix("Value error, ")
            setting = _blame(loc, message, laid)
            label = setting.label if setting else ".".join(str(part) for part in loc) or "config"
            problems.setdefault(label, {})[message] = None
        (label, first), *rest = problems.items()
        text = "; ".join([" or ".join(first), *(f"{other}: {' or '.join(m)}" for other, m in rest)])
        raise InvalidArgument(label, text) from None


def _blame(loc: ConfigPath, message: str, laid: list[Setting]) -> Setting | None:
    """The setting an error at `loc` is about: the last one laid at `loc` or above it; else one laid inside `loc`
    whose field the message names (a section's check across its fields, such as k against its largest)."""
    at = [setting for setting in laid if loc[: len(setting.path)] == setting.path]
    if at:
        return at[-1]
    named = [
        setting
        for setting in laid
        if setting.path[: len(loc)] == loc and re.search(rf"\b{re.escape(str(setting.path[-1]))}\b", message)
    ]
    return named[-1] if named else None

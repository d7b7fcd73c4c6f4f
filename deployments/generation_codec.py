"""The public protocol's codec: GenerationService messages (specdec.v1 generation.proto) <-> the engine's types.

Decoding validates: a bad value raises `InvalidArgument` naming the request field, which the router turns into
INVALID_ARGUMENT. Nothing else in the service touches a public message's fields; the workers' protocol has its own
codec (`deployments.worker_codec`), and the OpenAI-compatible API decodes to the same `GenerateCall`
(`deployments.openai.codec`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.v1 import generation_pb2 as pb
from specdec_core.chat import ChatMessage, Tool
from specdec_core.config import AUTO, SamplingParams
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint
from specdec_core.outputs import RequestOutput, SpecStats
from specdec_core.request import Request
from specdec_core.stopping import FinishReason

T = TypeVar("T")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids and messages is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    raw: bool = False  # text only: no chat template
    tools: tuple[Tool, ...] = ()  # messages only: what the chat template tells the model it may call (HTTP only)


@dataclass(frozen=True)
class GenerateCall:
    """A decoded GenerateRequest (or OpenAI body): the engine's `Request` as the client asked it, whose `seq_id` and
    `prompt_ids` the router fills once it has tokenized `prompt`, and what only the service reads."""

    request_id: str
    prompt: Prompt
    request: Request
    draft_variant: str | None = None  # None: assigned by weight; the router checks the name


def decode_generate(request: pb.GenerateRequest, default_max_tokens: int) -> GenerateCall:
    given = [
        name
        for name, present in (
            ("prompt", bool(request.prompt)),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
            ("messages", len(request.messages) > 0),
        )
        if present
    ]
    if len(given) > 1:
        raise InvalidArgument(given[0], f"set one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
    if not given:
        raise InvalidArgument("prompt", "missing: set prompt (text), prompt_token_ids or messages")
    if request.messages and request.raw_prompt:
        raise InvalidArgument("raw_prompt", "applies to prompt only: messages always go through the chat template")
    prompt = Prompt(
        text=request.prompt or None,
        token_ids=tuple(request.prompt_token_ids) or None,
        messages=decode_messages(request.messages) or None,
        raw=request.raw_prompt,
    )
    return GenerateCall(
        request_id=request.request_id,
        prompt=prompt,
        request=Request(
            seq_id="",
            prompt_ids=(),
            params=decode_sampling(request.sampling, default_max_tokens, decode_structured(request)),
            num_speculative_tokens=decode_speculation(request.speculation),
            speculation_method=request.speculation_method or None,
            cache_salt=decode_cache_salt(request.cache_salt),
        ),
        draft_variant=request.draft_variant or None,
    )


MAX_CACHE_SALT = 256


def decode_cache_salt(salt: str) -> str | None:
    """The request's prefix-cache namespace; the empty string (the field unset) is the shared one."""
    if len(salt) > MAX_CACHE_SALT:
        raise InvalidArgument("cache_salt", f"at most {MAX_CACHE_SALT} characters, got {len(salt)}")
    return salt or None


def decode_messages(messages: Sequence[pb.ChatMessage]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(role=m.role, content=m.content) for m in messages)


def validated_sampling(kind: type[T], **values: Any) -> T:
    """`kind` (SamplingParams or TokenShaping) whose validation errors name the request field (`sampling.<name>`)."""
    try:
        return kind(**values)
    except InvalidArgument as exc:
        raise InvalidArgument(f"sampling.{exc.field}", exc.message) from None


# Errors the engine raises name its own fields; a client knows the request's, which nest some of them. A constraint
# that does not compile is named by its kind (the engine compiles it when the request joins).
_REQUEST_FIELDS = {
    "max_tokens": "sampling.max_tokens",
    "num_speculative_tokens": "speculation.num_speculative_tokens",
    "json_schema": "structured.json_schema",
    "json_object": "structured.json_object",
    "regex": "structured.regex",
    "grammar": "structured.grammar",
    "constraint": "structured",
}


def in_request_terms(error: InvalidArgument) -> InvalidArgument:
    """`error` naming the GenerateRequest field (e.g. max_tokens -> sampling.max_tokens)."""
    field = _REQUEST_FIELDS.get(error.field)
    return error if field is None else InvalidArgument(field, error.message)


def decode_sampling(
    sampling: pb.SamplingParams, default_max_tokens: int, constraint: Constraint | None = None
) -> SamplingParams:
    return validated_sampling(
        SamplingParams,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p) if sampling.HasField("top_p") else 1.0,
        top_k=int(sampling.top_k),
        seed=int(sampling.seed) if sampling.HasField("seed") else None,
        max_tokens=int(sampling.max_tokens) if sampling.HasField("max_tokens") else default_max_tokens,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        constraint=constraint,
    )


JSON_KINDS = ("json_schema", "json_object")


def decode_structured(request: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint (None: any text). Only checked for shape here: the engine compiles it, and refuses
    what does not compile naming its kind (`structured.<kind>`, `in_request_terms`). JSON is compact by default:
    with any whitespace allowed between tokens, a model can write whitespace until max_tokens."""
    if not request.HasField("structured"):
        return None
    structured = request.structured
    kind = structured.WhichOneof("kind")
    if kind is None:  # a message sent without its kind is a mistake, never "unconstrained"
        raise InvalidArgument("structured", "set one of json_schema, json_object, regex and grammar")
    if kind == "json_object" and not structured.json_object:
        raise InvalidArgument("structured.json_object", "must be true (leave structured unset for any text)")
    if structured.lenient_schema and kind != "json_schema":
        raise InvalidArgument("structured.lenient_schema", f"applies to json_schema only, not {kind}")
    if kind == "json_schema":
        check_json_depth("structured.json_schema", structured.json_schema)
    try:
        return Constraint(
            kind,
            "" if kind == "json_object" else getattr(structured, kind),
            strict=not structured.lenient_schema,
            compact=kind in JSON_KINDS,
        )
    except InvalidArgument as exc:
        raise InvalidArgument(f"structured.{kind}", exc.message) from None


# JSON a request carries (a schema, a tool's parameters, a call's arguments) nests at most this deep: parsers, schema
# compilers and chat templates recurse once a level, and Python's recursion gives out near a thousand levels.
# OpenAI's structured outputs allow 10 levels; 64 leaves room and keeps every recursion short.
MAX_JSON_DEPTH = 64
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a bracket in a string does not nest
_BRACKETS = re.compile(r"[][{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON `text` nest (0: a scalar), counted without parsing it (a parser
    would recurse); malformed text gets a count too, and its parser's own error later."""
    steps = map(_STEP.__getitem__, _BRACKETS.findall(_JSON_STRINGS.sub("", text)))
    return max(itertools.accumulate(steps), default=0)


def check_json_depth(field: str, text: str) -> None:
    """Refuse JSON `text` nested deeper than MAX_JSON_DEPTH, naming `field`."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise InvalidArgument(field, f"nesting deeper than {MAX_JSON_DEPTH} levels")


def encode_structured(constraint: Constraint) -> pb.StructuredOutput:
    """The wire form of a constraint (clients, tests): `decode_structured`'s inverse for what it produces."""
    if constraint.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(
        lenient_schema=constraint.kind == "json_schema" and not constraint.strict, **{constraint.kind: constraint.value}
    )


def decode_speculation(options: pb.SpeculationOptions) -> int | str | None:
    which = options.WhichOneof("length")
    if which == "num_speculative_tokens":
        return int(options.num_speculative_tokens)
    if which == "adaptive":
        return AUTO if options.adaptive else None
    return None


def encode_stats(stats: SpecStats, draft_variant: str) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        rounds=stats.rounds, proposed=stats.proposed, accepted=stats.accepted, draft_variant=draft_variant
    )


def encode_usage(output: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=output.num_prompt_tokens,
        completion_tokens=output.num_output_tokens,
        cached_tokens=output.num_cached_tokens,
    )


def encode_chunk(request_id: str, output: RequestOutput, draft_variant: str) -> pb.GenerateStreamResponse:
    chunk = pb.GenerateStreamResponse(request_id=request_id, text=output.new_text, token_ids=output.new_token_ids)
    if output.finished:
        chunk.finish_reason = FINISH_REASONS[output.finish_reason]
        chunk.usage.CopyFrom(encode_usage(output))
        chunk.speculation.CopyFrom(encode_stats(output.stats, draft_variant))
    return chunk


def merge_chunks(request_id: str, outputs: Sequence[RequestOutput], draft_variant: str) -> pb.GenerateResponse:
    """The unary response: every chunk's text and tokens, the last one's reason, usage and stats."""
    last = outputs[-1]
    return pb.GenerateResponse(
        request_id=request_id,
        text="".join(o.new_text for o in outputs),
        token_ids=[t for o in outputs for t in o.new_token_ids],
        finish_reason=FINISH_REASONS[last.finish_reason] if last.finished else pb.FINISH_REASON_UNSPECIFIED,
        usage=encode_usage(last),
        speculation=encode_stats(last.stats, draft_variant),
    )

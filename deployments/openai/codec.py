"""Between the OpenAI-compatible API's JSON and the engine: request bodies to the `GenerateCall` that the gRPC codec
(`deployments.generation_codec`) also produces (so both APIs reach the router by one path), engine outputs to
response bodies and stream chunks.
A chat request with tools has its output read for calls (`tool_parser`), in its unary answer and its stream alike."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.generation_codec import GenerateCall, Prompt
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, Message, ResponseFormat
from deployments.openai.tool_parser import ParsedCall, ToolCallParser
from deployments.openai.tools import ToolCallFormat, ToolPlan, forced_constraint, prompt_tools, tool_plan
from specdec_core.chat import ChatMessage, ToolCall
from specdec_core.config import SamplingParams
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint
from specdec_core.outputs import RequestOutput
from specdec_core.request import Request
from specdec_core.stopping import FinishReason

# OpenAI's documented defaults where a request leaves a field out.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions; chat completions take the server's default_max_tokens

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


@dataclass(frozen=True)
class Call:
    """A decoded HTTP request: what the engine runs, and how to answer."""

    generate: GenerateCall
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    tools: ToolPlan | None = None  # chat with tools (tool_choice not none): the output is read for calls


def decode_chat(
    body: ChatCompletionRequest, default_max_tokens: int, tool_format: ToolCallFormat = ToolCallFormat()
) -> Call:
    """`tool_format`: how the served tokenizer spells the call markers (the default: as text)."""
    prompt = Prompt(messages=tuple(_chat_message(m) for m in body.messages), tools=prompt_tools(body))
    return _call(
        body,
        prompt,
        body.output_limit or default_max_tokens,
        chat=True,
        forced=forced_constraint(body, tool_format),
        tools=tool_plan(body),
    )


def _chat_message(m: Message) -> ChatMessage:
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    # "developer" is OpenAI's newer name for the system turn; chat templates know "system".
    return ChatMessage("system" if m.role == "developer" else m.role, m.text, calls, m.tool_call_id)


def decode_completion(body: CompletionRequest) -> Call:
    prompt = body.single_prompt
    as_prompt = Prompt(text=prompt, raw=True) if isinstance(prompt, str) else Prompt(token_ids=tuple(prompt))
    return _call(body, as_prompt, body.output_limit or DEFAULT_COMPLETION_MAX_TOKENS, chat=False)


def _call(
    body: Any,
    prompt: Prompt,
    max_tokens: int,
    chat: bool,
    forced: Constraint | None = None,
    tools: ToolPlan | None = None,
) -> Call:
    try:
        params = SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=max(0, body.top_k or 0),  # vLLM's -1 and 0 both mean off
            seed=body.seed,
            max_tokens=max_tokens,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            constraint=forced or decode_response_format(body.response_format),  # never both (protocol)
        )
    except InvalidArgument as exc:  # the engine's own names are the body's, but for the length limit
        field = {"max_tokens": "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"}
        raise InvalidArgument(field.get(exc.field, exc.field), exc.message) from None
    options = body.stream_options
    return Call(
        generate=GenerateCall(
            request_id="",
            prompt=prompt,
            draft_variant=body.draft_variant,
            request=Request(
                seq_id="",
                prompt_ids=(),
                params=params,
                num_speculative_tokens=body.num_speculative_tokens,
                speculation_method=body.speculation_method,
                cache_salt=body.cache_salt,
            ),
        ),
        chat=chat,
        model=body.model,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
        return_token_ids=body.return_token_ids,
        tools=tools,
    )


def decode_response_format(response_format: ResponseFormat | None) -> Constraint | None:
    """The engine's constraint for OpenAI's `response_format` (None for text). JSON is compact, as the gRPC API's: with
    any whitespace allowed between tokens, a model can write whitespace until max_tokens; a schema's own
    "x-guidance" may still ask for it. The engine compiles the schema (errors: `response_format.json_schema.schema`)."""
    if response_format is None or response_format.type == "text":
        return None
    spec = response_format.json_schema
    if spec is None:
        return Constraint("json_object", compact=True)
    return Constraint("json_schema", json.dumps(spec.json_schema), strict=bool(spec.strict), compact=True)


# The router names the gRPC request's fields in its errors, and the engine its own (a constraint by its kind); an
# HTTP client knows the body's.
_HTTP_PARAMS = {
    "sampling.max_tokens": "max_tokens",
    "speculation.num_speculative_tokens": "num_speculative_tokens",
    "prompt_token_ids": "prompt",
    "messages.role": "messages",
    "messages.content": "messages",
    "json_schema": "response_format.json_schema.schema",
    "json_object": "response_format",
    "constraint": "response_format",
    "grammar": "tools",
}  # HTTP's only grammars force tool calls


def http_param(field: str) -> str:
    """The body's name for a field an error names (sampling.top_p -> top_p)."""
    field = _HTTP_PARAMS.get(field, field)
    return field.removeprefix("sampling.")


# -- responses -----------------------------------------------------------------------------------------------------


def new_id(call: Call) -> str:
    return ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex


def usage(last: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens},
    }


def speculation(call: Call, last: RequestOutput) -> dict[str, Any]:
    """The request's speculation stats, and the draft variant the router assigned it (`Router.with_variant`)."""
    stats = last.stats
    return {
        "rounds": stats.rounds,
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "draft_variant": call.generate.draft_variant,
    }


def response(call: Call, response_id: str, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The unary body: every output's text and tokens, the last one's reason, usage and speculation."""
    last = outputs[-1]
    text = "".join(o.new_text for o in outputs)
    choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS.get(last.finish_reason), "logprobs": None}
    if call.tools is not None:
        choice["message"], choice["finish_reason"] = _read_calls(call.tools, text, last)
    elif call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if call.return_token_ids:
        choice["token_ids"] = [t for o in outputs for t in o.new_token_ids]
    return {
        **_envelope(call, response_id, stream=False),
        "choices": [choice],
        "usage": usage(last),
        "speculation": speculation(call, last),
    }


def _read_calls(plan: ToolPlan, text: str, last: RequestOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant's message with the calls its text made (content null if it only called), and the reason."""
    parser = ToolCallParser(plan)
    events = parser.feed(text) + parser.finish()
    message: dict[str, Any] = {"role": "assistant", "content": "".join(e for e in events if isinstance(e, str)) or None}
    calls = [e.as_openai() for e in events if isinstance(e, ParsedCall)]
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(last, parser)


def finish_reason(last: RequestOutput, parser: ToolCallParser) -> str | None:
    """OpenAI's "tool_calls" where calls were made and the output ended of itself; a cut one is still "length"."""
    if parser.num_calls and last.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return "tool_calls"
    return FINISH_REASONS.get(last.finish_reason)


def first_chunk(call: Call, response_id: str) -> dict[str, Any] | None:
    """Chat streams open with the assistant's role, as OpenAI's do; completion streams have no such chunk. With
    tools, content opens null, as the unary message's is when the model only called."""
    if not call.chat:
        return None
    delta = {"role": "assistant", "content": None if call.tools is not None else ""}
    return _chunk(call, response_id, [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])


def chunks(call: Call, response_id: str, output: RequestOutput, parser: ToolCallParser | None) -> list[dict[str, Any]]:
    """One round's output as stream chunks: at most one without tools (`chunk`); with them (`parser`, which this
    feeds), a chunk per piece of content or whole call the round decided, then one with the finish reason."""
    if parser is None:
        body = chunk(call, response_id, output)
        return [] if body is None else [body]
    events = parser.feed(output.new_text) + (parser.finish() if output.finished else [])
    bodies = [_delta_chunk(call, response_id, _delta(event)) for event in events]
    if output.finished:
        bodies.append(_delta_chunk(call, response_id, {}, finish_reason(output, parser)))
    if call.return_token_ids:
        bodies = bodies or [_delta_chunk(call, response_id, {})]
        bodies[0]["choices"][0]["token_ids"] = list(output.new_token_ids)  # the round's, with its first chunk
    for body in bodies if call.continuous_usage else ():
        body["usage"] = usage(output)
    return bodies


def _delta(event: str | ParsedCall) -> dict[str, Any]:
    if isinstance(event, str):
        return {"content": event}
    return {"tool_calls": [{"index": event.index, **event.as_openai()}]}


def _delta_chunk(call: Call, response_id: str, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    return _chunk(call, response_id, [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}])


def chunk(call: Call, response_id: str, output: RequestOutput) -> dict[str, Any] | None:
    """One round's output as a stream chunk (None when it committed nothing to show and did not finish)."""
    if not output.new_text and not output.finished and not call.return_token_ids:
        return None
    choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS.get(output.finish_reason), "logprobs": None}
    if call.chat:
        choice["delta"] = {"content": output.new_text} if output.new_text or not output.finished else {}
    else:
        choice["text"] = output.new_text
    if call.return_token_ids:
        choice["token_ids"] = list(output.new_token_ids)
    body = _chunk(call, response_id, [choice])
    if call.continuous_usage:
        body["usage"] = usage(output)
    return body


def usage_chunk(call: Call, response_id: str, last: RequestOutput) -> dict[str, Any]:
    """`stream_options.include_usage`: a last chunk with no choices, carrying usage and speculation."""
    return {**_chunk(call, response_id, []), "usage": usage(last), "speculation": speculation(call, last)}


def _chunk(call: Call, response_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = {**_envelope(call, response_id, stream=True), "choices": choices}
    if call.include_usage:
        body["usage"] = None  # OpenAI's streams carry usage: null on every chunk but the usage chunk
    return body


def _envelope(call: Call, response_id: str, stream: bool) -> dict[str, Any]:
    kind = ("chat.completion" if call.chat else "text_completion") + (".chunk" if stream and call.chat else "")
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": call.model}


def model_card(model_id: str, created: int, owned_by: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by, "max_model_len": max_model_len}

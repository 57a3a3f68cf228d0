"""OpenAI-compatible routes: `/v1/chat/completions` (plain and streamed), `/v1/completions` (plain) and `/v1/models`.

This lets the embedded server act as the user simulator / judge and as an evaluation endpoint for the real
`openai` client. As in SGLang without `--tool-call-parser`, tool calls are not parsed out of the reply; `tools`
are passed to the chat template. `response_format` "json_object" and "json_schema", and SGLang's extra `regex` /
`ebnf` fields, constrain the reply as SGLang does (`grammar.py`).
"""

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from userrl_megatron.server.core import EngineCore, call_soon
from userrl_megatron.server.grammar import GRAMMAR_KEYS, JSON_OBJECT_SCHEMA
from userrl_megatron.server.http import (
    CORE_KEY,
    REQUIRED,
    BadRequestError,
    error_shape,
    fields,
    json_reply,
    make_request,
    read_json,
)
from userrl_megatron.server.protocol import GenerateItem, check_prompt_chars, output_text
from userrl_megatron.server.sampling import MAX_N
from userrl_megatron.server.scheduler import Request

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
MAX_TOP_LOGPROBS = 20  # OpenAI's range of chat top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's range of the legacy completions logprobs
# Keyword arguments of transformers' apply_chat_template: refused inside chat_template_kwargs (only template
# variables belong there; a template of the client's is SGLang's refusal too).
TEMPLATE_CALL_ARGS = (
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip
# Body fields both routes read, with their JSON types (pydantic-style 400 naming the field otherwise).
SAMPLING_TYPES: dict[str, tuple[Any, Any]] = {
    "model": (str, None),
    "temperature": (float, None),
    "top_p": (float, None),
    "top_k": (int, None),
    "min_p": (float, None),
    "frequency_penalty": (float, None),
    "presence_penalty": (float, None),
    "repetition_penalty": (float, None),
    "min_tokens": (int, None),
    "max_tokens": (int, None),
    "n": (int, None),
    "seed": (int, None),
    "response_format": (dict, None),
    "regex": (str, None),
    "ebnf": (str, None),
    "stop": ((str, list), None),
    "stop_token_ids": (list, None),
    "logit_bias": (dict, None),
    "ignore_eos": (bool, None),
    "skip_special_tokens": (bool, None),
    "no_stop_trim": (bool, None),
    "stream": (bool, None),
}
CHAT_TYPES = {
    **SAMPLING_TYPES,
    "messages": (list, REQUIRED),
    "max_completion_tokens": (int, None),
    "logprobs": (bool, None),
    "top_logprobs": (int, None),
    "tools": (list, None),
    "chat_template_kwargs": (dict, None),
    "stream_options": (dict, None),
}
COMPLETION_TYPES = {
    **SAMPLING_TYPES,
    "prompt": ((str, list), REQUIRED),
    "logprobs": (int, None),
    "echo": (bool, None),
    "suffix": (str, None),
    "return_token_ids": (bool, None),
}


def add_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


def _card(core: EngineCore) -> dict[str, Any]:
    name = core.served_model_name
    return {
        "id": name,
        "object": "model",
        "created": int(core.startup_time),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": core.model.spec.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app[CORE_KEY])]})


async def get_model(request: web.Request) -> web.Response:
    core, model = request.app[CORE_KEY], request.match_info["model"]
    if model != core.served_model_name:
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return web.json_response({"error": error}, status=404)
    return web.json_response(_card(core))


def _invalid(path: str, message: str) -> BadRequestError:
    return BadRequestError(f"1 validation error:\n  body.{path}: {message}")


def _check_common(body: dict[str, Any], spec: dict[str, tuple[Any, Any]]) -> None:
    """JSON types of the fields a route reads, then the element types of the composite ones."""
    fields(body, spec)
    stop = body.get("stop")
    if isinstance(stop, list) and not all(isinstance(x, str) for x in stop):
        raise _invalid("stop", f"Input should be a string or a list of strings, got {stop!r}")
    ids = body.get("stop_token_ids")
    if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _invalid("stop_token_ids", f"Input should be a list of integers, got {ids!r}")
    n = body.get("n")
    if n is not None and n < 1:  # OpenAI's refusal; SGLang 0.5.23 answers n 0 with one sample
        raise ValueError(f"n must be at least 1, got {n}.")
    if n is not None and n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {n}.")


def _check_chat_body(core: EngineCore, body: Any) -> None:
    """Everything about a chat body that needs no tokenizer (types, ranges, prompt length); runs on the loop."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequestError("1 validation error:\n  body.messages: Field required (a non-empty list of messages)")
    _check_common(body, CHAT_TYPES)
    chars = sum(_message_chars(i, m) for i, m in enumerate(body["messages"]))
    if body.get("tools") is not None:
        if not all(isinstance(t, dict) for t in body["tools"]):
            raise _invalid("tools", "Input should be a list of objects")
        chars += len(json.dumps(body["tools"]))
    if chars > core.cfg.max_prompt_chars:
        raise ValueError(
            f"The chat prompt has {chars} characters, more than this server takes ({core.cfg.max_prompt_chars}: "
            "rollout.embedded.max_prompt_chars)."
        )
    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format.get("type"), str):
        raise _invalid("response_format.type", f"Field required (a string), got {response_format!r}")
    kwargs = body.get("chat_template_kwargs") or {}
    if "chat_template" in kwargs:
        raise ValueError("Request-supplied chat_template is not allowed.")
    reserved = sorted(k for k in kwargs if k in TEMPLATE_CALL_ARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may hold template variables only, not {', '.join(reserved)}.")
    top = body.get("top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}.")


def _message_chars(index: int, m: Any) -> int:
    """Check one message's shape; the characters of its text."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequestError(f"1 validation error:\n  body.messages.{index}: each message needs a role (a string)")
    content = m.get("content")
    if content is None or isinstance(content, str):
        return len(content or "")
    if not isinstance(content, list):
        raise _invalid(
            f"messages.{index}.content", f"Input should be a string or a list of content parts, got {content!r}"
        )
    chars = 0
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _invalid(f"messages.{index}.content.{j}", f"Input should be a content part object, got {part!r}")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise _invalid(f"messages.{index}.content.{j}.text", f"Input should be a string, got {part!r}")
            chars += len(part["text"])
    return chars


def _chat_item(core: EngineCore, body: dict[str, Any]) -> GenerateItem:
    """The native request a checked chat body stands for (chat template, tokenising); ValueError on bad input.
    Runs on a tokenizer thread."""
    tokenizer = core.model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("The model has no chat template; use /generate with input_ids.")
    try:
        text = tokenizer.apply_chat_template(
            [_message(m) for m in body["messages"]],
            tools=body.get("tools"),
            add_generation_prompt=True,
            tokenize=False,
            **(body.get("chat_template_kwargs") or {}),
        )
    except Exception as e:  # the template raised on these messages (a client's input, not the server)
        raise ValueError(f"The chat template cannot render these messages: {type(e).__name__}: {e}") from e
    input_ids = list(tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = core.model.spec.context_length - len(input_ids)
    sampling = {
        "max_new_tokens": max_tokens,
        "temperature": _default(body.get("temperature"), core, "temperature", 1.0),
        "top_p": _default(body.get("top_p"), core, "top_p", 1.0),
        "top_k": _default(body.get("top_k"), core, "top_k", -1),
        "min_p": body.get("min_p"),
        "frequency_penalty": body.get("frequency_penalty"),
        "presence_penalty": body.get("presence_penalty"),
        "repetition_penalty": body.get("repetition_penalty"),
        "min_new_tokens": body.get("min_tokens"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "logit_bias": body.get("logit_bias"),
        "sampling_seed": body.get("seed"),
        **_constraint(body),
    }
    return GenerateItem(
        rid=f"chatcmpl-{uuid.uuid4().hex}",
        input_ids=input_ids,
        sampling={k: v for k, v in sampling.items() if v is not None},
        return_logprob=bool(body.get("logprobs")),
        logprob_start_len=-1,
        top_logprobs_num=body.get("top_logprobs") or 0,
        return_text_in_logprobs=False,
    )


def _constraint(body: dict[str, Any]) -> dict[str, Any]:
    """The grammar sampling params of an OpenAI body, as SGLang maps them: `regex` / `ebnf` / `json_schema` as
    given, else `response_format` json_schema (its schema) or json_object (any JSON object); ValueError otherwise."""
    out = {key: body[key] for key in GRAMMAR_KEYS if body.get(key) is not None}
    response_format = body.get("response_format") or {}
    kind = response_format.get("type", "text")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError("schema_ is required for json_schema response format request.")
        if not isinstance(schema, dict):
            raise _invalid("response_format.json_schema.schema", f"Input should be a valid dictionary, got {schema!r}")
        out["json_schema"] = json.dumps(schema)
    elif kind == "json_object":
        out["json_schema"] = JSON_OBJECT_SCHEMA
    elif kind != "text":
        raise ValueError(f"response_format {kind!r} is not supported by the embedded server.")
    return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p["text"] for p in content if p["type"] == "text")
    return {**m, "content": content or ""}


def _default(value: Any, core: EngineCore, key: str, fallback: Any) -> Any:
    """SGLang's `--sampling-defaults model`: unset keys come from the model's generation_config."""
    if value is not None:
        return value
    config = getattr(core.model.model, "generation_config", None)
    return getattr(config, key, None) if getattr(config, key, None) is not None else fallback


async def chat_completions(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    body = await read_json(request)
    try:
        _check_chat_body(core, body)
        item = await core.tokenize(lambda: _chat_item(core, body))
        n = body.get("n") or 1
        requests = [make_request(core, item) for _ in range(n)]
        await core.attach_grammars(requests)
    except ValueError as e:
        return error_shape(str(e), kind="BadRequestError")
    model = body.get("model") or core.served_model_name
    if body.get("stream"):
        if n > 1:
            return error_shape("Streaming with n > 1 is not supported by the embedded server.", kind="BadRequestError")
        return await _stream_chat(request, core, requests[0], model, body)
    done = await asyncio.gather(*(core.generate(r) for r in requests))
    completion = sum(len(r.output_ids) for r in done)
    return await json_reply(
        request,
        lambda: {
            "id": item.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [_choice(core, r, i, item) for i, r in enumerate(done)],
            "usage": _usage(len(item.input_ids), completion, done[0].cached_tokens),
            "metadata": {"weight_version": done[0].weight_version},
        },
    )


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "reasoning_tokens": 0,
    }


def _choice(core: EngineCore, r: Request, index: int, item: GenerateItem) -> dict[str, Any]:
    reason = r.finish_reason or {}
    return {
        "index": index,
        "message": {"role": "assistant", "content": output_text(r, core.model), "reasoning_content": None},
        "logprobs": _logprobs(core, r, item) if item.return_logprob else None,
        "finish_reason": FINISH.get(reason.get("type", ""), "stop"),
        "matched_stop": reason.get("matched"),
    }


def _logprobs(core: EngineCore, r: Request, item: GenerateItem) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = core.model.decode([token_id], skip_special_tokens=False)
        return {"token": token, "bytes": list(token.encode()), "logprob": logprob}

    content = []
    for i, (token_id, logprob) in enumerate(zip(r.output_ids, r.output_logprobs, strict=True)):
        tops = r.output_top_logprobs[i] if item.top_logprobs_num else []
        content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for lp, t in tops]})
    return {"content": content}


async def _stream_chat(
    http: web.Request, core: EngineCore, request: Request, model: str, body: dict[str, Any]
) -> web.StreamResponse:
    """`chat.completion.chunk` events with text deltas, a final chunk with the finish reason, then [DONE]."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    request.on_token = lambda r: call_soon(loop, queue.put_nowait, list(r.output_ids))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    created, rid = int(time.time()), request.rid

    async def send(delta: dict[str, Any] | None, finish: str | None = None, usage: Any = None) -> None:
        chunk = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            if delta is not None
            else [],
        }
        if usage is not None:
            chunk["usage"] = usage
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    task = asyncio.ensure_future(core.generate(request))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    sent = ""
    try:
        await send({"role": "assistant", "content": ""})
        while (ids := await queue.get()) is not None:
            text = core.model.decode(ids, request.sampling.skip_special_tokens)
            if text.startswith(sent) and not text.endswith("\ufffd") and len(text) > len(sent):
                await send({"content": text[len(sent) :]})
                sent = text
        done = task.result()
        assert done.finish_reason is not None  # set before the request's on_finish resolves `generate`
        final = output_text(done, core.model)
        tail = final[len(sent) :] if final.startswith(sent) else ""
        await send({"content": tail} if tail else {}, FINISH.get(done.finish_reason["type"], "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(None, usage=_usage(len(done.input_ids), len(done.output_ids), done.cached_tokens))
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        core.abort_request(rid)
        raise
    return response


def _check_completion_body(core: EngineCore, body: Any) -> list[str | list[int]]:
    """Types, ranges and text lengths of a `/v1/completions` body (on the loop); its prompts."""
    if not isinstance(body, dict) or body.get("prompt") in (None, "", []):
        raise BadRequestError("1 validation error:\n  body.prompt: Field required")
    _check_common(body, COMPLETION_TYPES)
    if body.get("stream"):
        raise ValueError("Streaming /v1/completions is not supported by the embedded server.")
    if body.get("echo") or body.get("suffix"):
        raise ValueError("echo and suffix are not supported by the embedded server.")
    prompt = body["prompt"]
    if isinstance(prompt, str) or all(_is_token_id(t) for t in prompt):
        prompt = [prompt]
    if not all(isinstance(p, str) or (isinstance(p, list) and all(_is_token_id(t) for t in p)) for p in prompt):
        raise _invalid(
            "prompt",
            "Input should be a string, a list of strings, a list of token ids or a list of lists of token ids, "
            f"got {body['prompt']!r}"[:300],
        )
    check_prompt_chars([p for p in prompt if isinstance(p, str)], core.cfg.max_prompt_chars)
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens <= 0:  # SGLang's validator: positive (0 too is refused)
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}.")
    logprobs = body.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}.")
    return prompt


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _completion_items(core: EngineCore, body: dict[str, Any], prompt: list[str | list[int]]) -> list[GenerateItem]:
    """One native request per prompt of a checked `/v1/completions` body (SGLang's defaults: max_tokens 16);
    tokenises text prompts (run on a tokenizer thread when there are any)."""
    prompts: list[list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            if core.model.tokenizer is None:
                raise ValueError("The model has no tokenizer; send the prompt as token ids.")
            p = list(core.model.tokenizer.encode(p))
        prompts.append(list(p))
    sampling = {
        "max_new_tokens": body.get("max_tokens", 16),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", -1),
        "min_p": body.get("min_p"),
        "min_new_tokens": body.get("min_tokens"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "frequency_penalty": body.get("frequency_penalty"),
        "presence_penalty": body.get("presence_penalty"),
        "repetition_penalty": body.get("repetition_penalty"),
        "logit_bias": body.get("logit_bias"),
        "sampling_seed": body.get("seed"),
        **_constraint(body),
    }
    return [
        GenerateItem(
            rid=f"cmpl-{uuid.uuid4().hex}",
            input_ids=ids,
            sampling={k: v for k, v in sampling.items() if v is not None},
            return_logprob=body.get("logprobs") is not None,
            logprob_start_len=-1,
            top_logprobs_num=int(body.get("logprobs") or 0),
            return_text_in_logprobs=False,
        )
        for ids in prompts
    ]


async def completions(request: web.Request) -> web.Response:
    """OpenAI text completions: `n` samples per prompt, choices grouped by prompt (as SGLang orders them)."""
    core = request.app[CORE_KEY]
    body = await read_json(request)
    try:
        prompt = _check_completion_body(core, body)
        if any(isinstance(p, str) for p in prompt):  # tokenising a long text must not stall the loop
            items = await core.tokenize(lambda: _completion_items(core, body, prompt))
        else:
            items = _completion_items(core, body, prompt)
        n = body.get("n") or 1
        pairs = [(item, make_request(core, item)) for item in items for _ in range(n)]
        await core.attach_grammars([r for _, r in pairs])
    except ValueError as e:
        return error_shape(str(e), kind="BadRequestError")
    done = await asyncio.gather(*(core.generate(r) for _, r in pairs))

    def build() -> dict[str, Any]:  # on a worker thread: decoding every token of a long reply takes a while
        choices = []
        for index, ((item, _), r) in enumerate(zip(pairs, done, strict=True)):
            reason = r.finish_reason or {}
            choice = {
                "index": index,
                "text": output_text(r, core.model),
                "logprobs": _completion_logprobs(core, r) if item.return_logprob else None,
                "finish_reason": FINISH.get(reason.get("type", ""), "stop"),
                "matched_stop": reason.get("matched"),
            }
            if body.get("return_token_ids"):
                choice |= {"token_ids": list(r.output_ids), "prompt_token_ids": list(r.input_ids)}
            choices.append(choice)
        prompt_tokens = sum(len(item.input_ids) for item in items)
        return {
            "id": pairs[0][0].rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or core.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, sum(len(r.output_ids) for r in done), done[0].cached_tokens),
            "metadata": {"weight_version": done[0].weight_version},
        }

    return await json_reply(request, build)


def _completion_logprobs(core: EngineCore, r: Request) -> dict[str, Any]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [core.model.decode([t], skip_special_tokens=False) for t in r.output_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    tops = [{core.model.decode([t], skip_special_tokens=False): lp for lp, t in top} for top in r.output_top_logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": list(r.output_logprobs),
        "top_logprobs": tops or None,
        "text_offset": offsets,
    }

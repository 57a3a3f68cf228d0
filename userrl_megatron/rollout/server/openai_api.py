"""OpenAI-compatible routes: `/v1/chat/completions` (plain and streamed), `/v1/completions` (plain) and `/v1/models`.

This lets the embedded server act as the user simulator / judge and as an evaluation endpoint for the real
`openai` client. As in SGLang without `--tool-call-parser`, tool calls are not parsed out of the reply; `tools`
are passed to the chat template. `response_format` "json_object" is accepted but not enforced (no constrained
decoding here); "json_schema" is refused.
"""

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from userrl_megatron.rollout.server.core import EngineCore, call_soon
from userrl_megatron.rollout.server.http import CORE_KEY, BadRequestError, error_shape, make_request, read_json
from userrl_megatron.rollout.server.protocol import GenerateItem, output_text
from userrl_megatron.rollout.server.scheduler import Request

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


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


def _chat_item(core: EngineCore, body: Any) -> GenerateItem:
    """The native request a chat body stands for; ValueError / BadRequestError on bad input."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequestError("1 validation error:\n  body.messages: Field required (a non-empty list of messages)")
    tokenizer = core.model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("The model has no chat template; use /generate with input_ids.")
    response_format = (body.get("response_format") or {}).get("type", "text")
    if response_format not in ("text", "json_object"):
        raise ValueError(f"response_format {response_format!r} is not supported by the embedded server.")
    text = tokenizer.apply_chat_template(
        [_message(m) for m in body["messages"]],
        tools=body.get("tools"),
        add_generation_prompt=True,
        tokenize=False,
        **(body.get("chat_template_kwargs") or {}),
    )
    input_ids = list(tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
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
    }
    return GenerateItem(
        rid=f"chatcmpl-{uuid.uuid4().hex}",
        input_ids=input_ids,
        sampling={k: v for k, v in sampling.items() if v is not None},
        return_logprob=bool(body.get("logprobs")),
        logprob_start_len=-1,
        top_logprobs_num=int(body.get("top_logprobs") or 0),
        return_text_in_logprobs=False,
    )


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or "role" not in m:
        raise BadRequestError("1 validation error:\n  body.messages: each message needs a role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
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
        item = _chat_item(core, body)
        n = int(body.get("n") or 1)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        requests = [make_request(core, item) for _ in range(n)]
    except ValueError as e:
        return error_shape(str(e), kind="BadRequestError")
    model = body.get("model") or core.served_model_name
    if body.get("stream"):
        if n > 1:
            return error_shape("Streaming with n > 1 is not supported by the embedded server.", kind="BadRequestError")
        return await _stream_chat(request, core, requests[0], model, body)
    done = await asyncio.gather(*(core.generate(r) for r in requests))
    choices = [_choice(core, r, i, item) for i, r in enumerate(done)]
    completion = sum(len(r.output_ids) for r in done)
    return web.json_response(
        {
            "id": item.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(len(item.input_ids), completion, done[0].cached_tokens),
            "metadata": {"weight_version": done[0].weight_version},
        }
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
        "finish_reason": FINISH.get(reason.get("type"), "stop"),
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

    async def send(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> None:
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


def _completion_items(core: EngineCore, body: Any) -> list[GenerateItem]:
    """One native request per prompt of a `/v1/completions` body (SGLang's defaults: max_tokens 16)."""
    if not isinstance(body, dict) or body.get("prompt") in (None, "", []):
        raise BadRequestError("1 validation error:\n  body.prompt: Field required")
    if body.get("stream"):
        raise ValueError("Streaming /v1/completions is not supported by the embedded server.")
    if body.get("echo") or body.get("suffix"):
        raise ValueError("echo and suffix are not supported by the embedded server.")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    prompts: list[list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            if core.model.tokenizer is None:
                raise ValueError("The model has no tokenizer; send the prompt as token ids.")
            p = list(core.model.tokenizer.encode(p))
        prompts.append(list(p))
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}.")
    sampling = {
        "max_new_tokens": max_tokens,
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
        items = _completion_items(core, body)
        n = int(body.get("n") or 1)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        pairs = [(item, make_request(core, item)) for item in items for _ in range(n)]
    except ValueError as e:
        return error_shape(str(e), kind="BadRequestError")
    done = await asyncio.gather(*(core.generate(r) for _, r in pairs))
    choices = []
    for index, ((item, _), r) in enumerate(zip(pairs, done, strict=True)):
        reason = r.finish_reason or {}
        choice = {
            "index": index,
            "text": output_text(r, core.model),
            "logprobs": _completion_logprobs(core, r) if item.return_logprob else None,
            "finish_reason": FINISH.get(reason.get("type"), "stop"),
            "matched_stop": reason.get("matched"),
        }
        if body.get("return_token_ids"):
            choice |= {"token_ids": list(r.output_ids), "prompt_token_ids": list(r.input_ids)}
        choices.append(choice)
    prompt_tokens = sum(len(item.input_ids) for item in items)
    return web.json_response(
        {
            "id": pairs[0][0].rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or core.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, sum(len(r.output_ids) for r in done), done[0].cached_tokens),
            "metadata": {"weight_version": done[0].weight_version},
        }
    )


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

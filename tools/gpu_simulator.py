"""The GPU check's `simulator_schema` phase: the managed user simulator's schema-constrained calls on the device,
and the small JSON-schema check it validates replies with (the device has no jsonschema package)."""

import statistics
import time
from typing import Any

from gpu_smoke import Record, Smoke


def reply_schemas() -> list[Any]:
    """Every simulator call's reply schema the gyms state (`gyms/<gym>/replies.py`), gyms in name order."""
    import importlib
    import pkgutil

    import gyms
    from gyms.reply_schema import ReplySchema

    found = []
    for info in sorted(pkgutil.iter_modules(gyms.__path__), key=lambda m: m.name):
        name = f"gyms.{info.name}.replies"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        found += [v for v in vars(module).values() if isinstance(v, ReplySchema)]
    return found


def schema_errors(value: Any, schema: dict[str, Any], at: str = "$") -> list[str]:
    """Where `value` breaks `schema`, for the subset of JSON schema the reply schemas use (objects with required
    and no additional properties, arrays with item counts, strings with enum and maxLength, numbers with enum and
    bounds, booleans). The device has no jsonschema package."""
    kind, errors = schema.get("type"), []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": int | float}
    if kind in types and (not isinstance(value, types[kind]) or (kind != "boolean" and isinstance(value, bool))):
        return [f"{at}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} not in {schema['enum']}")
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{at}: {len(value)} characters, more than {schema['maxLength']}")
    if kind in ("integer", "number") and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        errors.append(f"{at}: {value} out of bounds")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{at}: {len(value)} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{at}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        extra = [k for k in value if k not in properties] if schema.get("additionalProperties") is False else []
        errors += [f"{at}: missing {k!r}" for k in missing] + [f"{at}: unexpected {k!r}" for k in extra]
        for key, sub in properties.items():
            if key in value:
                errors += schema_errors(value[key], sub, f"{at}.{key}")
    return errors


def phase_simulator_schema(smoke: Smoke, r: Record) -> None:
    """The managed user simulator's calls on the device: an embedded engine with the settings the run gives its
    simulator engines (`fleet.simulator.simulator_rollout`: JSON output held compact), a random Qwen3 with the real
    tokenizer, and one chat request per reply schema the gyms state, as the simulator client sends it
    (`response_format` json_schema, free text capped), sampled at temperature 1. A random model's replies must
    still be JSON that its schema accepts, ended by the grammar (not the token limit)."""
    import asyncio
    import dataclasses

    from gyms.reply_json import extract_json_object
    from tests.support.tiny_models import make_tiny_model
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.fleet.engine import SGLangClient
    from userrl_megatron.fleet.launch import launch_embedded
    from userrl_megatron.fleet.simulator import simulator_rollout
    from userrl_megatron.ports import free_port

    s = smoke.sizes
    widths = {k: v for k, v in s.model.items() if k != "vocab_size"}  # the tokenizer's vocabulary
    widths["max_position_embeddings"] = max(int(widths.get("max_position_embeddings", 0)), 2048)  # prompt + reply
    model_dir = make_tiny_model("qwen3", smoke.work / "simulator", seed=13, tokenizer="qwen3", **widths)
    cfg = dataclasses.replace(
        simulator_rollout(RootConfig()).embedded,
        device=smoke.device,
        threads=0 if smoke.cuda else 1,
        startup_timeout_s=s.budget_s["simulator_schema"],
    )
    schemas = reply_schemas()[: s.simulator_schemas or None]
    text_chars = 100  # configs/usersim_cpu.yaml's user_sim.structured_text_chars
    log_path = smoke.engine_log.with_name(smoke.engine_log.stem + ".simulator.log")
    server = launch_embedded(str(model_dir), cfg, free_port(), s.dtype, log_path=log_path)

    async def ask(client: SGLangClient, schema: Any) -> tuple[int, Any]:
        messages = [
            {"role": "system", "content": "You play the user of a conversation and answer in JSON."},
            {"role": "user", "content": f"Answer the call {schema.name}."},
        ]
        body = {
            "messages": messages,
            "response_format": schema.response_format(text_chars),
            "max_tokens": s.simulator_max_tokens,
            "temperature": 1.0,
        }
        return await client._request("POST", "/v1/chat/completions", body, timeout_s=300)

    async def run() -> list[tuple[int, Any]]:
        async with SGLangClient(server.url, timeout_s=300) as client:
            return list(await asyncio.gather(*(ask(client, schema) for schema in schemas)))

    try:
        start = time.perf_counter()
        answers = asyncio.run(run())
        seconds = time.perf_counter() - start
    finally:
        alive = server.alive()
        server.stop(timeout_s=20)
    r.check("engine_alive", alive, "" if alive else server.log_tail(20))
    failures: list[str] = []
    tokens: list[int] = []
    valid = 0
    for schema, (status, answer) in zip(schemas, answers, strict=True):
        if status != 200:
            failures.append(f"{schema.name}: HTTP {status} {str(answer)[:200]}")
            continue
        choice = answer["choices"][0]
        tokens.append(answer["usage"]["completion_tokens"])
        reply = extract_json_object(choice["message"]["content"])  # the simulator client's reader
        schema_of = schema.response_format(text_chars)["json_schema"]["schema"]
        errors = ["no JSON object"] if reply is None else schema_errors(reply, schema_of)
        if choice["finish_reason"] != "stop":
            errors.append(f"finish_reason {choice['finish_reason']}")
        failures += [f"{schema.name}: {e}" for e in errors[:3]]
        valid += not errors
    r.check("every_reply_valid", not failures, "; ".join(failures[:6]))
    r.figure(
        schemas=len(schemas),
        valid=valid,
        completion_tokens_mean=statistics.fmean(tokens) if tokens else None,
        completion_tokens_max=max(tokens, default=None),
        seconds=seconds,
    )
    r.summary = f"{valid} of {len(schemas)} reply schemas answered with valid JSON in {seconds:.1f} s"

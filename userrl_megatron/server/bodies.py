"""Request bodies: read within a byte limit of their route and a time limit, parsed off the event loop.

A body over its route's limit is refused with 413 from its `Content-Length` before a byte of it is read (or as
soon as a chunked one passes the limit), one that arrives slower than `body_timeout_s` with 408; both close the
connection (the server does not linger to drain it). Parsing, the count of JSON containers and items and the
depth walk run on worker threads. Python's JSON parser holds the interpreter lock while it runs, so the item
count, taken on the raw bytes first, is what bounds the loop's pause (4M items parse in about 0.3 s).
"""

import asyncio
import json
from typing import Any, TypeVar

from aiohttp import web

from userrl_megatron.server.threads import DaemonPool

MAX_JSON_DEPTH = 64  # nesting of a request body (pydantic, which SGLang validates with, stops at 200)
MAX_JSON_ITEMS = 4_000_000  # objects, arrays and items of one body (64 MiB of `{}` is 22 million: 1.4 GB, seconds)


R = TypeVar("R", bound=web.StreamResponse)


class BadRequestError(Exception):
    """A malformed body: answered with SGLang's validation-error shape."""


def closing(response: R) -> R:
    """`response` with `Connection: close`: what is left of the request body is not read."""
    response.force_close()
    return response


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The raw body of `request`, at most `limit` bytes, all of it within `timeout_s` (413 and 408 otherwise)."""
    length = request.content_length
    if length is not None and length > limit:
        raise closing(web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise closing(web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size))
                chunks.append(chunk)
    except TimeoutError:
        raise closing(
            web.HTTPRequestTimeout(text=f"The request body took longer than {timeout_s:g} s to arrive.")
        ) from None
    return b"".join(chunks)


async def parse_json(raw: bytes, pool: DaemonPool) -> Any:
    """Parse `raw` on a worker thread: at most MAX_JSON_ITEMS containers and items, nesting at most MAX_JSON_DEPTH
    levels (BadRequestError otherwise)."""
    return await pool.run(lambda: _parse(raw))


def _parse(raw: bytes) -> Any:
    items = raw.count(b"{") + raw.count(b"[") + raw.count(b",")  # an upper bound, strings' characters included
    if items > MAX_JSON_ITEMS:
        raise BadRequestError(f"1 validation error:\n  body: JSON with more than {MAX_JSON_ITEMS} items")
    too_deep = BadRequestError(f"1 validation error:\n  body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequestError(f"1 validation error:\n  body: JSON decode error ({e.msg} at position {e.pos})") from e
    except UnicodeDecodeError as e:
        raise BadRequestError(f"1 validation error:\n  body: not UTF-8 ({e.reason} at position {e.start})") from e
    except RecursionError:  # deeper than the interpreter's stack
        raise too_deep from None
    if _depth_over(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


def _depth_over(value: Any, limit: int) -> bool:
    """Whether lists and objects nest deeper than `limit` (iterative: a deep body cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False

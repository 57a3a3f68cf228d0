"""The engine server's log stays free of sglang-router's gRPC probe: an HTTP/2 connection preface is refused
without aiohttp's error traceback, while other malformed requests are still logged."""

import asyncio
import logging

import pytest
from aiohttp import web

from userrl_megatron.server.http import HTTP2_PROBE_FILTER
from userrl_megatron.server.log_redaction import PARSER_ERROR_FILTER

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
MALFORMED = b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"


async def _send_raw(payloads: list[bytes]) -> None:
    """Send each payload on its own connection to a bare aiohttp server whose error log has the probe filter only
    (an engine server started earlier in this process leaves its parser-error filter on the logger: it would
    rewrite, and rate-limit, the malformed request's record)."""
    log = logging.getLogger("aiohttp.server")
    parser_filter = PARSER_ERROR_FILTER in log.filters
    log.removeFilter(PARSER_ERROR_FILTER)
    log.addFilter(HTTP2_PROBE_FILTER)
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        for payload in payloads:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            await writer.drain()
            assert (await reader.read(12)).startswith(b"HTTP/1.")  # aiohttp answers 400 and closes
            writer.close()
            await writer.wait_closed()
    finally:
        await runner.cleanup()
        log.removeFilter(HTTP2_PROBE_FILTER)
        if parser_filter:
            log.addFilter(PARSER_ERROR_FILTER)


def test_an_http2_preface_is_not_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        asyncio.run(_send_raw([HTTP2_PREFACE]))
    assert [r for r in caplog.records if r.name == "aiohttp.server"] == []


def test_other_malformed_requests_are_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        asyncio.run(_send_raw([MALFORMED]))
    assert [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"] == [
        "Error handling request from 127.0.0.1"
    ]

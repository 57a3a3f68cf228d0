"""What the server's log may not hold: the API key, and the raw bytes of a request aiohttp could not parse.

aiohttp logs a malformed request (an `Authorization` header holding a NUL, a header line over 8,190 bytes) with
the offending line, which is the key's line when that header is the malformed one; it cuts long lines at about
100 bytes, so part of a long key can show where the whole key does not. `ParserErrorFilter` rewrites those
records to the peer and the error's class, rate-limited; `KeyRedactor`, on the log's handlers, writes any
remaining occurrence of the key as `<redacted>`.
"""

import logging

from aiohttp.http_exceptions import HttpProcessingError

from userrl_megatron.server.connections import RateLimitedLog

REDACTED = "<redacted>"


class ParserErrorFilter(logging.Filter):
    """On `aiohttp.server`: a request aiohttp could not parse is logged as one line without its bytes, at most
    once per interval."""

    def __init__(self) -> None:
        super().__init__()
        self._limited = RateLimitedLog(logging.getLogger("aiohttp.server"))

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        self._limited.warning(
            type(error).__name__, "refused a malformed HTTP request from %s (%s)", peer, type(error).__name__
        )
        return False


class KeyRedactor(logging.Filter):
    """On a log handler: every record's text, traceback included, with `key` written as `<redacted>`."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.key:
            return True
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if self.key in text or (record.exc_text and self.key in record.exc_text):
            record.msg, record.args = text.replace(self.key, REDACTED), None
            record.exc_text = record.exc_text.replace(self.key, REDACTED) if record.exc_text else record.exc_text
            record.exc_info = None if record.exc_text else record.exc_info
        return True


PARSER_ERROR_FILTER = ParserErrorFilter()  # one instance: adding it again is a no-op


def redact_server_log(key: str) -> None:
    """Install both filters: the parser-error one on aiohttp's server logger, the key's on the root handlers."""
    logging.getLogger("aiohttp.server").addFilter(PARSER_ERROR_FILTER)
    if key:
        redactor = KeyRedactor(key)
        for handler in logging.getLogger().handlers:
            handler.addFilter(redactor)

"""Structured generation as SGLang's xgrammar backend does it: `json_schema`, `regex` and `ebnf` sampling params.

A grammar is compiled once per distinct (kind, spec) and cached, an invalid one too (its error is cached). Each
request gets a matcher of its own. Each decode step, the sampler asks the matchers of its grammar rows for a token
bitmask and masks those rows' logits; rows without a grammar are untouched. The stop tokens are in a row's mask only
where its grammar may end. A terminated matcher ends its request with finish reason "stop".
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")  # the sampling params this module serves
# SGLang's name of each kind in "Failed to compile {kind} grammar: ...".
KIND_NAMES = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf"}
MAX_CACHED_GRAMMARS = 256  # distinct (kind, spec) kept compiled; the least recently used goes first
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what OpenAI's response_format json_object stands for (as SGLang)

# JSON Schema keywords xgrammar 0.2.x accepts but does not enforce: refused (as SGLang 0.5.23), never ignored.
_IGNORED_KEYWORDS = frozenset(
    {"contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains", "minContains"}
    | {"multipleOf", "not", "then", "uniqueItems"}
)
_STRING_FORMATS = frozenset(
    {"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer"}
    | {"relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid"}
)
_ONE_SCHEMA: tuple[str, ...] = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if")
_ONE_SCHEMA += ("items", "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_STRING_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (("format", ("format",)), ("pattern", ("pattern",)))
_STRING_GROUPS += (("minLength/maxLength", ("minLength", "maxLength")),)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties", "dependencies")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; its message names the kind and the problem (answered as 400)."""


def grammar_key(raw: dict[str, Any]) -> tuple[str, str] | None:
    """The (kind, spec) a `sampling_params` dict asks for, None for none; ValueError for several or a non-string."""
    given = [k for k in GRAMMAR_KEYS if raw.get(k) not in (None, "")]
    if raw.get("structural_tag") not in (None, ""):
        given.append("structural_tag")
    if len(given) > 1:
        raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if not given:
        return None
    kind = given[0]
    if kind == "structural_tag":
        raise ValueError("sampling_params.structural_tag is not supported by the embedded server.")
    if not isinstance(raw[kind], str):
        raise ValueError(f"{kind} must be a string, got {type(raw[kind]).__name__}.")
    return kind, raw[kind]


def check_json_schema(schema: Any) -> None:
    """Refuse what xgrammar would silently not enforce: its ignored keywords, unknown string formats, and several
    string constraints on one schema (SGLang 0.5.23's `validate_xgrammar_json_schema`, same messages)."""
    for node, pointer in _subschemas(schema, "#"):
        ignored = sorted(_IGNORED_KEYWORDS.intersection(node))
        if ignored:
            _unsupported(pointer, f"keyword(s) {', '.join(ignored)} would be ignored")
        kind = node.get("type")
        if not (kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)):
            continue
        if "format" in node and node["format"] not in _STRING_FORMATS:
            _unsupported(pointer, f"string format {node['format']!r} is not implemented")
        groups = [g for g, keys in _STRING_GROUPS if any(k in node for k in keys)]
        if len(groups) > 1:
            _unsupported(pointer, f"constraints {', '.join(groups)} cannot be enforced together")


def _unsupported(pointer: str, reason: str) -> None:
    raise ValueError(f"JSON Schema at {pointer} is not supported by xgrammar: {reason}")


def _subschemas(schema: Any, pointer: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every schema object inside `schema` (through schema-valued keywords only) with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for key in _ONE_SCHEMA:
        child = schema.get(key)
        if key == "items" and isinstance(child, list):
            for i, item in enumerate(child):
                yield from _subschemas(item, f"{pointer}/{key}/{i}")
        else:
            yield from _subschemas(child, f"{pointer}/{key}")
    for key in _SCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{pointer}/{key}/{name.replace('~', '~0').replace('/', '~1')}")


class Grammars:
    """The engine's grammar compiler and cache; thread-safe (compiles run on tokenizer threads).

    `any_whitespace` / `max_whitespace_cnt` shape the JSON that schemas allow (SGLang's
    `--constrained-json-disable-any-whitespace` / `--constrained-json-max-whitespace-cnt`)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self._max_cached = max_cached
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use (the vocabulary's tables)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.compiled = 0  # grammars compiled (cache misses), for tests and logs

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                if self._tokenizer is None:
                    raise GrammarError("Grammar-based generation needs the model's tokenizer; this server has none.")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, kind: str, spec: str) -> Any:
        """The xgrammar CompiledGrammar of (kind, spec), from the cache when it was compiled before; GrammarError
        (cached too) when it cannot be compiled. Concurrent callers of one key wait for a single compile."""
        key = (kind, spec)
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                future = self._cache[key] = Future()
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(kind, spec))
            except Exception as e:
                future.set_exception(e if isinstance(e, GrammarError) else GrammarError(str(e)))
        return future.result()

    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._xgrammar_compiler()
        self.compiled += 1
        name = KIND_NAMES[kind]
        try:
            if kind == "json_schema":
                check_json_schema(json.loads(spec))
                return compiler.compile_json_schema(
                    spec, any_whitespace=self.any_whitespace, max_whitespace_cnt=self.max_whitespace_cnt
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, UnicodeDecodeError) as e:
            raise GrammarError(f"Failed to compile {name} grammar: {_xgrammar_message(e)}") from None

    def matcher(self, kind: str, spec: str) -> Any:
        """A fresh xgrammar GrammarMatcher of (kind, spec): one request's grammar state."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(kind, spec))


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's message without its C++ prefix ("[12:00:00] /project/cpp/x.cc:83: Check failed: ...: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


_FILLERS = threading.local()  # each scheduler thread's xgrammar BatchGrammarMatcher, made on first use


def _batch_filler() -> Any:
    """xgrammar's batch filler on one thread: half the time of filling row by row from Python (32 rows of a JSON
    schema on SmolLM2's vocabulary: ~1 ms against ~2 ms), and no thread beside the engine's torch threads."""
    filler = getattr(_FILLERS, "filler", None)
    if filler is None:
        import xgrammar

        filler = _FILLERS.filler = xgrammar.BatchGrammarMatcher(1)
    return filler


def apply_bitmasks(logits: torch.Tensor, matchers: Sequence[Any]) -> None:
    """Mask, in place, the logits of every row whose matcher is not None to the tokens its grammar allows next.

    The bitmask is filled on the host (xgrammar) and applied with one kernel: xgrammar's own on CPU, a few
    batched torch ops on another device (one non-blocking copy, no synchronisation). Other rows keep their logits."""
    import xgrammar

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)  # all bits set: every token allowed
    _batch_filler().batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, rows)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        return
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    _apply_unpacked(logits, bitmask.to(logits.device))


def _apply_unpacked(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """xgrammar's masking in batched torch ops on `logits`' device: bit j of a row's int32 word w allows token
    32 w + j; a row of all bits set (a free row) is left as it was."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits.masked_fill_(~allowed, float("-inf"))

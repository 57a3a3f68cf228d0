"""The API key of the engines and the router a run starts (docs/engine.md, "Security model").

A run takes its key from the environment variable `rollout.api_key_env` names (default `USERRL_ENGINE_API_KEY`),
or, when that variable is unset, makes a random one. The key travels only in process environments and in
memory (Ray task arguments to the engine actors and the weight senders), never in a config, on a command line
or in a log. Requests carry it as SGLang's clients do: `Authorization: Bearer <key>`; servers check it with
`wire/bearer.py`.
"""

import logging
import os
import secrets

log = logging.getLogger(__name__)

DEFAULT_KEY_ENV = "USERRL_ENGINE_API_KEY"
KEY_BYTES = 32  # entropy of a generated key


def run_api_key(env_name: str) -> str:
    """The key of this run's engines: `$env_name` when set, else a new random key (logged without its value)."""
    key = os.environ.get(env_name, "")
    if key:
        log.info("engines and router require the API key in $%s", env_name)
        return key
    log.info("engines and router require a random API key made for this run ($%s is unset)", env_name)
    return secrets.token_urlsafe(KEY_BYTES)


def key_handover(api_key: str, env_name: str) -> tuple[str, dict[str, str]]:
    """How a server process gets `api_key`: the variable it reads it from ("" = no key) and the environment entry
    that holds it (`ProcessLaunch.secrets`)."""
    return (env_name, {env_name: api_key}) if api_key else ("", {})

"""Shared pieces of the tau tests: a domain whose shared base is checked for leaked writes, and a tool caller."""

from collections.abc import Callable, Iterator
from pathlib import Path

from gyms.tau.domain import Domain, load_domain
from gyms.tau.store import EpisodeDB, db_hash


def untouched_domain(shared_data: Path, name: str) -> Iterator[Domain]:
    """Yield the process-wide domain; afterwards its base must still hash as before (a fixture body)."""
    domain = load_domain(name, str(shared_data / "taubench"))
    pristine = db_hash(domain.base.tables)
    yield domain
    assert db_hash(domain.base.tables) == pristine, f"a write leaked into the shared {name} base"


def tool_caller(domain: Domain, db: EpisodeDB) -> Callable[..., str]:
    """`call(name, **arguments)` -> the observation of that tool call on `db`."""

    def call(name: str, **arguments: object) -> str:
        return domain.call(db, name, arguments)

    return call

"""`userrl data fetch` / `verify`: put the public data files in a data folder, each checked against its sha256.

Files come from their canonical URLs, or from a local copy with the same layout (`--from DIR`, e.g.
`../shared/data`). A file is written only after its checksum matched (atomically, so a half-written or corrupt
file never takes the place of a good one); a file already present with the right checksum is left alone.
"""

import hashlib
import logging
import shutil
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from userrl_megatron.data.manifest import FILES
from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)
GROUPS = ("userrl", "taubench")
DOWNLOAD_ATTEMPTS = 3


@dataclass(frozen=True)
class DataFile:
    path: str  # relative to the data folder
    sha256: str
    size: int
    url: str  # "" when the file comes from a local copy only


MANIFEST = tuple(DataFile(*entry) for entry in FILES)


class ChecksumError(UserError):
    """A file's content does not match the manifest."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(groups: tuple[str, ...] = GROUPS) -> list[DataFile]:
    """The manifest entries of the groups (`userrl`, `taubench`)."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise UserError(f"unknown data group(s) {unknown}; choose from {', '.join(GROUPS)}")
    return [f for f in MANIFEST if f.path.split("/", 1)[0] in groups]


def verify(root: Path, groups: tuple[str, ...] = GROUPS) -> dict[str, str]:
    """The state of every manifest file under `root`: "ok", "missing" or "corrupt"."""
    states = {}
    for f in manifest(groups):
        path = root / f.path
        states[f.path] = "missing" if not path.is_file() else "ok" if sha256_of(path) == f.sha256 else "corrupt"
    return states


def fetch(
    dest: Path,
    source: Path | None = None,
    groups: tuple[str, ...] = GROUPS,
    force: bool = False,
    download: Callable[[str, Path], None] | None = None,
) -> Counter[str]:
    """Fetch the groups' files into `dest` (from `source` if given, else their URLs); returns counts by outcome.

    Outcomes: "present" (already there, checksum ok), "copied", "downloaded". A checksum mismatch raises
    ChecksumError at once; files that cannot be had (absent from `source`, or without a URL) are reported
    together in one UserError after every other file was fetched.
    """
    download = download or _download
    if source is not None and not source.is_dir():
        raise UserError(f"--from {source}: not a directory")
    counts: Counter[str] = Counter()
    unavailable = []
    for f in manifest(groups):
        target = dest / f.path
        if not force and target.is_file() and sha256_of(target) == f.sha256:
            counts["present"] += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part")
        if source is not None:
            if not (source / f.path).is_file():
                unavailable.append(f"{f.path} (not in {source})")
                continue
            shutil.copyfile(source / f.path, tmp)
            outcome = "copied"
        elif f.url:
            download(f.url, tmp)
            outcome = "downloaded"
        else:
            unavailable.append(f"{f.path} (no public URL: derived data, fetch it with --from DIR)")
            continue
        got = sha256_of(tmp)
        if got != f.sha256:
            tmp.unlink()
            origin = source / f.path if source is not None else f.url
            raise ChecksumError(f"{f.path}: sha256 {got} from {origin} does not match the manifest's {f.sha256}")
        tmp.replace(target)
        counts[outcome] += 1
    if unavailable:
        raise UserError(f"{len(unavailable)} file(s) could not be fetched:\n  " + "\n  ".join(unavailable))
    return counts


def _download(url: str, target: Path, backoff_s: float = 2.0) -> None:
    """Stream `url` to `target`, retrying failures after backoff_s, 2 x backoff_s, ..."""
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
                shutil.copyfileobj(response, out)
            return
        except OSError as e:
            if attempt == DOWNLOAD_ATTEMPTS:
                raise UserError(f"cannot download {url}: {e} (no network? use `userrl data fetch --from DIR`)") from e
            log.warning("download of %s failed (%s); retrying", url, e)
            time.sleep(backoff_s * 2 ** (attempt - 1))

"""Public data fetch (checksums, local copies, downloads from a local HTTP server), row files, mixtures, build."""

import json
import os
import shutil
from pathlib import Path

import pytest
from aiohttp import web

from gyms.base import list_gyms
from gyms.data import DataMissingError
from gyms.tools import INTERACT_TOOL
from tests.support.openai_server import OpenAIServer
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.data.build import build_rows
from userrl_megatron.data.fetch import MANIFEST, ChecksumError, _download, fetch, manifest, sha256_of, verify
from userrl_megatron.data.rows import read_rows
from userrl_megatron.errors import UserError

TAU_REGISTERED = "tau_retail" in list_gyms()


def _linked_copy(shared: Path, dest: Path, group: str) -> Path:
    """A local copy of one data group made of symlinks (cheap), to corrupt or thin out safely."""
    for f in manifest((group,)):
        (dest / f.path).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(shared / f.path, dest / f.path)
    return dest


def test_manifest_matches_the_shared_data(shared_data: Path) -> None:
    """Every file of the data groups the project reads is in the manifest (a group the project does not read yet,
    such as tau2 until its gyms land, is not listed)."""
    groups = {f.path.split("/")[0] for f in MANIFEST}
    files = sorted(
        str(p.relative_to(shared_data))
        for p in shared_data.rglob("*")
        if p.is_file() and p.relative_to(shared_data).parts[0] in groups
    )
    assert sorted(f.path for f in MANIFEST) == files
    assert verify(shared_data) == {f.path: "ok" for f in MANIFEST}
    assert all(f.url.startswith("https://raw.githubusercontent.com/") for f in manifest(("userrl",)))
    assert {f.path for f in MANIFEST if not f.url} == {
        f"taubench/{p}"
        for p in (
            "README.md",
            "SPEC.md",
            "gold_replay.json",
            "airline/tasks_test.json",
            "airline/tools.json",
            "retail/tasks_dev.json",
            "retail/tasks_legacy.json",
            "retail/tasks_test.json",
            "retail/tasks_train.json",
            "retail/tools.json",
        )
    }


def test_fetch_from_a_local_copy(shared_data: Path, tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    assert fetch(dest, shared_data, ("userrl",)) == {"copied": len(manifest(("userrl",)))}
    assert verify(dest, ("userrl",)) == {f.path: "ok" for f in manifest(("userrl",))}
    assert fetch(dest, shared_data, ("userrl",)) == {"present": len(manifest(("userrl",)))}
    corrupt = dest / "userrl/gyms/FunctionGym/functiongym/data/functions.json"
    corrupt.write_text("[]")
    assert verify(dest, ("userrl",))["userrl/gyms/FunctionGym/functiongym/data/functions.json"] == "corrupt"
    assert fetch(dest, shared_data, ("userrl",))["copied"] == 1
    assert sha256_of(corrupt) == sha256_of(shared_data / "userrl/gyms/FunctionGym/functiongym/data/functions.json")
    # the fetched folder serves the gyms like shared/data does
    assert len(load_tasks(["function"], "test", GymsConfig(data_dir=str(dest)))) == 78


def test_a_corrupted_source_file_is_rejected(shared_data: Path, tmp_path: Path) -> None:
    source = _linked_copy(shared_data, tmp_path / "source", "userrl")
    bad = source / "userrl/data/function_multiturn/test.parquet"
    bad.unlink()
    bad.write_bytes(b"not the parquet file")
    dest = tmp_path / "cache"
    with pytest.raises(ChecksumError) as e:
        fetch(dest, source, ("userrl",))
    assert str(e.value).startswith(
        f"userrl/data/function_multiturn/test.parquet: sha256 {sha256_of(bad)} from {bad} does not match the "
        "manifest's "
    )
    assert not (dest / "userrl/data/function_multiturn/test.parquet").exists()
    assert not list(dest.rglob("*.part"))


def test_files_missing_from_the_source_are_listed(shared_data: Path, tmp_path: Path) -> None:
    source = _linked_copy(shared_data, tmp_path / "source", "taubench")
    (source / "taubench/SPEC.md").unlink()
    dest = tmp_path / "cache"
    with pytest.raises(UserError, match=r"1 file\(s\) could not be fetched:\n  taubench/SPEC\.md \(not in "):
        fetch(dest, source, ("taubench",))
    assert verify(dest, ("taubench",))["taubench/retail/users.json"] == "ok"  # everything else was fetched


def test_download_path_against_a_local_http_server(shared_data: Path, tmp_path: Path) -> None:
    """The real downloader against 127.0.0.1 (no network here): URL files download and are checked; files
    without a URL need --from."""

    async def serve(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(shared_data / request.match_info["path"])

    with OpenAIServer(routes={"GET /files/{path:.+}": serve}) as server:
        local = {f.url: f"{server.root_url}/files/{f.path}" for f in MANIFEST if f.url}
        dest = tmp_path / "cache"
        with pytest.raises(UserError) as e:
            fetch(dest, None, ("taubench",), download=lambda url, target: _download(local[url], target))
    assert str(e.value).startswith("10 file(s) could not be fetched:\n  taubench/README.md (no public URL: derived")
    states = verify(dest, ("taubench",))
    assert sorted(p for p, s in states.items() if s == "ok") == sorted(f.path for f in manifest(("taubench",)) if f.url)


def test_download_failure_names_the_way_out(tmp_path: Path) -> None:
    with OpenAIServer() as server:
        url = f"{server.root_url}/missing"
    with pytest.raises(
        UserError, match=r"cannot download .*/missing: .* \(no network\? use `userrl data fetch --from DIR`\)"
    ):
        _download(url, tmp_path / "x", backoff_s=0.0)


def test_missing_data_errors_name_the_fetch_command(tmp_path: Path) -> None:
    cfg = GymsConfig(data_dir=str(tmp_path))
    for source in ("alltrain", "travel", "intention"):
        with pytest.raises(DataMissingError, match=r"is missing from the data folder .*: run `userrl data fetch`"):
            load_tasks([source], "train", cfg)


def test_build_rows_and_read_them_back(shared_data: Path, tmp_path: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    cfg.function.generator.tasks_per_split = 8
    built = build_rows(cfg, tmp_path, ["function", "function-procedural", "search", "alltest"])
    assert [(b.source, b.split, b.rows) for b in built] == [
        ("function", "train", 460),
        ("function", "test", 78),
        ("function-procedural", "train", 8),
        ("function-procedural", "test", 8),
        ("search", "test", 125),  # no train split: skipped
        ("alltest", "test", 597 if TAU_REGISTERED else 515),  # 82 tau rows need the tau gyms
    ]
    original = load_tasks(["function"], "test", cfg)
    for suffix in ("parquet", "jsonl"):
        path = tmp_path / "function" / f"test.{suffix}"
        assert read_rows(path, shared_data) == original
        assert load_tasks([str(path)], "train", cfg) == original  # a row file fixes its own tasks
    row = json.loads((tmp_path / "function" / "test.jsonl").read_text().splitlines()[0])
    assert set(row) == {"gym", "task_id", "split", "prompt", "tools", "metadata"}
    assert (row["gym"], row["task_id"], row["split"]) == ("function", original[0].task_id, "test")
    assert row["tools"] == [INTERACT_TOOL] and [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["metadata"]["record"] == original[0].metadata["record"]


def test_userrl_parquet_rows_are_a_source(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    path = shared_data / "userrl/data/function_multiturn/test.parquet"
    assert load_tasks([str(path)], "test", cfg) == load_tasks(["function"], "test", cfg)


def test_mixtures(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train = load_tasks(["alltrain"], "train", cfg)
    counts: dict[str, int] = {}
    for task in train:
        counts[task.gym] = counts.get(task.gym, 0) + 1
    assert {g: n for g, n in counts.items() if not g.startswith("tau")} == {
        "travel": 925,
        "turtle": 423,
        "persuade": 378,
        "function": 200,
    }
    assert len(train) == (2426 if TAU_REGISTERED else 1926)
    function_train = {t.task_id for t in load_tasks(["function"], "train", cfg)}
    assert {t.task_id for t in train if t.gym == "function"} <= function_train


def test_bad_row_files(tmp_path: Path) -> None:
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"gym": "function"}\n')
    with pytest.raises(UserError, match=r"not a task row file \(missing columns task_id, prompt, tools, metadata\)"):
        read_rows(bad, tmp_path)
    with pytest.raises(UserError, match="row file not found"):
        read_rows(tmp_path / "nope.parquet", tmp_path)
    shutil.copy(bad, tmp_path / "rows.csv")
    with pytest.raises(UserError, match="unknown task source"):
        load_tasks([str(tmp_path / "rows.csv")], "train", GymsConfig())

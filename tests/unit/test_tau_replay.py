"""Replaying the gold actions of all 685 tau-bench tasks reproduces every observation and every final hash."""

import hashlib
import json

import pytest

from gyms.tau.domain import load_domain
from gyms.tau.store import db_hash

SPLITS = [("retail", "train", 500), ("retail", "test", 115), ("retail", "dev", 20), ("airline", "test", 50)]


@pytest.fixture(scope="module")
def gold(shared_data):
    return json.loads((shared_data / "taubench" / "gold_replay.json").read_text())


@pytest.mark.parametrize(("domain_name", "split", "count"), SPLITS)
def test_gold_replay_reproduces_observations_and_hashes(shared_data, gold, domain_name, split, count):
    domain = load_domain(domain_name, str(shared_data / "taubench"))
    records = gold[domain_name][f"tasks_{split}"]
    assert len(records) == count == len(domain.tasks(split))
    compared = skipped = 0
    for record in records:
        task = domain.task(split, record["task_index"])
        db = domain.new_db()
        observations = domain.replay(task.actions, db)
        assert len(observations) == len(record["actions"])
        for action, observation, expected in zip(task.actions, observations, record["actions"], strict=True):
            assert action["name"] == expected["name"]
            if expected.get("skipped_in_replay"):
                assert observation is None
                skipped += 1
                continue
            where = f"{domain_name} {split} task {record['task_index']} {action['name']}"
            assert observation[:80] == expected["observation_head"], where
            assert len(observation) == expected["observation_len"], where
            assert hashlib.sha256(observation.encode()).hexdigest() == expected["observation_sha256"], where
            assert observation.startswith("Error: ") == expected.get("is_error", False), where
            compared += 1
        assert db.hash() == record["gold_db_hash"], f"{domain_name} {split} task {record['task_index']}"
        assert domain.gold_hash(task) == record["gold_db_hash"]
        assert (db.hash() != gold[domain_name]["initial_db_hash"]) == record["db_changed"]
    assert compared + skipped == sum(len(r["actions"]) for r in records)


@pytest.mark.parametrize("domain_name", ["retail", "airline"])
def test_base_hash_matches_fixture_and_survives_every_replay(shared_data, gold, domain_name):
    """The shared base hashes as tau-bench's initial DB, and no episode wrote into it (a from-scratch rehash)."""
    domain = load_domain(domain_name, str(shared_data / "taubench"))
    for split in {"retail": ("train", "test", "dev", "legacy"), "airline": ("test",)}[domain_name]:
        for task in domain.tasks(split):
            domain.replay(task.actions, domain.new_db())
    assert domain.base.hash() == gold[domain_name]["initial_db_hash"]
    assert db_hash(domain.base.tables) == gold[domain_name]["initial_db_hash"]


def test_incremental_hash_equals_reference_and_canonical_json(shared_data, gold):
    """The fast hash (changed records re-rendered) equals hashing the materialised DB, for tasks of both domains."""
    checked = 0
    for domain_name, split, indices in [("retail", "test", (0, 5, 33, 64)), ("airline", "test", (0, 2, 5, 11))]:
        domain = load_domain(domain_name, str(shared_data / "taubench"))
        for index in indices:
            record = gold[domain_name][f"tasks_{split}"][index]
            db = domain.new_db()
            domain.replay(domain.task(split, index).actions, db)
            full = db.to_dict()
            assert db.hash() == db_hash(full) == record["gold_db_hash"]
            canonical = json.dumps(full, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            assert hashlib.sha256(canonical.encode()).hexdigest() == record["gold_db_hash_canonical_json"]
            checked += bool(record["db_changed"])
    assert checked >= 6

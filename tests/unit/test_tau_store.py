"""Copy-on-write episode databases: isolation, dict semantics, and the incremental hash against the reference."""

import copy
import hashlib

import pytest

from gyms.tau.domain import load_domain
from gyms.tau.store import BaseTables, EpisodeDB, db_hash, to_hashable


def _base() -> BaseTables:
    return BaseTables(
        {
            "people": {
                "bob": {"name": "Bob", "tags": ["a", "b"], "score": 1.5, "address": {"zip": "02139", "city": "X"}},
                "alice": {"name": "Alice", "tags": [], "score": 2, "address": {"zip": "10001", "city": "Y"}},
                "carol": {"name": "Carol", "tags": ["c"], "score": None, "address": {"zip": "94105", "city": "Z"}},
            },
            "solo": {"only": {"v": True}},
            "empty": {},
        }
    )


def test_to_hashable_and_reference_hash_follow_tau_bench():
    assert to_hashable({"b": [1, {"d": 2, "c": (3,)}], "a": {2, 1}}) == (
        ("a", (1, 2)),
        ("b", (1, (("c", (3,)), ("d", 2)))),
    )
    # sha256 of str() of the nested tuples; int and float differ
    assert db_hash({"x": 150}) != db_hash({"x": 150.0})
    assert db_hash({"x": {"k": 1}}) == hashlib.sha256(b"(('x', (('k', 1),)),)").hexdigest()


def test_fresh_db_hashes_like_the_base_including_one_and_zero_record_tables():
    base = _base()
    assert EpisodeDB(base).hash() == db_hash(base.tables) == base.hash()


def test_edits_are_private_to_the_episode_and_the_base_never_changes():
    base = _base()
    pristine = copy.deepcopy(base.tables)
    first, second = EpisodeDB(base), EpisodeDB(base)
    bob = first["people"].edit("bob")
    bob["tags"].append("z")
    bob["address"]["zip"] = "00000"
    first["solo"].edit("only")["v"] = False
    assert first["people"]["bob"]["tags"] == ["a", "b", "z"]
    assert second["people"]["bob"]["tags"] == ["a", "b"]
    assert base.tables == pristine
    assert first["people"].edit("bob") is bob  # copied once, then reused
    assert second.hash() == db_hash(pristine)
    assert first.hash() == db_hash(first.to_dict()) != second.hash()


def test_table_iteration_keeps_dict_order_with_inserts_and_replacements():
    db = EpisodeDB(_base())
    people = db["people"]
    people.edit("alice")["score"] = 3
    people.insert("aaron", {"name": "Aaron"})
    people.insert("carol", {"name": "Carol II"})
    assert list(people.keys()) == ["bob", "alice", "carol", "aaron"]
    assert [p["name"] for p in people.values()] == ["Bob", "Alice", "Carol II", "Aaron"]
    assert len(people) == 4 and "aaron" in people and "zed" not in people
    assert people["alice"]["score"] == 3
    with pytest.raises(KeyError):
        people.edit("zed")
    # an inserted record sorts into the hash order; the fast hash equals the reference on the materialised DB
    assert db.hash() == db_hash(db.to_dict())


@pytest.mark.parametrize(
    "change",
    [
        lambda db: db["solo"].edit("only").update(v=1),  # a 1-record table keeps its trailing comma
        lambda db: db["empty"].insert("first", {"x": 1}),  # 0 -> 1 record
        lambda db: db["people"].edit("carol").pop("address"),  # last key of the table
        lambda db: db["people"].insert("zz", {"é": "ünïcode"}),  # non-ASCII changes byte offsets
        lambda db: (db["people"].edit("alice"), db["people"].edit("carol")["tags"].append(1.0)),
    ],
)
def test_incremental_hash_equals_reference_after_each_kind_of_change(change):
    db = EpisodeDB(_base())
    before = db.hash()
    change(db)
    assert db.hash() == db_hash(db.to_dict())
    assert db.hash() != before or not any(t.changed for t in db.tables.values())


def test_an_edit_that_restores_the_original_hashes_like_the_base(shared_data):
    domain = load_domain("retail", str(shared_data / "taubench"))
    db = domain.new_db()
    user = db["users"].edit("noah_brown_6181")
    zip_code = user["address"]["zip"]
    user["address"]["zip"] = "00000"
    assert db.hash() != domain.base.hash()
    user["address"]["zip"] = zip_code
    assert db.hash() == domain.base.hash()


def test_episodes_of_a_real_domain_are_isolated(shared_data):
    domain = load_domain("airline", str(shared_data / "taubench"))
    first = domain.new_db()
    out = domain.call(first, "cancel_reservation", {"reservation_id": "4WQ150"})
    assert '"status": "cancelled"' in out
    second = domain.new_db()
    assert "status" not in second["reservations"]["4WQ150"]
    assert "status" not in domain.base.tables["reservations"]["4WQ150"]
    assert second.hash() == domain.base.hash() != first.hash()

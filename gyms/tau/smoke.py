"""Scripted smoke episodes of the tau gyms (`userrl gym smoke`): gold tool calls earn 1, wrong ones 0.

They need the tau-bench data (the databases cannot be inlined); without it the gyms list no smoke episodes and a
warning says so. The scripted customer answers every message with `###STOP###`.
"""

import json
import logging
from typing import Any

from gyms.data import data_dir
from gyms.smoke import SmokeEpisode
from gyms.tau.domain import load_domain
from gyms.tau.tasks import parse_task_id, record_for
from gyms.tau.user import STOP

log = logging.getLogger(__name__)


def _stop(messages: list[dict[str, Any]]) -> str:
    return STOP


def _gold(task_id: str) -> tuple[dict[str, Any], list[str], Any] | None:
    """(record, the gold actions as `[answer]` strings, the task) or None when the data is missing."""
    root = data_dir()
    if not (root / "taubench").is_dir() or not (root / "userrl").is_dir():
        log.warning("tau smoke episodes skipped: no tau-bench / UserRL data in %s (run `userrl data fetch`)", root)
        return None
    record = record_for(task_id, root)
    domain, split, index = parse_task_id(task_id)
    task = load_domain(domain, str(root / "taubench")).task(split, index)
    answers = ["[answer] " + json.dumps({"name": a["name"], "arguments": a["kwargs"]}) for a in task.actions]
    return record, answers, task


def tau_smoke() -> list[SmokeEpisode]:
    """TauGym: a solved retail task, and bad actions followed by a wrong change."""
    gold = _gold("retail-000")
    if gold is None:
        return []
    record, answers, _ = gold
    cancel = {"name": "cancel_pending_order", "arguments": {"order_id": "#W8955613", "reason": "no longer needed"}}
    wrong = "[answer] " + json.dumps(cancel)
    bad = ["hello", "[answer] not json", "[search] tools", "[search] tools", "[search] weather", "[search] help", wrong]
    return [
        SmokeEpisode(
            "list tools, gold tool calls, customer stops",
            record,
            ["[search] tools", *answers, "[action] Your exchange is submitted."],
            [0.0] * (len(answers) + 1) + [1.0],
            script=_stop,
        ),
        SmokeEpisode(
            "bad actions, a wrong change, customer stops",
            record,
            [*bad, "[action] Anything else?"],
            [0.0] * (len(bad) + 1),
            script=_stop,
        ),
    ]


def domain_smoke(gym: str) -> list[SmokeEpisode]:
    """tau_retail: gold calls and the required output said; tau_airline: gold calls ending in a transfer."""
    gold = _gold("retail-002" if gym == "tau_retail" else "airline-013")
    if gold is None:
        return []
    record, answers, task = gold
    if gym == "tau_retail":
        actions = [*answers, "[action] Here is what I found: " + " and ".join(task.outputs)]
        return [
            SmokeEpisode(
                "gold calls, required output said", record, actions, [0.0] * len(answers) + [1.0], script=_stop
            )
        ]
    return [SmokeEpisode("gold calls, transfer", record, answers, [0.0] * (len(answers) - 1) + [1.0], script=_stop)]

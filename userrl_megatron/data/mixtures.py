"""UserRL's training and evaluation mixtures (`alltrain`: 2,426 rows, `alltest`: 597 rows; UserRL's data/).

A mixture row names its gym (`env_name`) and task (id or title); the task itself (prompt, record) comes from that
gym's own split, so mixture tasks are exactly the gym's tasks. Rows of gyms that are not registered are skipped
with a warning naming them and their count.
"""

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError
from userrl_megatron.types import Task

log = logging.getLogger(__name__)

MIXTURES = {"alltrain": ("alltrain_multiturn", "train"), "alltest": ("alltest_multiturn", "test")}


def mixture_tasks(name: str, root: Path) -> list[Task]:
    """The tasks of mixture `name`, in the mixture's row order."""
    from gyms.data import userrl_rows

    folder, split = MIXTURES[name]
    return userrl_rows_to_tasks(userrl_rows(root, folder, split), root, source=name)


def userrl_rows_to_tasks(rows: list[dict[str, Any]], root: Path, source: str) -> list[Task]:
    """Resolve UserRL parquet rows to the registered gyms' tasks (see the module docstring)."""
    from gyms.base import gym_spec, list_gyms
    from gyms.data import userrl_row_key

    by_env: dict[str, list[Callable[[str, Path], list[Task]]]] = {}  # each gym's task loader
    for name in list_gyms():
        spec = gym_spec(name)
        if spec.userrl_env and spec.tasks is not None:
            by_env.setdefault(spec.userrl_env, []).append(spec.tasks)
    index: dict[tuple[str, str], dict[str, Task]] = {}
    tasks: list[Task] = []
    skipped: Counter[str] = Counter()
    for row in rows:
        env, task_id = userrl_row_key(row)
        split = str((row.get("extra_info") or {}).get("split", "train"))
        if env not in by_env:
            skipped[env] += 1
            continue
        if (env, split) not in index:
            index[(env, split)] = {t.task_id.lower(): t for load in by_env[env] for t in load(split, root)}
        task = index[(env, split)].get(task_id.lower())
        if task is None:
            raise UserError(f"{source}: {env} task {task_id!r} is not in the {split} split of its gym")
        tasks.append(task)
    if skipped:
        names = ", ".join(f"{env} ({n} rows)" for env, n in sorted(skipped.items()))
        log.warning("%s: skipped rows of gyms that are not registered: %s", source, names)
    return tasks

"""Task rows on disk: one row per task with its gym, task id, prompt messages, tool schemas and metadata.

Parquet keeps `tools` and `metadata` as JSON strings (their shapes differ between gyms); JSON lines keeps them
as objects. `read_rows` reads both, and also UserRL's own parquet rows (resolved through the gym registry).
"""

import json
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError
from userrl_megatron.types import Message, Task

ROW_SUFFIXES = (".parquet", ".jsonl")


def task_to_row(task: Task, split: str) -> dict[str, Any]:
    """The row of one task (JSON-serialisable)."""
    return {
        "gym": task.gym,
        "task_id": task.task_id,
        "split": split,
        "prompt": [{"role": m.role, "content": m.content} for m in task.prompt],
        "tools": task.tools,
        "metadata": task.metadata,
    }


def row_to_task(row: dict[str, Any]) -> Task:
    """The Task of one row written by `write_rows`."""
    tools, metadata = row["tools"], row["metadata"]
    return Task(
        gym=row["gym"],
        task_id=str(row["task_id"]),
        prompt=[Message(role=m["role"], content=m["content"]) for m in row["prompt"]],
        tools=json.loads(tools) if isinstance(tools, str) else tools,
        metadata=json.loads(metadata) if isinstance(metadata, str) else metadata,
    )


def write_rows(path: Path, tasks: list[Task], split: str) -> Path:
    """Write tasks as .parquet or .jsonl (by suffix), atomically."""
    rows = [task_to_row(t, split) for t in tasks]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{**r, "tools": json.dumps(r["tools"]), "metadata": json.dumps(r["metadata"])} for r in rows]
        schema = pa.schema(
            [
                ("gym", pa.string()),
                ("task_id", pa.string()),
                ("split", pa.string()),
                ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                ("tools", pa.string()),
                ("metadata", pa.string()),
            ]
        )
        pq.write_table(pa.Table.from_pylist(flat, schema=schema), tmp)
    else:
        raise UserError(f"row files end in {' or '.join(ROW_SUFFIXES)}, got {path}")
    tmp.replace(path)
    return path


def read_rows(path: Path, data_root: Path) -> list[Task]:
    """Tasks from a row file: ours (`write_rows`) or UserRL's parquet rows (looked up in their gyms' tasks)."""
    if not path.is_file():
        raise UserError(f"row file not found: {path}")
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise UserError(f"row files end in {' or '.join(ROW_SUFFIXES)}, got {path}")
    if rows and "reward_model" in rows[0]:
        from userrl_megatron.data.mixtures import userrl_rows_to_tasks

        return userrl_rows_to_tasks(rows, data_root, source=str(path))
    missing = [k for k in ("gym", "task_id", "prompt", "tools", "metadata") if rows and k not in rows[0]]
    if missing:
        raise UserError(f"{path}: not a task row file (missing columns {', '.join(missing)})")
    return [row_to_task(r) for r in rows]

"""Fault drills fire at their own hook and step only."""

import asyncio
from types import SimpleNamespace

from userrl_megatron.trainer.drills import Drills


class Killable:
    def __init__(self) -> None:
        self.kills = 0

    async def _kill(self) -> int:
        self.kills += 1
        return 4321

    @property
    def kill_server(self) -> SimpleNamespace:
        return SimpleNamespace(remote=self._kill)


def test_each_drill_fires_at_its_hook_and_step() -> None:
    server = Killable()
    pool = SimpleNamespace(engines=[SimpleNamespace(actor=server)])
    drills = Drills(["kill_engine@2", "kill_engine_in_rollout@3", "skip_update@4"], pool)

    async def play() -> list[tuple[int, int, bool]]:
        seen = []
        for step in range(1, 6):
            await drills.during_rollout(step)
            during = server.kills
            await drills.after_rollout(step)
            seen.append((during, server.kills, drills.skips_update(step)))
        return seen

    assert asyncio.run(play()) == [(0, 0, False), (0, 1, False), (2, 2, False), (2, 2, True), (2, 2, False)]
    assert not any(Drills([], pool).skips_update(s) for s in range(1, 6))

"""A process group outside torch's default group, with SGLang's rendezvous semantics.

Trainer rank 0 and every engine rank (>= 1) each call `init_custom_process_group` with the same `init_method`
(`tcp://host:port`, rank 0 hosts the TCP store), `world_size` and `group_name`. The store is wrapped in a prefix
store keyed by `group_name` before the backend group is created, exactly as SGLang's helper does, so a trainer
using this function and a real SGLang server (or the embedded server) find each other. Using
`torch.distributed.init_process_group`/`new_group` on one side instead never meets the other side: torch keys its
default-group store differently and both sides wait until the timeout.
"""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

DEFAULT_TIMEOUT = timedelta(minutes=30)


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the group `group_name`; blocks until all `world_size` ranks have joined."""
    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return custom_process_group_on_store(backend, store, world_size, rank, group_name, timeout)


def custom_process_group_on_store(
    backend: str, store: dist.Store, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """`init_custom_process_group` past its rendezvous: the group `group_name` on the rendezvous `store`."""
    if not group_name:
        raise ValueError("group_name must not be empty")
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    # Ranks inside this group are its global ranks: lets torch.distributed.broadcast(src=0, group=group) work
    # without a default process group.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_custom_process_group(group: dist.ProcessGroup) -> None:
    """Tear down a group made by `init_custom_process_group`."""
    dist.destroy_process_group(group)

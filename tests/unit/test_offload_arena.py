"""Offload's host memory (megatron/offload.py): storages copied end to end into chunks of a power-of-two size, so
that torch's caching host allocator (which rounds each pinned block up to a power of two and keeps it) allocates
exactly what the planner counts: whole chunks."""

import torch

from userrl_megatron.megatron.offload import GRADS, STATE, WEIGHTS, HostArena, Parking, arena_bytes


def _storage(values: list[int], dtype: torch.dtype = torch.int16) -> tuple[torch.Tensor, torch.UntypedStorage]:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor, tensor.untyped_storage()


def test_regions_run_across_chunks_end_to_end() -> None:
    arena = HostArena(pinned=False, chunk_bytes=64)
    first, second = arena.take(100), arena.take(30)
    assert [p.numel() for p in first] == [64, 36] and [p.numel() for p in second] == [28, 2]
    assert arena.used == 130 and arena.nbytes == 192 == arena_bytes(130, 64)
    assert first[1].data_ptr() == arena.chunks[1].data_ptr() and second[1].data_ptr() == arena.chunks[2].data_ptr()
    assert arena_bytes(0, 64) == 0 and arena_bytes(64, 64) == 64 and arena_bytes(65, 64) == 128


def test_offload_frees_the_storages_and_onload_restores_them_bit_exactly() -> None:
    weights, w = _storage(list(range(50)))  # 100 bytes
    moments, m = _storage([7, -3, 2**14], torch.int32)  # 12 bytes
    grads, g = _storage([5] * 40)  # 80 bytes: not copied, zeroed on onload
    parking = Parking(chunk_bytes=64)
    parking.offload({STATE: [m], GRADS: [g]})
    assert (w.nbytes(), m.nbytes(), g.nbytes()) == (100, 0, 0)
    assert parking.arena.used == 12 and parking.arena.nbytes == 64
    parking.offload({WEIGHTS: [w], STATE: [m], GRADS: [g]})  # what is already parked stays as it is
    assert (w.nbytes(), m.nbytes(), g.nbytes()) == (0, 0, 0)
    assert parking.kinds == {WEIGHTS, STATE, GRADS}
    assert parking.arena.used == 112 and parking.arena.nbytes == 128 == arena_bytes(100 + 12, 64)
    parking.onload()
    assert weights.tolist() == list(range(50)) and moments.tolist() == [7, -3, 2**14] and grads.tolist() == [0] * 40
    weights += 1
    parking.offload({WEIGHTS: [w], STATE: [m], GRADS: [g]})  # a second cycle reuses the regions: no new chunk
    parking.onload([WEIGHTS])
    assert parking.kinds == {STATE, GRADS} and parking.arena.nbytes == 128
    assert weights.tolist() == list(range(1, 51))
    parking.onload()
    assert moments.tolist() == [7, -3, 2**14]

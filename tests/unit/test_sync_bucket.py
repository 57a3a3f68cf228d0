"""SGLang's flattened_bucket layout: offsets, raw bytes, alignment rule, round trip; a padded receive layout;
which tensors the sender broadcasts from their own memory."""

import pytest
import torch

from userrl_megatron.convert.assembly import TensorPlan
from userrl_megatron.sync.sender import DIRECT_MIN_BYTES, direct_tensor
from userrl_megatron.wire.bucket import bucket_layout, dtype_from_name, dtype_name, pack_bucket, unpack_bucket


def test_layout_is_back_to_back_in_names_order() -> None:
    layout = bucket_layout(["a", "b", "c"], ["float32", "bfloat16", "bfloat16"], [[2, 3], [4], [1, 1]])
    assert [(e.name, e.start, e.end) for e in layout] == [("a", 0, 24), ("b", 24, 32), ("c", 32, 34)]
    assert layout[1].dtype == torch.bfloat16 and layout[0].shape == (2, 3)


def test_pack_concatenates_raw_bytes_and_unpack_restores_exactly() -> None:
    tensors = [
        ("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("h", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("i", torch.tensor([7], dtype=torch.int64).view(1, 1)),
    ]
    with pytest.raises(ValueError, match=r"^Unaligned received tensor i: byte offset 28, dtype torch.int64$"):
        pack_bucket(tensors)
    tensors = [tensors[2], tensors[0], tensors[1]]  # larger itemsizes first keeps every offset aligned
    flat, layout = pack_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == 8 + 24 + 4
    assert flat[8:12].tolist() == list(torch.tensor([0.0]).numpy().tobytes())  # w[0, 0] right after i
    restored = unpack_bucket(flat, layout)
    for (name, original), (got_name, got) in zip(tensors, restored, strict=True):
        assert got_name == name and got.dtype == original.dtype and torch.equal(got, original)


def test_receiver_layout_matches_sender_from_names_dtypes_shapes() -> None:
    tensors = [("x", torch.randn(3, 5)), ("y", torch.randn(7).half())]
    flat, sent = pack_bucket(tensors)
    received = bucket_layout(["x", "y"], ["float32", "float16"], [[3, 5], [7]])
    assert received == sent
    assert torch.equal(unpack_bucket(flat.clone(), received)[1][1], tensors[1][1])


def test_bad_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^Cannot create empty tensor bucket$"):
        bucket_layout([], [], [])
    with pytest.raises(ValueError, match=r"^Negative dimension in received tensor a: torch.Size\(\[-1\]\)$"):
        bucket_layout(["a"], ["float32"], [[-1]])
    with pytest.raises(ValueError, match=r"^bucket holds 3 bytes but the layout needs 4$"):
        unpack_bucket(torch.zeros(3, dtype=torch.uint8), bucket_layout(["a"], ["float32"], [[1]]))
    with pytest.raises(ValueError, match=r"^unknown dtype .float33.$"):
        dtype_from_name("float33")


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        assert dtype_from_name(dtype_name(dtype)) is dtype


def test_a_padded_layout_starts_each_tensor_at_the_next_multiple() -> None:
    layout = bucket_layout(["a", "b", "c"], ["bfloat16", "int64", "float32"], [[3], [2], [0]], pad_to=64)
    assert [(e.start, e.end) for e in layout] == [(0, 6), (64, 80), (128, 128)]  # no alignment error for b
    with pytest.raises(ValueError, match=r"^Negative dimension in received tensor b: torch.Size\(\[-1\]\)$"):
        bucket_layout(["a", "b"], ["float32", "float32"], [[2], [-1]], pad_to=64)


def test_only_large_contiguous_pieces_the_export_keeps_go_on_the_wire_unpacked() -> None:
    cpu = torch.device("cpu")
    big = torch.randn(512, 1024)  # 2 MiB
    same = direct_tensor(big, cpu)
    assert same is not None and same.data_ptr() == big.data_ptr()
    whole = direct_tensor(TensorPlan((512, 1024), (big.view(-1),)), cpu)
    assert whole is not None and whole.shape == (512, 1024) and whole.data_ptr() == big.data_ptr()
    assert direct_tensor(torch.randn(255, 1024), cpu) is None  # under DIRECT_MIN_BYTES: packed
    assert direct_tensor(big.t(), cpu) is None  # strided
    assert direct_tensor(TensorPlan((512, 1024), (big,), transient=True), cpu) is None  # memory reused next
    assert direct_tensor(TensorPlan((1024, 1024), (big, big)), cpu) is None  # two pieces
    assert direct_tensor(big, torch.device("cuda")) is None  # not on the group's device
    assert DIRECT_MIN_BYTES == 2**20

import torch

from userrl_megatron.sync.sender import iter_buckets


def test_buckets_respect_size_and_dtype() -> None:
    named = [
        ("a", torch.zeros(10)),  # 40 bytes
        ("b", torch.zeros(10)),
        ("c", torch.zeros(30)),  # 120 bytes: larger than the bucket, travels alone
        ("d", torch.zeros(4, dtype=torch.bfloat16)),  # a dtype change starts a bucket
        ("e", torch.zeros(2, dtype=torch.bfloat16)),
        ("f", torch.zeros(1)),
    ]
    buckets = [[name for name, _ in b] for b in iter_buckets(named, bucket_bytes=100)]
    assert buckets == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert list(iter_buckets([], bucket_bytes=100)) == []

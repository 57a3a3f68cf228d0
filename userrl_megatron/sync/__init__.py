"""Trainer -> engine weight sync: the process group both sides join, the flat bucket layout they share, and the
trainer-side sender that streams HF-named tensors to every engine bucket by bucket."""

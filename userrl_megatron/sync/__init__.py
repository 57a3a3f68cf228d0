"""Trainer -> engine weight sync, trainer side: the senders that stream HF-named tensors to every engine bucket by
bucket (broadcast or tensor handles). The wire format both sides read is in `userrl_megatron/wire/`."""

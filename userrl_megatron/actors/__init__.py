"""The Megatron ranks as Ray actors, their one handle's protocol and the run directory's lock: what `userrl train`
(`trainer/`) and `userrl sft` (`sft/`) both stand on."""

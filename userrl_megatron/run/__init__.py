"""A training run's directory and checkpoints, shared by `userrl train` and `userrl sft` (no Megatron import).

run_dir.py      where a run keeps what it writes: checkpoints/, hf/, config.yaml, metrics.jsonl, ...
checkpoint_files.py  checkpoint folders on disk: metadata, manifests, the `latest` pointer, atomic commit, the
                run's history, pruning
checkpoints.py  CheckpointManager: save (through the actor group), commit of background saves, the disk-full
                diagnosis, resume ("auto" or a named checkpoint) past damaged checkpoints, the data check
"""

"""Evaluation (`userrl eval`, docs/eval.md): UserRL's protocol and metrics over any policy, resumable.

metrics.py   the metric arithmetic and confidence intervals (pure functions)
run.py       jobs, cache keys, bounded concurrency, retries of infrastructure failures, progress
cache.py     the per-episode cache (append-only JSONL)
policy.py    the policy protocol, token policies (pool sessions, a running engine), weights fingerprints
api_policy.py  an OpenAI-compatible chat endpoint as the policy
evaluation.py  `evaluate(cfg, out_dir)`: tasks, protocol, policy, outputs
results.py   per-gym aggregation, results.json / episodes.jsonl / report.md
compare.py   `--compare`: runs side by side with intervals of the differences
plots.py     PNG charts (matplotlib)
training.py  the trainer's periodic evaluation in the same format
"""

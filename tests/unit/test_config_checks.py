"""Checks before any process starts: the model against the layout (from its HF config), value ranges, secrets in
`*_env` fields; `config validate` and `userrl train` report them, one `userrl: error:` line each."""

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.support.tiny_models import tiny_config
from userrl_megatron.actors.run_lock import RunLock
from userrl_megatron.cli import main
from userrl_megatron.config import ConfigError, RootConfig, load_config
from userrl_megatron.config.env_names import looks_like_secret
from userrl_megatron.config.model_fit import model_shape
from userrl_megatron.config.ranges import CHECKED_ELSEWHERE, RANGES
from userrl_megatron.model_store import EMBEDDED_MODELS, cache_root
from userrl_megatron.run.checkpoint_files import EXTRA_FILE, FORMAT_VERSION, META_FILE, commit
from userrl_megatron.trainer.preflight import check_before_start, finished_step

REPO = Path(__file__).resolve().parents[2]
TP2 = ["megatron.tensor_model_parallel_size=2", "megatron.devices_per_node=2"]
PP2 = ["megatron.pipeline_model_parallel_size=2", "megatron.devices_per_node=2"]
KEY = "sk-proj-Q3vX9kLm2Rt7Yw1Zp8Nc4Hb6Jd0Fg5Ts"
DEFAULT = ", the default; for another model put its configs/model/*.yaml first or set model.path"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    return e.value.problems


def test_tp2_on_smollm2_names_heads_and_kv_heads() -> None:
    assert problems(TP2) == [
        "megatron.tensor_model_parallel_size = 2 must divide the model's 9 attention heads "
        f"(model.path = smollm2-135m-instruct{DEFAULT})",
        "megatron.tensor_model_parallel_size = 2 must divide the model's 3 key/value heads (num_key_value_heads) "
        f"(model.path = smollm2-135m-instruct{DEFAULT})",
    ]
    load_config(overrides=["megatron.tensor_model_parallel_size=3", "megatron.devices_per_node=3"])  # 9 and 3


def test_interleaving_over_two_stages_is_refused_as_the_actor_refuses_it() -> None:
    found = problems(
        [
            "megatron.pipeline_model_parallel_size=2",
            "megatron.virtual_pipeline_model_parallel_size=2",
            "megatron.devices_per_node=2",
        ]
    )
    assert found[0] == (
        "megatron.virtual_pipeline_model_parallel_size = 2 needs pipeline_model_parallel_size >= 3, got 2 "
        "(interleaving over 2 stages can pair sends and receives wrongly)"
    )
    # 30 layers over 2 x 2 chunks do not split either
    assert found[1].startswith("pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = 2 x 2 must")
    load_config(
        overrides=[
            "megatron.pipeline_model_parallel_size=3",
            "megatron.virtual_pipeline_model_parallel_size=2",
            "megatron.devices_per_node=3",
        ]
    )


def test_recompute_choices_are_checked_against_the_model() -> None:
    # SmolLM2-135M has 30 layers: 15 per stage at PP=2
    assert problems(["megatron.recompute=full", "megatron.recompute_num_layers=16", *PP2]) == [
        "megatron.recompute_num_layers = 16 exceeds the 15 layers of a pipeline stage (per virtual chunk) "
        f"(model.path = smollm2-135m-instruct{DEFAULT})"
    ]
    load_config(overrides=["megatron.recompute=full", "megatron.recompute_num_layers=15", *PP2])
    assert problems(["megatron.recompute=selective", "megatron.recompute_modules=[mlp,attention]"]) == [
        "megatron.recompute_modules: ['attention'] not among ['mlp', 'layernorm', 'core_attn']"
    ]
    assert problems(
        ["run.device=cpu", "megatron.recompute=selective", "megatron.recompute_modules=[mlp,layernorm]"]
    ) == ['megatron.recompute_modules: "layernorm" needs the Transformer Engine layer spec (CUDA)']


def test_model_shape_comes_from_the_directory_config(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    config = tiny_config("qwen2", num_hidden_layers=6, intermediate_size=60).to_dict()  # 4 heads, 2 KV heads
    (model / "config.json").write_text(json.dumps(config))
    assert problems(
        [f"model.path={model}", "megatron.tensor_model_parallel_size=8", "megatron.devices_per_node=8"]
    ) == [
        f"megatron.tensor_model_parallel_size = 8 must divide the model's 4 attention heads (model.path = {model})",
        f"megatron.tensor_model_parallel_size = 8 must divide the model's 2 key/value heads (num_key_value_heads) "
        f"(model.path = {model})",
        f"megatron.tensor_model_parallel_size = 8 must divide the model's intermediate_size 60 (model.path = {model})",
    ]
    assert problems([f"model.path={model}", "megatron.pipeline_model_parallel_size=4", "megatron.devices_per_node=4"])
    load_config(overrides=[f"model.path={model}", *TP2])


def test_published_shapes_check_cluster_paths_that_are_not_here() -> None:
    assert model_shape("/models/Qwen3-32B")["num_attention_heads"] == 64
    assert model_shape("/nowhere/my-model") is None  # unknown: the actor ranks check it at start-up
    found = problems(["model.path=/models/Qwen3-8B", "megatron.tensor_model_parallel_size=16"])
    assert "megatron.tensor_model_parallel_size = 16 must divide the model's 8 key/value heads" in found[-1]
    load_config(overrides=["model.path=/nowhere/my-model", *TP2])
    sglang = ["rollout.backend=sglang", "rollout.engine_tp=2"]
    assert problems(sglang) == [
        f"rollout.engine_tp = 2 must divide the model's 9 attention heads (model.path = smollm2-135m-instruct{DEFAULT})"
    ]
    simulator = ["user_sim.engines.model=smollm2-135m-instruct", "user_sim.engines.engine_tp=2"]
    load_config(overrides=simulator)  # the embedded backend (rollout.backend's default) has no TP to fit
    assert problems([*simulator, "user_sim.engines.backend=sglang"]) == [
        "user_sim.engines.engine_tp = 2 must divide the simulator model's 9 attention heads "
        "(user_sim.engines.model = smollm2-135m-instruct)"
    ]
    load_config(overrides=["user_sim.engines.model=/models/Qwen3-32B", "user_sim.engines.engine_tp=4", *sglang[:1]])


def test_recorded_embedded_shape_matches_the_fetched_model() -> None:
    config_file = cache_root() / "models" / "smollm2-135m-instruct" / "config.json"
    if not config_file.is_file():
        pytest.skip("SmolLM2 not fetched here")
    fetched = json.loads(config_file.read_text())
    for key, value in EMBEDDED_MODELS["smollm2-135m-instruct"].shape.items():
        if key not in ("rms_norm_eps", "rope_theta"):  # float32-rounded / nested in the fetched file
            assert fetched[key] == value, key


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.temperature=-1", "rollout.temperature must be >= 0, got -1.0"),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
        ("rollout.top_k=0", "rollout.top_k must be -1 (disabled) or >= 1, got 0"),
        ("eval.temperature=-0.5", "eval.temperature must be >= 0, got -0.5"),
        ("user_sim.temperature=-1", "user_sim.temperature must be >= 0, got -1.0"),
        ("megatron.adam_beta2=1", "megatron.adam_beta2 must be in [0, 1), got 1.0"),
        ("megatron.lr=0", "megatron.lr must be > 0, got 0.0"),
        ("gyms.turtle.success_threshold=1.5", "gyms.turtle.success_threshold must be in [0, 1], got 1.5"),
        ("run.total_steps=0", "run.total_steps must be >= 1, got 0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1, got 0"),
        ("rollout.max_staleness=0", "rollout.max_staleness must be >= 1, got 0"),
        ("algo.tis_cap=-0.5", "algo.tis_cap must be -1 (auto) or >= 0, got -0.5"),
    ],
)
def test_value_ranges(override: str, message: str) -> None:
    assert problems([override]) == [message]


def test_every_numeric_option_has_a_range() -> None:
    def numeric(schema: type, prefix: str = "") -> list[str]:
        found = []
        for name, hint in typing.get_type_hints(schema).items():
            if f"{prefix}{name}" == "gyms":  # each gym's settings carry their ranges (test_gyms_config.py)
                continue
            if dataclasses.is_dataclass(hint):
                found += numeric(hint, f"{prefix}{name}.")
            elif hint in (int, float):
                found.append(f"{prefix}{name}")
        return found

    assert sorted(set(numeric(RootConfig)) - set(RANGES)) == sorted(CHECKED_ELSEWHERE)


def test_a_pasted_key_is_refused_without_echoing_it() -> None:
    found = problems([f"user_sim.api_key_env={KEY}", "gyms.search.web_api_key_env=my key"])
    assert len(found) == 2 and all(KEY not in p and "my key" not in p for p in found)
    assert found[0].startswith("gyms.search.web_api_key_env must name an environment variable")
    assert found[1].startswith(
        f"user_sim.api_key_env holds what looks like a secret key ({len(KEY)} characters, not shown)"
    )
    for fine in ("none", "OPENAI_API_KEY", "my_server_key", "TOGETHER_API_KEY_2"):
        assert load_config(overrides=[f"user_sim.api_key_env={fine}"]).user_sim.api_key_env == fine
    assert looks_like_secret("ghp_" + "a1" * 18) and looks_like_secret("3f9a1c" * 6)
    assert not looks_like_secret("OPENAI_API_KEY")


def test_validate_prints_one_error_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"megatron:\n  tensor_model_parallel_size: 2\n  devices_per_node: 2\nuser_sim:\n  api_key_env: {KEY}\n"
    )
    assert main(["config", "validate", str(bad)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"userrl: error: {bad}: ") for line in lines)
    assert "9 attention heads" in lines[1] and KEY not in "\n".join(lines)
    qwen = [str(REPO / "configs" / "model" / "qwen3-8b.yaml")]
    assert main(["config", "validate", "--config", *qwen, str(REPO / "configs/layout/qwen3-8b-h100x8.yaml")]) == 0


@pytest.mark.parametrize("layout", sorted((REPO / "configs" / "layout").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_layout_file_alone_plans_the_model_it_was_made_for(layout: Path) -> None:
    model_file = REPO / "configs" / "model" / f"{layout.name.split('-h')[0]}.yaml"
    alone = load_config([layout])
    assert alone == load_config([model_file, layout])
    assert alone.model == load_config([model_file]).model and alone.model.path.startswith("/models/Qwen3-")
    recipe = REPO / "configs" / "quickstart.yaml"  # a file given before the layout keeps its model
    assert load_config([recipe, layout], check=False).model.path == "smollm2-135m-instruct"


def test_bases_sit_beneath_every_given_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.yaml").write_text("model:\n  path: /models/A\n  max_context_length: 4096\n")
    (tmp_path / "layout.yaml").write_text("base: m/model.yaml\nrollout:\n  num_engines: 2\n")
    (tmp_path / "both.yaml").write_text("base: [layout.yaml]\nmodel:\n  max_context_length: 8192\n")
    (tmp_path / "recipe.yaml").write_text("model:\n  path: /models/B\n")
    cfg = load_config([tmp_path / "both.yaml"])
    assert (cfg.model.path, cfg.model.max_context_length, cfg.rollout.num_engines) == ("/models/A", 8192, 2)
    cfg = load_config([tmp_path / "recipe.yaml", tmp_path / "layout.yaml"])
    assert (cfg.model.path, cfg.model.max_context_length, cfg.rollout.num_engines) == ("/models/B", 4096, 2)
    assert load_config([tmp_path / "layout.yaml"], ["model.path=/models/C"]).model.path == "/models/C"


def test_bad_bases_are_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    (tmp_path / "c.yaml").write_text("base: nowhere.yaml\n")
    (tmp_path / "d.yaml").write_text("base: {model: x}\n")
    (tmp_path / "e.yaml").write_text("base: e_base.yaml\n")
    (tmp_path / "e_base.yaml").write_text("model:\n  pth: x\n")
    with pytest.raises(ConfigError) as e:
        load_config([tmp_path / "a.yaml"])
    assert e.value.problems == [
        f"{tmp_path / 'a.yaml'}: the base files form a cycle: "
        f"{(tmp_path / 'a.yaml').resolve()} -> {(tmp_path / 'b.yaml').resolve()} -> {(tmp_path / 'a.yaml').resolve()}"
    ]
    with pytest.raises(ConfigError) as e:
        load_config([tmp_path / "c.yaml"])
    assert e.value.problems == [
        f"{tmp_path / 'c.yaml'}: base file not found: nowhere.yaml (looked for {tmp_path / 'nowhere.yaml'})"
    ]
    with pytest.raises(ConfigError) as e:
        load_config([tmp_path / "d.yaml"])
    assert e.value.problems == [
        f"{tmp_path / 'd.yaml'}: base must be a file path or a list of them (relative to the file), "
        "got {'model': 'x'}"
    ]
    with pytest.raises(ConfigError) as e:
        load_config([tmp_path / "e.yaml"])
    assert e.value.problems == [f"{tmp_path / 'e_base.yaml'}: unknown key 'model.pth' (did you mean 'model.path'?)"]


def test_colocated_pipeline_stages_across_nodes_are_refused() -> None:
    layout = ["megatron.nnodes=2", "megatron.devices_per_node=1", "megatron.pipeline_model_parallel_size=2"]
    found = problems([*layout, "rollout.colocate=true"])
    assert found == [
        "colocated engines map the weight copies of pipeline stages that may sit on another node, which tensor "
        "handles cannot reach: with megatron.nnodes > 1 use pipeline_model_parallel_size = 1 (or "
        "rollout.colocate = false)"
    ]
    load_config(overrides=[*layout, "rollout.colocate=false"])


def test_a_layout_planned_against_the_default_model_names_the_fix(tmp_path: Path) -> None:
    layout = tmp_path / "my-layout.yaml"  # a layout without a base
    layout.write_text("megatron:\n  devices_per_node: 8\n  tensor_model_parallel_size: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config([layout])
    assert e.value.problems[0] == (
        "megatron.tensor_model_parallel_size = 2 must divide the model's 9 attention heads "
        f"(model.path = smollm2-135m-instruct{DEFAULT})"
    )


def test_train_refuses_before_starting_anything(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from userrl_megatron.cli import main\n"
        f"rc = main(['train', '--config', 'configs/quickstart.yaml', 'run.output_dir={tmp_path}', "
        "'megatron.tensor_model_parallel_size=2', 'megatron.devices_per_node=2', 'rollout.temperature=-1'])\n"
        "print('RC', rc, 'RAY', 'ray' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert "RC 2 RAY False" in result.stdout
    errors = result.stderr.splitlines()
    assert errors[0] == "userrl: error: rollout.temperature must be >= 0, got -1.0"
    assert len(errors) == 3 and "9 attention heads" in errors[1]
    assert not (tmp_path / "quickstart").exists()  # nothing written: no run directory, no config.yaml


def write_checkpoint(run_dir: Path, step: int, padded_vocab: int = 49152, tp: int = 1) -> None:
    root = run_dir / "checkpoints"
    tmp = root / f".step_{step}.incomplete"
    tmp.mkdir(parents=True)
    meta = {"format_version": FORMAT_VERSION, "steps": step, "padded_vocab_size": padded_vocab, "layout": {"tp": tp}}
    (tmp / META_FILE).write_text(json.dumps(meta))
    (tmp / EXTRA_FILE).write_text(json.dumps({"step": step}))
    commit(tmp, root / f"step_{step}")


def test_resume_against_another_vocabulary_padding(tmp_path: Path) -> None:
    run = ["run.output_dir=" + str(tmp_path), "run.name=r"]
    write_checkpoint(tmp_path / "r", 2, padded_vocab=49280, tp=5)  # lcm(128, 5) = 640 pads 49152 to 49280
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size = 1 pads the vocabulary to 49152 rows, but"):
        check_before_start(load_config(overrides=run), on_gpu=False)
    check_before_start(load_config(overrides=[*run, "checkpoint.resume=disable"]), on_gpu=False)
    tp3 = ["megatron.tensor_model_parallel_size=3", "megatron.devices_per_node=3", "megatron.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"megatron\.sequence_parallel needs CUDA"):
        check_before_start(
            load_config(overrides=[*run, "checkpoint.resume=disable", *tp3]),
            on_gpu=False,
        )


def test_finished_run_is_recognised(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"run.output_dir={tmp_path}", "run.name=r", "run.total_steps=2"])
    assert finished_step(cfg) is None
    write_checkpoint(tmp_path / "r", 2)
    assert finished_step(cfg) is None  # the HF export of the last step is missing: the driver writes it
    (tmp_path / "r" / "hf" / "step_2").mkdir(parents=True)
    (tmp_path / "r" / "hf" / "step_2" / "config.json").write_text("{}")
    assert finished_step(cfg) is None  # step 2 is not in metrics.jsonl yet: the driver re-logs it
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert finished_step(cfg) == 2
    assert (
        finished_step(load_config(overrides=[f"run.output_dir={tmp_path}", "run.name=r", "run.total_steps=3"])) is None
    )


def test_rerunning_a_finished_run_only_prints_its_table(tmp_path: Path) -> None:
    run_dir = tmp_path / "quickstart"
    write_checkpoint(run_dir, 4)
    (run_dir / "hf" / "step_4").mkdir(parents=True)
    (run_dir / "hf" / "step_4" / "config.json").write_text("{}")
    rows = [{"step": s, "rollout/reward_mean": 0.25 * s, "rollout/episodes": 16.0} for s in range(1, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = (
        "import sys\n"
        "from userrl_megatron.cli import main\n"
        f"rc = main(['train', '--config', 'configs/quickstart.yaml', 'run.output_dir={tmp_path}', "
        "'run.total_steps=4'])\n"
        "print('RC', rc, 'RAY', 'ray' in sys.modules, 'TORCH', 'torch' in sys.modules)\n"
    )
    result = run_python(code)
    assert "RC 0 RAY False TORCH False" in result.stdout, result.stderr
    assert "already finished at step 4 (run.total_steps = 4): nothing to start" in result.stderr
    assert "1.000" in result.stdout and "latest checkpoint:" in result.stdout
    log = (run_dir / "run.log").read_text()
    assert "already finished at step 4" in log and "1.000" in log and "\x1b[" not in log
    with RunLock(run_dir):  # a run still holding the directory (e.g. training it further) is not finished
        busy = run_python(code)
    assert "RC 2" in busy.stdout and f"userrl: error: run directory {run_dir} is in use by pid" in busy.stderr


def test_sync_method_against_the_placement() -> None:
    from userrl_megatron.config.checks import check_config

    assert problems(["sync.method=ipc"]) == ["sync.method = 'ipc'; choose from auto, distributed, tensor"]
    colocated = load_config(overrides=["rollout.colocate=true", "sync.method=distributed"])  # fine on CPU (gloo)
    with pytest.raises(ConfigError) as e:
        check_config(colocated, on_gpu=True)
    assert e.value.problems == [
        "sync.method = distributed cannot sync colocated engines on GPUs (NCCL refuses a group whose ranks share a "
        "GPU); use auto or tensor"
    ]
    assert problems(["sync.method=tensor", "megatron.nnodes=2"]) == [
        "sync.method = tensor hands engines handles to memory on the trainer's node: it needs rollout.colocate = "
        "true or megatron.nnodes = 1"
    ]
    check_config(load_config(overrides=["rollout.colocate=true"]), on_gpu=True)  # auto picks tensor handles


def test_asynchronous_rollout_mode_against_placement_and_sync() -> None:
    from userrl_megatron.config.checks import check_config

    assert problems(["rollout.mode=async"]) == ["rollout.mode = 'async'; choose from sync, one_step_off"]
    check_config(load_config(overrides=["rollout.mode=one_step_off"]))
    assert problems(["rollout.mode=one_step_off", "rollout.colocate=true"]) == [
        "rollout.mode = one_step_off runs the engines while the actor trains: it needs rollout.colocate = false "
        "(colocated engines release their devices to the actor)"
    ]
    assert problems(["rollout.mode=one_step_off", "sync.enabled=false"]) == [
        "rollout.mode = one_step_off with sync.enabled = false: the engines never get new weights, so every turn's "
        "staleness grows past rollout.max_staleness; use rollout.mode = sync for the negative control"
    ]
    check_config(load_config(overrides=["rollout.colocate=true", "sync.enabled=false"]))  # sync mode: both allowed


SHARED_SIM = ["user_sim.engines.model=/models/Qwen3-32B", "user_sim.engines.placement=policy_engines"]


def test_simulator_engines_share_the_policy_engines_gpus_only_engine_for_engine() -> None:
    """Simulator engine e sits on policy engine e's GPUs: the same TP and no more engines than the policy has."""
    policy = ["rollout.num_engines=2", "rollout.engine_tp=2", "rollout.backend=embedded"]
    ok = load_config(overrides=[*policy, *SHARED_SIM, "user_sim.engines.num_engines=2", "user_sim.engines.engine_tp=2"])
    assert ok.user_sim.engines.shares_policy_engines
    rule = (
        "user_sim.engines.placement = policy_engines puts simulator engine e on policy engine e's GPUs: it needs "
        "user_sim.engines.engine_tp = rollout.engine_tp ({} vs 2) and user_sim.engines.num_engines <= "
        "rollout.num_engines ({} vs 2)"
    )
    assert problems([*policy, *SHARED_SIM, "user_sim.engines.engine_tp=1"]) == [rule.format(1, 1)]
    assert problems([*policy, *SHARED_SIM, "user_sim.engines.engine_tp=2", "user_sim.engines.num_engines=3"]) == [
        rule.format(2, 3)
    ]
    # GPUs of their own (the default) take any shape; without a model nothing is served, so nothing is shared
    own = load_config(overrides=[*policy, "user_sim.engines.model=m", "user_sim.engines.engine_tp=4"]).user_sim.engines
    assert own.placement == "own" and not own.shares_policy_engines
    unserved = load_config(overrides=["user_sim.engines.placement=policy_engines"]).user_sim.engines
    assert not unserved.shares_policy_engines
    assert problems(["user_sim.engines.placement=shared"])[0].startswith("user_sim.engines.placement = 'shared'")


def test_shared_sglang_engines_split_each_gpu() -> None:
    """Both sides' SGLang fractions on one GPU: more than the whole of it is refused; 0 takes the policy's."""
    base = ["rollout.backend=sglang", "rollout.num_engines=2", *SHARED_SIM, "user_sim.engines.num_engines=2"]
    too_much = (
        "user_sim.engines.placement = policy_engines: the simulator's and the policy's SGLang engines share each GPU, "
        "and user_sim.engines.mem_fraction_static ({}) + rollout.sglang.mem_fraction_static (0.6) is more than the "
        "whole GPU"
    )
    fraction = "rollout.sglang.mem_fraction_static=0.6"
    assert problems([*base, fraction, "user_sim.engines.mem_fraction_static=0.5"]) == [too_much.format("0.5")]
    assert problems([*base, fraction]) == [too_much.format("0.6")]  # 0: the policy's own, twice
    assert load_config(overrides=[*base, fraction, "user_sim.engines.mem_fraction_static=0.4"])
    embedded_sim = [*base, fraction, "user_sim.engines.mem_fraction_static=0.5", "user_sim.engines.backend=embedded"]
    assert load_config(overrides=embedded_sim)  # an embedded engine sizes its cache in tokens, not in a fraction


LAYOUT_8B = str(REPO / "configs" / "layout" / "qwen3-8b-h100x8.yaml")
LAYOUT_30B = str(REPO / "configs" / "layout" / "qwen3-30b-a3b-h100x8.yaml")


def layout_problems(layout: str, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config([layout], overrides)
    return e.value.problems


def test_tensor_handles_only_to_gpus_the_engine_sees() -> None:
    """An SGLang engine opens a CUDA IPC handle only on a GPU its process sees: the handle names its GPU by UUID and
    SGLang 0.5.23 looks that UUID up among its visible devices (`_device_from_maybe_uuid`,
    sglang/srt/utils/patch_torch.py:89-97, "Invalid device_uuid"). Engines on GPUs of their own never see an actor
    rank's GPU; colocated engines beyond the actor's GPUs, or beside another pipeline stage, map a rank's copy on
    another GPU. Refused naming `sync.method` for GPU engines, whatever `auto` would pick; on CPU (shared memory)
    handles reach every process on the node."""
    from userrl_megatron.config.checks import check_config

    [disaggregated] = layout_problems(LAYOUT_8B, ["rollout.colocate=false", "sync.method=tensor"])
    assert disaggregated.startswith("sync.method = tensor hands engine 0 a CUDA IPC handle to actor rank 0's memory")
    assert "on GPU 0 of node 0" in disaggregated and "sees only GPU 0 of node 1" in disaggregated
    assert "sync.method = distributed" in disaggregated
    load_config([LAYOUT_8B], ["rollout.colocate=false"])  # auto picks the broadcast there
    # 16 engine GPUs colocated with 8 actor ranks: engines 4-7 sit on the second node's GPUs, with no actor rank
    [beyond] = layout_problems(LAYOUT_30B, ["rollout.num_engines=8"])
    assert beyond.startswith("sync.method = auto (tensor handles for colocated engines) hands engine 4 a CUDA IPC")
    assert "sees only GPUs 0,1 of node 1" in beyond and "rollout.num_engines x rollout.engine_tp" in beyond
    # pipeline stage 0 (ranks 0-3) hands TP1 engine 4, on GPU 4, the copy of its source rank 0 on GPU 0
    [stages] = layout_problems(LAYOUT_8B, ["megatron.pipeline_model_parallel_size=2"])
    assert "hands engine 4 a CUDA IPC handle to actor rank 0's memory on GPU 0 of node 0" in stages
    # the same configs on CPU: shared-memory handles reach every engine process on the node
    cpu = ["rollout.colocate=false", "sync.method=tensor", "rollout.sglang.device=cpu"]
    check_config(load_config([LAYOUT_8B], cpu, check=False), on_gpu=None)
    sglang = ["rollout.backend=sglang", "sync.method=tensor"]  # one actor rank, one engine on a device of its own
    check_config(load_config(overrides=sglang, check=False), on_gpu=False)
    assert problems(sglang)[0].startswith("sync.method = tensor hands engine 0")  # not known to be CPU: refused
    embedded = ["rollout.colocate=true", "rollout.num_engines=2", "rollout.backend=embedded", "megatron.offload=true"]
    check_config(load_config(overrides=embedded), on_gpu=False)  # two engines beside one CPU rank
    with pytest.raises(ConfigError) as e:  # the same on GPUs: engine 1 on a GPU with no actor rank
        check_config(load_config(overrides=embedded), on_gpu=True)
    assert (
        [p for p in e.value.problems if p.startswith("sync.method")]
        == [p for p in e.value.problems if "engine 1 a CUDA IPC handle to actor rank 0's memory" in p]
        != []
    )


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "configs" / "layout").glob("*.yaml")) + sorted((REPO / "examples").glob("*/config*.yaml")),
    ids=lambda p: p.stem if p.parent.name == "layout" else f"{p.parent.name}/{p.stem}",
)
def test_every_shipped_layout_hands_engines_only_gpus_they_see(path: Path) -> None:
    from userrl_megatron.config.checks import check_config

    check_config(load_config([str(path)]), on_gpu=True)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["rollout.colocate=false", "sync.method=tensor"],
        ["rollout.num_engines=8"],
        ["megatron.pipeline_model_parallel_size=2"],
        ["rollout.num_engines=2", "rollout.engine_tp=4", "megatron.pipeline_model_parallel_size=2"],
        ["megatron.nnodes=2", "rollout.num_engines=4", "rollout.engine_tp=4", "megatron.tensor_model_parallel_size=4"],
    ],
)
def test_the_check_reads_handles_as_the_sender_hands_them(overrides: list[str]) -> None:
    """The config check's holders (config must not import `sync`, which imports it) are the sender's own:
    `sync.roles.payload_holders` over each pipeline stage's ranks, with the endpoints `WeightSync` makes."""
    from userrl_megatron.config.checks import _unseen_handle
    from userrl_megatron.sync.roles import EngineEndpoint, payload_holders

    cfg = load_config([LAYOUT_30B], overrides, check=False)
    m, r = cfg.megatron, cfg.rollout
    world, per_node, pp = m.nnodes * m.devices_per_node, m.devices_per_node, m.pipeline_model_parallel_size
    start = 0 if r.colocate else world
    engines = [EngineEndpoint("", r.engine_tp, start + e * r.engine_tp) for e in range(r.num_engines)]
    unseen = None
    for stage in range(pp):
        ranks = list(range(stage * world // pp, (stage + 1) * world // pp))
        for e, holders in enumerate(payload_holders(engines, ranks)):
            for j, holder in enumerate(holders):
                device = start + e * r.engine_tp + j
                seen = [d for d in range(device - j, device - j + r.engine_tp) if d // per_node == device // per_node]
                if holder not in seen and unseen is None:
                    unseen = (e, holder, seen)
    assert _unseen_handle(cfg) == unseen

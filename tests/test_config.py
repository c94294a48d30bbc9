import pytest
import yaml

from core.config import Config, MeshConfig, resolve_mesh_shape
from core.config_loader import ConfigError, list_presets, load_config, save_config
from posttrain.config import PostTrainConfig


def post(*overrides, **kw):
    """A post-training config (the core sections and the methods')."""
    return load_config(overrides=list(overrides), schema=PostTrainConfig, **kw)


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.mesh.fsdp == -1


def test_unknown_key_names_dotted_path_and_suggestion(tmp_path):
    p = write(tmp_path, "c.yml", {"model": {"hiden_size": 32}})
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "model.hiden_size" in msg and "hidden_size" in msg and str(p) in msg


def test_unknown_section_lists_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer'.*optim"):
        load_config(write(tmp_path, "c.yml", {"optimizer": {"name": "adamw"}}))


def test_bad_type_reports_key_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "c.yml", {"train": {"steps": "many"}}))
    assert "train.steps" in str(e.value) and "'many'" in str(e.value)


def test_bad_literal(tmp_path):
    with pytest.raises(ConfigError, match="optim.name"):
        load_config(overrides=["optim.name=adamx"])


def test_mesh_product_mismatch():
    with pytest.raises(ConfigError, match=r"multiply to 6 but 8 devices"):
        load_config(overrides=["mesh.fsdp=3", "mesh.tensor=2"], num_devices=8)
    with pytest.raises(ConfigError, match=r"does not divide the 8 available"):
        load_config(overrides=["mesh.tensor=3"], num_devices=8)
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        load_config(overrides=["mesh.data=-1"])
    assert resolve_mesh_shape(MeshConfig(fsdp=-1, tensor=2), 8)["fsdp"] == 4


def test_fraction_sums_checked():
    with pytest.raises(ConfigError, match=r"warmup_steps_fraction \(0.6\).*wsd_decay_steps_fraction \(0.5\)"):
        load_config(
            overrides=["optim.schedule=wsd", "optim.warmup_steps_fraction=0.6", "optim.wsd_decay_steps_fraction=0.5"]
        )
    with pytest.raises(ConfigError, match="trainer_devices_fraction"):
        load_config(overrides=["mesh.trainer_devices_fraction=0.7", "mesh.sampler_devices_fraction=0.5"])


def test_overrides_parse_types():
    cfg = post(
        "rl.batch.num_generations=8",
        "optim.learning_rate=1e-5",
        "model.scan_layers=false",
        "reward.functions=[{fn: gsm8k, weight: 0.5}]",
        "model.rope_scaling=null",
    )
    assert cfg.rl.batch.num_generations == 8
    assert cfg.optim.learning_rate == pytest.approx(1e-5)
    assert cfg.model.scan_layers is False
    assert cfg.reward.functions[0].fn == "gsm8k" and cfg.reward.functions[0].weight == 0.5


def test_override_unknown_key_fails():
    with pytest.raises(ConfigError, match=r"rl.batch.num_generation'.*did you mean rl.batch.num_generations"):
        post("rl.batch.num_generation=8")
    # a key of the flat RL section of old points to where it lives now
    with pytest.raises(ConfigError, match=r"unknown key 'rl.num_generations': did you mean rl.batch.num_generations"):
        post("rl.num_generations=8")
    with pytest.raises(ConfigError, match="not of the form"):
        post("rl.batch.num_generations")


@pytest.mark.parametrize(
    "key,suggested",
    [
        ("run_dir", "run.run_dir"),  # a top-level key that lives in a section
        ("run.dir", "run.run_dir"),  # the section's name, then the field's other half
        ("model.hiden_size", "model.hidden_size"),  # a near spelling
        ("rl.batch.num_generation", "rl.batch.num_generations"),
        ("rl.epsilon", "rl.loss.epsilon"),  # a field of a sub-section
        ("tokenizer_dir", "data.tokenizer_dir"),
        ("sft.eval_generation", "sft.eval_generations"),
    ],
)
def test_a_misspelt_key_suggests_the_full_dotted_key_that_exists(key, suggested):
    with pytest.raises(ConfigError) as err:
        post(f"{key}=1")
    message = str(err.value)
    assert f"unknown key '{key}': did you mean" in message and suggested in message.split("did you mean")[1], message


def test_base_config_inheritance_and_precedence(tmp_path):
    write(tmp_path, "parent.yml", {"base_config": "base.yml", "train": {"steps": 5, "batch_size": 4}})
    child = write(tmp_path, "child.yml", {"base_config": "parent.yml", "train": {"steps": 7}})
    cfg = load_config(child, overrides=["train.batch_size=2"])
    assert cfg.train.steps == 7  # child over parent
    assert cfg.train.batch_size == 2  # CLI over files
    assert cfg.optim.warmup_steps_fraction == 0.05  # from core/configs/base.yml


def test_base_config_cycle(tmp_path):
    write(tmp_path, "a.yml", {"base_config": "b.yml"})
    write(tmp_path, "b.yml", {"base_config": "a.yml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yml")


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no/such/file.yml")


def test_presets_and_explicit_keys_win():
    assert {"llama3.1-8b", "qwen2.5-0.5b", "qwen3-8b", "mistral-7b", "tiny-llama"} <= set(list_presets())
    cfg = load_config(overrides=["model.preset=qwen2.5-0.5b", "model.num_layers=2"])
    assert cfg.model.hidden_size == 896 and cfg.model.num_layers == 2 and cfg.model.attention_bias
    with pytest.raises(ConfigError, match="unknown model preset"):
        load_config(overrides=["model.preset=gpt5"])


def test_model_from_hf_config_json(tiny_hf_dir):
    cfg = load_config(overrides=[f"model.hf_config={tiny_hf_dir('qwen3')}"])
    assert cfg.model.family == "qwen3" and cfg.model.head_dim == 32 and cfg.model.qk_norm


def test_gqa_check():
    with pytest.raises(ConfigError, match=r"num_heads \(6\).*num_kv_heads \(4\)"):
        load_config(overrides=["model.num_heads=6", "model.num_kv_heads=4"])


def test_scan_unroll_is_a_bool_or_a_layer_count():
    assert load_config(overrides=["model.scan_unroll=2"]).model.scan_unroll == 2
    assert load_config(overrides=["model.scan_unroll=false"]).model.scan_unroll is False
    with pytest.raises(ConfigError, match=r"model.scan_unroll must be .* \(got 0\)"):
        load_config(overrides=["model.scan_unroll=0"])


def test_resolved_config_written_and_reloads(tmp_path):
    cfg = load_config(overrides=["model.preset=tiny-qwen2", "train.steps=3"])
    out = save_config(cfg, tmp_path / "run")
    again = load_config(out)
    assert again == cfg


def test_config_is_immutable():
    cfg = load_config()
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.steps = 3


def test_gspo_defaults_to_its_papers_clip_range_and_aggregation():
    gspo = post("rl.algorithm=gspo").rl.loss
    assert (gspo.epsilon, gspo.epsilon_high, gspo.loss_agg) == (3e-4, 4e-4, "sequence-mean-token-mean")
    grpo = post().rl.loss
    assert (grpo.epsilon, grpo.epsilon_high, grpo.loss_agg) == (0.2, 0.2, "token-mean")
    # what the user names wins, and epsilon_high follows an explicit epsilon
    mine = post("rl.algorithm=gspo", "rl.loss.epsilon=1e-3", "rl.loss.loss_agg=token-mean").rl.loss
    assert (mine.epsilon, mine.epsilon_high, mine.loss_agg) == (1e-3, 1e-3, "token-mean")
    assert post("rl.algorithm=gspo", "rl.loss.epsilon_high=5e-4").rl.loss.epsilon == 3e-4
    assert post("rl.loss.epsilon=0.1").rl.loss.epsilon_high == 0.1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["rl.loss.epsilon=0.2", "rl.loss.epsilon_high=0.1"],
            r"rl.loss.epsilon_high \(0.1\) must be >= rl.loss.epsilon \(0.2\)",
        ),
        (["rollout.top_k=0"], r"rollout.top_k must be -1 \(off\) or >= 1, got 0"),
        (["rollout.top_k=-2"], r"rollout.top_k must be -1 \(off\) or >= 1, got -2"),
        (["model.lora.target_modules=[q_proj,wq]"], r"each must be one of .*; unknown: wq"),
        (["model.lora.target_modules=[q_proj,q_proj]"], r"names a module twice"),
        (["model.lora.quant_block_size=33"], r"quant_block_size=33 must be even"),
    ],
)
def test_section_checks_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        post(*overrides)


def test_lora_targets_are_kept_in_the_models_order():
    """The same set of targets in any order is one config (a checkpoint's and a run's compare equal)."""
    assert post("model.lora.target_modules=[v_proj,q_proj]").model.lora.target_modules == ("q_proj", "v_proj")


RL_CHECKS = [
    (
        ["rollout.max_tokens=64", "rollout.max_model_len=64"],
        r"rollout.max_tokens \(64\) must be < rollout.max_model_len \(64\)",
    ),
    (
        [
            "rl.batch.prompts_per_step=3",
            "rl.batch.num_generations=2",
            "rl.batch.mini_batches=2",
            "train.micro_batches=2",
        ],
        r"rl.batch.prompts_per_step \* rl.batch.num_generations \(3 \* 2 = 6\) must be divisible by "
        r"rl.batch.mini_batches \* train.micro_batches \(2 \* 2 = 4\)",
    ),
    (["rl.off_policy_steps=1", "rollout.sampler=jax"], r"rl.off_policy_steps=1 \(async\) needs rollout.sampler=vllm"),
    (
        ["rl.batch.pack_length=64", "rollout.max_model_len=128", "rollout.max_tokens=16"],
        r"rl.batch.pack_length \(64\) < rollout.max_model_len \(128\)",
    ),
    (["rl.batch.num_generations=1"], r"needs rl.batch.num_generations >= 2, not 1"),
]


@pytest.mark.parametrize("overrides,message", RL_CHECKS)
def test_grpos_cross_field_checks_are_grpos(overrides, message):
    """GRPO's checks of several sections at once run when a GRPO run is built (before a Ray cluster or an engine
    starts: they used to surface mid-run), and only then: an SFT or pretraining job with the same values loads."""
    from posttrain import grpo
    from posttrain.onpolicy import checks

    base = ["data.source=reasoning_gym:basic_arithmetic", "reward.functions=[{fn: math_verify}]"]
    cfg = post(*base, *overrides)  # loads: these are not section checks
    with pytest.raises(ConfigError, match=message):
        checks.check_config(cfg)
        grpo.check_config(cfg)


def test_an_sft_job_never_fails_on_rls_checks():
    """The batch SFT accumulates in 3 micro-batches is fine for SFT, whatever RL would make of it."""
    from posttrain.sft import check_config

    cfg = post("train.batch_size=6", "train.micro_batches=3", "data.format=chat", "data.source=reasoning_gym:x")
    check_config(cfg)
    assert load_config(overrides=["train.batch_size=6", "train.micro_batches=3"]).train.micro_batches == 3


def test_one_completion_per_prompt_is_allowed_where_a_method_allows_it():
    assert post("rl.batch.num_generations=1").rl.batch.num_generations == 1


def test_saved_config_holds_no_code_and_loading_it_imports_none(tmp_path):
    """A config read back from a run directory is validated without importing its reward plugins."""
    plugin = tmp_path / "plugin.py"
    marker = tmp_path / "imported"
    plugin.write_text(
        f"open({str(marker)!r}, 'w').close()\ndef fn(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    cfg = post(f"reward.functions=[{{fn: {plugin}:fn}}]")
    assert marker.exists()  # loading a user's config does resolve the plugin (a typo fails at load)
    marker.unlink()
    PostTrainConfig.model_validate(cfg.model_dump(mode="json"))  # what a checkpoint restore does
    plugin.unlink()  # even a plugin that is gone
    PostTrainConfig.model_validate(cfg.model_dump(mode="json"))
    assert not marker.exists()


@pytest.mark.parametrize(
    "distill, message",
    [
        ({"feature_layers": [[1, 1]], "feature_weight": 1.0}, "only the online regime has"),
        ({"regime": "online", "feature_layers": [[1, 1]]}, "set distill.feature_weight"),
        ({"regime": "online", "feature_weight": 0.5}, "set distill.feature_layers"),
        ({"regime": "online", "teacher_placement": "actor"}, r"distill.top_k > 0 \(not 0"),
        ({"teacher_placement": "actor", "top_k": 8}, r"distill.regime=online \(not offline\)"),
        (
            {
                "regime": "online",
                "teacher_placement": "actor",
                "top_k": 8,
                "feature_layers": [[1, 1]],
                "feature_weight": 1.0,
            },
            "needs distill.teacher_placement=beside",
        ),
        ({"regime": "online", "feature_weight_schedule": "linear"}, "distill.feature_weight_end: set it"),
    ],
)
def test_distillation_settings_that_cannot_go_together_are_refused_at_load(distill, message):
    with pytest.raises(ValueError, match=message):
        PostTrainConfig.model_validate({"distill": distill})


def test_a_teacher_actors_tail_bucket_needs_its_temperature():
    """The actor answers at T = 1: the tail bucket reads those values as they are, so T must be 1, constant."""
    from posttrain.distill.method import check_config

    d = dict(regime="online", teacher="t", teacher_placement="actor", top_k=8, top_k_mode="tail", temperature=2.0)
    cfg = PostTrainConfig.model_validate({"data": {"source": "rows.jsonl", "format": "chat"}, "distill": d})
    with pytest.raises(ConfigError, match=r"reads the teacher actor's log-probs as they are: they were taken at T=1.0"):
        check_config(cfg)
    check_config(cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"temperature": 1.0})}))

"""Config: presets, dotted overrides, every error at once with its path, saved resolved config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from agentrl.config import (
    AgentRLConfig,
    list_presets,
    load_config,
    parse_overrides,
    save_config,
    validate_config,
)
from agentrl.errors import ConfigError


def _all_models(model: type[BaseModel] = AgentRLConfig) -> list[type[BaseModel]]:
    out = [model]
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _all_models(field.annotation)
    return out


def test_every_field_has_a_docstring_and_every_model_forbids_extra_keys() -> None:
    for model in _all_models():
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_overrides_parse_as_yaml_values_with_shorthands() -> None:
    got = parse_overrides(["trainer.lr=1e-6", "rollout.max_turns=4", "env=retool", "resume=true",
                           "data.train_files=[a.parquet, b.jsonl]", "model.chat_template=null"])
    assert got == {
        "trainer": {"lr": 1e-6},
        "rollout": {"max_turns": 4},
        "env": {"name": "retool"},
        "run": {"resume": True},
        "data": {"train_files": ["a.parquet", "b.jsonl"]},
        "model": {"chat_template": None},
    }


def test_malformed_override_is_reported() -> None:
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        parse_overrides(["trainer.lr"])


def test_misspelt_key_fails_with_its_path_and_closest_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.lrr=1e-6"])
    assert info.value.errors == ["trainer.lrr: unknown key. Did you mean 'trainer.lr'?"]


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.max_turns=0", "trainr.lr=1", "model.dtype=fp8", "env=aritmetic"])
    errs = info.value.errors
    assert len(errs) == 4
    assert any(e.startswith("rollout.max_turns: Input should be greater than or equal to 1") for e in errs)
    assert "trainr: unknown key. Did you mean 'trainer'?" in errs
    assert any(e.startswith("model.dtype:") and "'fp8'" in e for e in errs)
    assert any("unknown env 'aritmetic'. Did you mean 'arithmetic'?" in e for e in errs)


def test_env_override_selects_its_preset_and_overrides_win() -> None:
    assert "arithmetic" in list_presets()
    cfg = load_config(None, ["env=arithmetic", "rollout.max_turns=2"])
    preset = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath("configs/arithmetic.yaml").read_text())
    assert cfg.rollout.max_tokens_per_turn == preset["rollout"]["max_tokens_per_turn"] != 256
    assert cfg.rollout.max_turns == 2


def test_every_preset_validates() -> None:
    for name in list_presets():
        cfg = load_config(name)
        assert isinstance(cfg, AgentRLConfig)


def test_unknown_preset_and_missing_file_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No preset 'arithmetc'. Did you mean 'arithmetic'"):
        load_config("arithmetc")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_is_saved_and_reloads_identically(tmp_path: Path) -> None:
    cfg = load_config(None, ["env=arithmetic", "trainer.lr=3e-6"])
    path = save_config(cfg, tmp_path / "run1")
    assert path == tmp_path / "run1" / "config.yaml"
    assert path.read_text().startswith("# Resolved config of this run")
    assert load_config(path) == cfg
    assert validate_config(yaml.safe_load(path.read_text())).trainer.lr == 3e-6


def test_config_fields_names_every_leaf_of_nested_optional_and_listed_sections() -> None:
    from agentrl.config import REQUIRED, JudgeConfig, RewardModelConfig, RewardPartConfig, config_fields

    rows = {name: (type_name, default) for name, type_name, default, _ in config_fields()}
    for prefix, section in (("reward.judge.", JudgeConfig), ("reward.model.", RewardModelConfig),
                            ("reward.combine[].", RewardPartConfig)):
        for field in section.model_fields:
            assert f"{prefix}{field}" in rows, f"{prefix}{field} is missing from config_fields()"
    assert "reward.judge" not in rows and "reward.combine" not in rows  # sections, not leaves
    assert rows["reward.judge.startup_timeout_s"] == ("float", 900.0)
    assert rows["reward.model.path"][1] is REQUIRED and repr(REQUIRED) == "required"
    assert rows["reward.combine[].weight"] == ("float", 1.0)
    assert rows["cluster.trainer.cpus"][0] == "float"

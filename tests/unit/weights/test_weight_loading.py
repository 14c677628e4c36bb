"""Applying pushed weights to a module: a tiny Qwen2 ends up with the trainer's exact logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from agentrl.errors import WeightSyncError
from agentrl.weights import FilesCheckpointEngine, load_into_module, make_checkpoint_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_dir(assets: Path) -> Path:
    path = assets / "tiny-random-qwen2"
    if not (path / "config.json").is_file():
        pytest.skip(f"tiny Qwen2 not found at {path}")
    return path


def _load(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


def _perturbed(path: Path) -> torch.nn.Module:
    model = _load(path)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 20, 300, 4000, 50000, 7]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("backend", ["inprocess", "files"])
def test_push_makes_a_perturbed_copy_identical(backend: str, qwen_dir: Path, tmp_path: Path) -> None:
    trainer, server = _load(qwen_dir), _perturbed(qwen_dir)
    assert not torch.equal(_logits(trainer), _logits(server))
    reports = []
    # 4 MiB buckets: the 39 MB embedding (tied with lm_head) travels as an oversized bucket.
    if backend == "inprocess":
        engine = make_checkpoint_engine(
            "inprocess", bucket_bytes=4 << 20,
            consumer=lambda stream: reports.append(load_into_module(server, stream)))
        engine.send(trainer.named_parameters(), version=1)
    else:
        engine = make_checkpoint_engine("files", directory=tmp_path, bucket_bytes=4 << 20)
        engine.send(trainer.state_dict().items(), version=1)
        reports.append(load_into_module(server, engine.receive()))
    assert torch.equal(_logits(trainer), _logits(server))
    (report,) = reports
    assert report.missing == [] and report.unexpected == []
    assert "model.embed_tokens.weight" in report.loaded


def test_files_push_is_loadable_by_from_pretrained(qwen_dir: Path, tmp_path: Path) -> None:
    trainer = _perturbed(qwen_dir)
    engine = FilesCheckpointEngine(directory=tmp_path / "ckpt", bucket_bytes=4 << 20)
    engine.send(trainer.state_dict().items(), version=5)
    path = engine.path_for(5)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    shutil.copy(qwen_dir / "config.json", path / "config.json")
    assert torch.equal(_logits(trainer), _logits(_load(path)))


def test_clear_errors_for_wrong_names_shapes_and_dtypes() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    good = {k: v.detach().clone() for k, v in module.state_dict().items()}
    stream = [("0.weight", torch.zeros(2, 3)), ("0.bias", torch.zeros(3)), ("1.weight", good["1.weight"].double()),
              ("extra.weight", torch.zeros(1))]
    with pytest.raises(WeightSyncError) as info:
        load_into_module(module, stream)
    message = str(info.value)
    assert "'0.bias': shape (3,) received, module has (2,)" in message
    assert "'1.weight': dtype torch.float64 received, module has torch.float32" in message
    assert "unexpected names (no such parameter or buffer): extra.weight" in message
    assert "missing names (never received): 0.bias, 1.weight, 1.bias" in message
    assert torch.equal(module[0].weight, torch.zeros(2, 3))  # the good tensor was still copied in place


def test_name_map_cast_and_non_strict() -> None:
    module = torch.nn.Linear(2, 2)
    weight, bias = torch.ones(2, 2, dtype=torch.bfloat16), torch.full((2,), 3.0)
    report = load_into_module(
        module, [("policy.weight", weight), ("policy.bias", bias), ("policy.value_head", torch.zeros(1))],
        name_map=lambda n: None if n.endswith("value_head") else n.removeprefix("policy."), allow_cast=True)
    assert report.loaded == ["weight", "bias"] and report.missing == [] and report.unexpected == []
    assert torch.equal(module.weight, torch.ones(2, 2)) and torch.equal(module.bias, bias)
    report = load_into_module(module, [("bias", bias), ("nope", bias)], strict=False)
    assert report.missing == ["weight"] and report.unexpected == ["nope"]

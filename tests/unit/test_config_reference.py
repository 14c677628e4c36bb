"""docs/configuration.md is what scripts/config_reference.py writes from the config models now."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from agentrl.config import config_fields

REPO = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_configuration_reference_is_up_to_date() -> None:
    generator = _generator()
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == generator.render(), (
        f"docs/configuration.md differs from what the config models' docstrings give now; "
        f"regenerate it with: {generator.REGENERATE}"
    )


def test_every_config_key_is_a_row_with_its_type_default_and_description() -> None:
    page = _generator().render()
    rows = {line.split(" | ")[0].removeprefix("| `").removesuffix("`"): line
            for line in page.splitlines() if line.startswith("| `")}
    assert set(rows) == {dotted for dotted, _, _, _ in config_fields()}
    assert rows["trainer.lr"] == "| `trainer.lr` | `float` | `1e-06` | Learning rate of the policy (AdamW). |"
    # a type with a pipe stays in its cell
    assert rows["model.tokenizer"].startswith("| `model.tokenizer` | `str \\| None` | `None` | ")
    assert "## trainer\n\nOptimisation and the training backend.\n" in page


def test_the_generator_writes_the_page_and_checks_it(tmp_path: Path, capsys) -> None:
    generator = _generator()
    page = tmp_path / "configuration.md"
    assert generator.main(["--check"], page=page) == 1
    assert "regenerate it with: python scripts/config_reference.py" in capsys.readouterr().err
    assert generator.main([], page=page) == 0
    assert page.read_text() == generator.render()
    assert generator.main(["--check"], page=page) == 0

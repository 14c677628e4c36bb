"""A scripted policy behind a real HTTP server, for `agentrl eval` tests: agentrl's token API
(`GET /health`, `POST /generate`, what `inference.urls` connects to) and an OpenAI-compatible
`/v1/completions`.

`ScriptedPolicyServer(tokenizer, plays)` serves on a free loopback port; `plays` maps a piece of
text (an issue's first line) to the assistant turns to play when the prompt holds it. The turn is
found from the prompt itself (the number of assistant turns already in it), so the server keeps no
state, and each reply is the turn's tool call in the hermes format, with its token ids and
logprobs, as vLLM's server answers with `return_token_ids`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

__all__ = ["ScriptedPolicyServer"]


class ScriptedPolicyServer:
    def __init__(self, tokenizer: Any, plays: dict[str, list[Any]]) -> None:
        import uvicorn
        from fastapi import FastAPI

        self.tok = tokenizer
        self.plays = plays
        self.requests = 0
        app = FastAPI()

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "scripted"}]}

        @app.get("/health")
        def health() -> dict[str, Any]:
            return {"status": "ok", "weight_version": 0, "model": "scripted", "engine": "scripted", "load": 0}

        @app.post("/generate")
        def generate(body: dict[str, Any]) -> dict[str, Any]:
            ids = self.reply(body["prompt_ids"])
            return {"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop", "weight_version": 0}

        @app.post("/v1/completions")
        def complete(body: dict[str, Any]) -> dict[str, Any]:
            ids = self.reply(body["prompt"])
            return {"choices": [{"text": self.tok.decode(ids), "token_ids": ids, "finish_reason": "stop",
                                 "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]}

        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def reply(self, prompt_ids: list[int]) -> list[int]:
        """The token ids of the scripted turn this prompt asks for."""
        from fastapi import HTTPException

        self.requests += 1
        prompt = self.tok.decode(prompt_ids)
        key = next((k for k in self.plays if k in prompt), None)
        if key is None:
            raise HTTPException(400, "no scripted play for this prompt")
        turn = prompt.count("<|im_start|>assistant") - 1
        actions = self.plays[key]
        action = actions[min(turn, len(actions) - 1)]
        call = action.tool_calls[0]
        text = (f"{action.text}\n<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}"
                "\n</tool_call><|im_end|>")
        return self.tok.encode(text, add_special_tokens=False)

    def __enter__(self) -> ScriptedPolicyServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the scripted policy server did not start")
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

"""Tools from an MCP server: `env=mcp` with a server you wrote, played on CPU by a scripted agent.

    python examples/mcp_tools.py

`McpEnv` starts `mcp_notes_server.py` (an MCP server written with the official `mcp` SDK) for each
episode, isolated by bubblewrap with no network, lists its tools (their schemas are what the chat
template renders), and sends the agent's tool calls to it. A scripted agent saves a note, reads a
missing one (the server answers `isError`: the model's mistake, shown to it), reads it back and
answers. The same server in a config: `agentrl eval env=mcp 'env.kwargs.servers=[{command: python,
args: [examples/mcp_notes_server.py], ro_paths: [.]}]' data.val_files=[your_rows.jsonl]`.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.envs.mcp_env import McpEnv
from agentrl.types import Action, ToolCall

HERE = Path(__file__).resolve().parent
SERVER = {"name": "notes", "command": "python", "args": [str(HERE / "mcp_notes_server.py")], "ro_paths": [str(HERE)]}
ROW = {
    "prompt": [{"role": "user", "content": "Save the launch code 4711 in your notes, then tell me the code."}],
    "data_source": "example/notes",
    "reward_model": {"style": "rule", "ground_truth": "4711"},
}


def call(name: str, **arguments: str) -> Action:
    return Action("", (ToolCall(name, arguments, id=f"call_{name}"),))


def main() -> float:
    env = McpEnv(servers=[SERVER])
    _, info = env.reset(options={"row": ROW})
    print("tools:", [t["function"]["name"] for t in info["tools"]])
    reward = 0.0
    for action in (call("save_note", title="launch", text="4711"), call("read_note", title="lunch"),
                   call("read_note", title="launch"), Action("The launch code is \\boxed{4711}.")):
        obs, reward, done, _, step_info = env.step(action)
        for message in obs:
            print(f"{message['name']} said: {message['content']}")
    env.close()
    print(f"reward={reward} done={done} tool errors (model)={step_info['metrics']['tool_errors_model']:g}")
    return float(reward)


if __name__ == "__main__":
    main()

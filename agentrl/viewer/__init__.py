"""`agentrl view`: look at what an agent did, in the browser, from a run or eval directory.

`ViewerServer(path)` serves one local page (static files shipped in this package, nothing from the
internet) over a run directory, an `agentrl eval` directory or a trajectory file: the dashboard
curves, each training step's kept rollouts and each evaluation, filters, and every episode turn by
turn with its tokens coloured by origin. Layer L6: it reads files only (`RunReader`) and starts no
process. It may import `agentrl.records` (the formats it reads) and the core modules of L0, never
orchestration, the trainer, inference or rollout (an import-linter contract in pyproject.toml).
"""

from agentrl.viewer.server import ViewerServer
from agentrl.viewer.sources import RunReader, Source

__all__ = ["RunReader", "Source", "ViewerServer"]

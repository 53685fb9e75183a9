"""agents: the per-node daemon (memory tier owner, write-back to disk and S3). Torch-free."""

from .config import Settings, SettingsError, socket_path_for
from .protocol import AgentClient, AgentError, AgentUnreachableError

__all__ = ["Settings", "SettingsError", "socket_path_for", "AgentClient", "AgentError",
           "AgentUnreachableError", "Agent", "run_agent", "spawn_agent"]


def __getattr__(name):
    if name in ("Agent", "run_agent"):
        from . import daemon

        return getattr(daemon, name)
    if name == "spawn_agent":
        from .launch import spawn_agent

        return spawn_agent
    raise AttributeError(name)

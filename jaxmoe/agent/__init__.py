"""Agent sessions over OpenAI-compatible endpoints: whole histories, validated tool calls, owned retries.

``AgentSession(client, tools, model=...)`` runs a task to its final answer (:mod:`.session`);
``Tool`` and plain functions are its tools (:mod:`.tools`); :mod:`.sandbox` holds the file and
shell tools of ``jaxmoe agent`` (:mod:`.cli`).
"""

from jaxmoe.agent.session import AgentError, AgentSession
from jaxmoe.agent.tools import Tool, tool_from_function

__all__ = ["AgentError", "AgentSession", "Tool", "tool_from_function"]

"""Multi-turn agents: tool-call parsers, tools, environments, trajectories that keep the
model's tokens as sampled, and the runner that drives them turn by turn on the engine; the `agent:` section
(rollout/agent/config.py) puts them in the loop (orchestrator/agents/agent_rollout.py)."""
from .environments import CodeFeedback, Environment, GuessingGame, Step
from .episodes import EnvEpisode, Episode, Reply, ToolEpisode
from .parsers import PARSERS, HermesParser, Llama3JsonParser, ParsedTurn, ToolCall, ToolParser, get_parser
from .python_tool import PythonSession
from .rendering import encode_text
from .runner import AgentLimits, AgentRunner, OpenTrajectory, agent_metrics
from .tools import Tool, ToolBox, ToolOutcome, load_tool, tool_from_function
from .trajectory import NotAppendOnly, Trajectory, demonstration, inserted_tokens, render

__all__ = ["CodeFeedback", "Environment", "GuessingGame", "Step", "PARSERS", "HermesParser", "Llama3JsonParser",
           "ParsedTurn", "ToolCall", "ToolParser", "get_parser", "PythonSession", "AgentLimits", "AgentRunner",
           "EnvEpisode", "Episode", "OpenTrajectory", "Reply", "ToolEpisode", "agent_metrics", "Tool", "ToolBox",
           "ToolOutcome", "load_tool", "tool_from_function", "NotAppendOnly", "Trajectory", "demonstration",
           "inserted_tokens", "render", "encode_text"]

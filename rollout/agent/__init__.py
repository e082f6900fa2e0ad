"""Multi-turn agents (issue 33, in progress): tool-call parsers, tools and trajectories that keep the model's
tokens as sampled. The agent loop that drives them against the engine comes next."""
from .environments import CodeFeedback, Environment, GuessingGame, Step
from .python_tool import PythonSession
from .runner import AgentLimits, AgentRunner, EnvEpisode, Episode, Reply, ToolEpisode, agent_metrics
from .parsers import PARSERS, HermesParser, Llama3JsonParser, ParsedTurn, ToolCall, ToolParser, get_parser
from .tools import Tool, ToolBox, ToolOutcome, load_tool, tool_from_function
from .trajectory import NotAppendOnly, Trajectory, inserted_tokens

__all__ = ["PythonSession", "AgentLimits", "AgentRunner", "EnvEpisode", "Episode", "Reply", "ToolEpisode", "agent_metrics", "CodeFeedback", "Environment", "GuessingGame", "Step", "PARSERS", "HermesParser", "Llama3JsonParser", "ParsedTurn", "ToolCall", "ToolParser", "get_parser",
           "Tool", "ToolBox", "ToolOutcome", "load_tool", "tool_from_function", "NotAppendOnly", "Trajectory",
           "inserted_tokens"]

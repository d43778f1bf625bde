"""Tools for agent loops: the tool protocol and registry, call parsers, a calculator."""

from pipeline.tools._calculator import CalculatorError, calculator_tool, evaluate_arithmetic
from pipeline.tools._lifecycle import (
    PoolStats,
    ResourceTool,
    ToolResult,
    TrajectoryTool,
    WarmPool,
)
from pipeline.tools._mcp import MCPServer, MCPServerError, MCPTool, MCPTrajectoryTool
from pipeline.tools._parsers import (
    HermesToolParser,
    ParsedMessage,
    ParsedToolCall,
    ToolParser,
    read_turn,
)
from pipeline.tools._registry import FunctionTool, Tool, make_registry, tool_schema
from pipeline.tools._schema import validate_arguments
from pipeline.tools._verl_tool import VerlTool
from pipeline.tools._vllm_parsers import (
    VLLMToolParser,
    load_vllm_parsers,
    make_tool_parser,
    needs_vllm,
)

__all__ = [
    "CalculatorError",
    "FunctionTool",
    "HermesToolParser",
    "MCPServer",
    "MCPServerError",
    "MCPTool",
    "MCPTrajectoryTool",
    "ParsedMessage",
    "ParsedToolCall",
    "PoolStats",
    "ResourceTool",
    "Tool",
    "ToolParser",
    "ToolResult",
    "TrajectoryTool",
    "VLLMToolParser",
    "VerlTool",
    "WarmPool",
    "calculator_tool",
    "evaluate_arithmetic",
    "load_vllm_parsers",
    "make_registry",
    "make_tool_parser",
    "needs_vllm",
    "read_turn",
    "tool_schema",
    "validate_arguments",
]

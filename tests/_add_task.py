"""The add task the real agent programs run through the proxy (tests/test_proxy_agent.py,
test_proxy_clients.py, test_proxy_harnesses.py, test_proxy_responses.py): its system prompt
and its one tool."""

SYSTEM = "Add numbers with the add tool, then reply with one line: Answer: <number>."
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

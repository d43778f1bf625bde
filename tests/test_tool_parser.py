"""Tool-call parsing, argument checking, the calculator and the registry."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import ConfigError
from pipeline.tools import (
    CalculatorError,
    FunctionTool,
    HermesToolParser,
    calculator_tool,
    evaluate_arithmetic,
    make_registry,
    tool_schema,
    validate_arguments,
)

PARSER = HermesToolParser()


def test_hermes_reads_calls_in_order_and_keeps_the_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2 + 3"}}\n</tool_call>\n<tool_call>{"name": "search", '
            '"arguments": "{\\"q\\": \\"x\\"}"}</tool_call> done')
    parsed = PARSER.parse(text)
    assert parsed.content == "Let me compute.\n\n done"
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("calculator", {"expression": "2 + 3"}, None), ("search", {"q": "x"}, None)]
    wire = parsed.calls[0].to_tool_call("call_0_0")
    assert wire.function.name == "calculator"
    assert json.loads(wire.function.arguments) == {"expression": "2 + 3"}


@pytest.mark.parametrize(("block", "error"), [
    ('{"name": "calculator", "arguments": {"expression": 12 + }}', "not valid JSON"),
    ('["calculator"]', "must be a JSON object"),
    ('{"arguments": {}}', "no 'name'"),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "calculator", "arguments": "{oops"}', "'arguments' is not a JSON object"),
    ("[" * 100_000, "not valid JSON"),
])
def test_unreadable_calls_come_back_with_an_error_not_an_exception(block, error):
    parsed = PARSER.parse(f"<tool_call>{block}</tool_call>")
    [call] = parsed.calls
    assert call.error is not None and error in call.error and call.raw == block
    assert call.to_tool_call("c").function.arguments == (
        block if call.arguments is None else json.dumps(call.arguments))


def test_an_unterminated_call_is_an_error_and_text_without_markers_is_content():
    parsed = PARSER.parse('Sure. <tool_call>{"name": "calculator", "argu')
    assert parsed.content == "Sure."
    assert parsed.calls[0].error is not None and "unterminated" in parsed.calls[0].error
    plain = PARSER.parse("  just </tool_call> text  ")
    assert plain.content == "just </tool_call> text" and plain.calls == []


_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"',
                           ":", ",", '"calculator"', "[", "]", "\n", " ", "\\", '"', "1e999"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_pieces, st.text(max_size=4)), max_size=24).map("".join))
def test_hermes_parser_never_raises(text):
    parsed = PARSER.parse(text)
    assert "<tool_call>" not in parsed.content
    for i, call in enumerate(parsed.calls):
        assert (call.error is None) == (call.name is not None and call.arguments is not None)
        call.to_tool_call(f"call_{i}")  # every call has a wire form


@pytest.mark.parametrize(("expression", "value"), [
    ("2 + 3 * 4", 14), ("(12 + 5) * 3 / 2", 25.5), ("7 // 2", 3), ("7 % 4", 3), ("2 ** 10", 1024),
    ("-3 + +4", 1), ("6 / 2", 3), ("1.5 × 4", 6), ("10 ÷ 4", 2.5),
])
def test_calculator_evaluates_arithmetic(expression, value):
    result = evaluate_arithmetic(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(("expression", "error"), [
    ("__import__('os').system('true')", "unsupported"), ("x + 1", "unsupported"),
    ("(1).__class__", "unsupported"), ("[1, 2]", "unsupported"), ("'a' * 3", "unsupported"),
    ("1 / 0", "division by zero"), ("2 ** 100000", "exponent"), ("9 ** 60 ** 1", "larger"),
    ("1 +", "not an arithmetic"), ("", "empty"), ("1 + " * 60 + "1", "longer"),
    ("True + 1", "unsupported"), ("(-8) ** 0.5", "not a real"), ("1e999 - 1", "not finite"),
])
def test_calculator_refuses_everything_else(expression, error):
    with pytest.raises(CalculatorError, match=error):
        evaluate_arithmetic(expression)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().e ", max_size=60))
def test_calculator_raises_only_calculator_errors(expression):
    try:
        value = evaluate_arithmetic(expression)
    except CalculatorError:
        return
    assert isinstance(value, int | float)


async def test_calculator_tool_schema_and_call():
    tool = calculator_tool()
    assert await tool({"expression": "40 + 2"}) == "42"
    assert await tool({"expression": "1 / 3"}) == "0.3333333333"
    schema = tool_schema(tool)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_argument_checking_names_each_problem():
    schema = calculator_tool().parameters
    assert validate_arguments(schema, {"expression": "1+1"}) == []
    assert validate_arguments(schema, {"expression": 12}) == [
        "arguments.expression: expected string, got integer"]
    assert validate_arguments(schema, {}) == ["arguments: missing required field 'expression'"]
    assert validate_arguments(schema, {"expression": "1", "x": 1}) == [
        "arguments: unexpected field 'x'"]
    assert validate_arguments(schema, [1]) == ["arguments: expected object, got array"]
    typed = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": {"enum": ["a"]}},
        "flag": {"type": ["boolean", "null"]}}}
    assert validate_arguments(typed, {"n": 2.0, "tags": ["a"], "flag": None}) == []
    assert validate_arguments(typed, {"n": True, "tags": ["b"], "flag": 1}) == [
        "arguments.n: expected integer, got boolean", "arguments.tags[0]: must be one of ['a']",
        "arguments.flag: expected boolean or null, got integer"]
    assert validate_arguments(typed, {"n": 0}) == ["arguments.n: must be >= 1"]


def test_registry_checks_tools():
    async def echo(text: str) -> str:
        return text

    tool = FunctionTool(name="echo", fn=echo)
    assert make_registry([tool, calculator_tool()]).keys() == {"echo", "calculator"}
    with pytest.raises(ConfigError, match="two tools"):
        make_registry([tool, tool])
    with pytest.raises(ConfigError, match="not a tool"):
        make_registry([object()])
    with pytest.raises(ConfigError, match="async def"):
        FunctionTool(name="sync", fn=lambda: None)  # type: ignore[arg-type]

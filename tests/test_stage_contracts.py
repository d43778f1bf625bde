"""Stage contracts (issue 35, item 2): a stage list that cannot work fails when the Pipeline
is built, naming the artifact, the stage that needs it and the stage that provides it; in
plain lists, Loop bodies and Route agents. Stages that declare nothing may write anything."""

from __future__ import annotations

import pytest

from pipeline import (
    BuildPrompt,
    CallTools,
    Generate,
    Judge,
    Loop,
    Pipeline,
    SimulatedEngine,
    StageDefinitionError,
    artifacts,
)
from pipeline.judgers import ExactMatchJudger
from pipeline.stages import Route
from pipeline.testing import ByteTokenizer


def build(stages):
    return Pipeline(stages, tokenizer=ByteTokenizer())


@pytest.mark.parametrize(("stages", "needed", "needs", "provider", "where"), [
    (lambda: [Generate()], "prompt_ids", "generate", "BuildPrompt", ""),
    (lambda: [BuildPrompt(), CallTools()], "response_ids", "call_tools", "Generate", ""),
    (lambda: [Judge([ExactMatchJudger()])], "messages", "judge", "Generate", ""),
    (lambda: [Loop([Generate(), CallTools()], max_turns=2)], "prompt_ids", "generate",
     "BuildPrompt", "in Loop 'loop'"),
    (lambda: [BuildPrompt(), Loop([CallTools(), Generate()], max_turns=2)], "response_ids",
     "call_tools", "Generate", "in Loop 'loop'"),
    (lambda: [Route({"a": [BuildPrompt(), Generate()], "b": [Generate()]})], "prompt_ids",
     "generate", "BuildPrompt", "of Route 'route' agent 'b'"),
])
def test_item2_a_missing_provider_is_refused_at_construction(stages, needed, needs, provider,
                                                             where):
    with pytest.raises(StageDefinitionError) as info:
        build(stages())
    message = str(info.value)
    assert f"stage '{needs}' {where}".replace("  ", " ").strip() in message
    assert f"'{needed}'" in message and f"put {provider}() before it" in message


def test_item2_what_every_route_agent_provides_is_available_after_it():
    ok = [Route({"a": [BuildPrompt()], "b": [BuildPrompt(), Generate()]}), Generate()]
    assert build(ok).stages  # prompt_ids: both agents provide it
    with pytest.raises(StageDefinitionError, match="'response_ids'"):
        build([Route({"a": [BuildPrompt()], "b": [BuildPrompt(), Generate()]}), CallTools()])


def test_item2_built_in_chains_pass():
    for stages in ([BuildPrompt(), Generate()],
                   [BuildPrompt(), Loop([Generate(), CallTools()], max_turns=3),
                    Judge([ExactMatchJudger()])]):
        assert len(build(stages).stages) == len(stages)


def test_item2_custom_stages_may_declare_and_are_checked():
    class Search:
        name = "search"
        requires = {"myteam.query": "MakeQuery"}  # noqa: RUF012 - as users write it
        provides = frozenset({"myteam.hits"})

        async def run(self, item, ctx) -> None:
            item.artifacts["myteam.hits"] = [item.artifacts["myteam.query"]]

    class MakeQuery:
        name = "make_query"
        requires = frozenset()
        provides = frozenset({"myteam.query"})

        async def run(self, item, ctx) -> None:
            item.artifacts["myteam.query"] = "q"

    with pytest.raises(StageDefinitionError, match=r"stage 'search' needs the artifact "
                       r"'myteam.query'.*put MakeQuery\(\) before it"):
        build([Search()])
    assert build([MakeQuery(), Search()])
    with pytest.raises(StageDefinitionError, match="requires/provides must be a set"):
        bad = Search()
        bad.requires = "myteam.query"  # a string is not a set of names
        build([bad])


async def test_item2_an_undeclared_custom_stage_may_provide_anything():
    async def seed_prompt(item, ctx) -> None:  # declares nothing: the chain cannot know
        item.artifacts[artifacts.PROMPT_IDS] = ctx.tokenizer.encode("hi")

    pipe = Pipeline([seed_prompt, Generate()], tokenizer=ByteTokenizer(),
                    engine=SimulatedEngine(latency_s=0.0),
                    sampling={"max_tokens": 4})
    sample = await pipe.run({"prompt": "x"})
    assert sample.status.value == "completed" and sample.response_ids

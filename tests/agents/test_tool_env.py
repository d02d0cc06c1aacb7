"""Tool environments (`--train.tool_path`): a file of plain functions becomes the tools (schemas from their
hints and docstrings), each call runs with a timeout and an output budget, and an episode is the
multi-turn loop over them: the model's turns are the actions, the tool messages are context."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from posttrain.agents.episode import AgentSamplingParams, CompletionOutput, Logprob, RequestOutput
from posttrain.agents.tool_calls import ToolCallError, tool_call_format
from posttrain.agents.tool_env import ToolAgentExecutor, ToolFileError, load_tool_file

TOOLS = '''
import math
from math import sqrt

MAX_TOOL_CALLS = 3
TOOL_TIMEOUT = 0.5
MAX_TOOL_OUTPUT = 10
SYSTEM_PROMPT = "Use the tools."


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def shout(text: str) -> str:
    """Repeat a text loudly.

    Args:
        text: what to repeat
    """
    return text.upper() * 5


def boom(x: int) -> int:
    """Fail.

    Args:
        x: ignored
    """
    raise ValueError("bad\\ninput")


def _helper():
    return 1
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_the_public_functions_are_the_tools_with_schemas_from_their_hints(tool_file):
    from transformers.utils import get_json_schema

    tools = load_tool_file(tool_file)
    assert tools.names == ["add", "shout", "boom"]  # not the imported sqrt, not _helper
    schema = get_json_schema(tools.functions["add"])["function"]
    assert tools.schemas[0] == {"type": "function", "function": schema}
    assert tools.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                             "description": "the first"}
    settings = (tools.max_tool_calls, tools.timeout, tools.max_output, tools.system_prompt)
    assert settings == (3, 0.5, 10, "Use the tools.")


def test_a_tools_list_picks_the_tools(tmp_path):
    path = tmp_path / "listed.py"
    path.write_text(TOOLS + "\nTOOLS = [shout]\n")
    assert load_tool_file(str(path)).names == ["shout"]


@pytest.mark.parametrize("source, missing", [
    ("def f(a, b: int) -> int:\n    '''Doc.\n\n    Args:\n        a: x\n        b: y\n    '''\n",
     "Argument a is missing a type hint in function f"),
    ("def f(a: int) -> int:\n    return a\n", "it has no docstring"),
    ("def f(a: int) -> int:\n    '''Doc.'''\n", "no description for the argument 'a'"),
])
def test_a_function_without_hints_or_docstring_args_is_one_line_naming_it(tmp_path, source, missing):
    path = tmp_path / "bad_tools.py"
    path.write_text(source)
    with pytest.raises(ToolFileError) as err:
        load_tool_file(str(path))
    line = str(err.value)
    assert line.startswith(f"--train.tool_path {path}: tool 'f': ") and missing in line and "\n" not in line


def test_a_tokenizer_without_a_tool_call_format_is_refused(tool_file, tok, tmp_path):
    import copy

    plain = copy.copy(tok)
    plain.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                           "+ '<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(ToolFileError, match="no known tool-call format"):
        load_tool_file(tool_file, plain)


def test_timeouts_errors_and_long_output_become_the_tool_message(tool_file, tmp_path):
    release = threading.Event()
    path = tmp_path / "hang_tools.py"
    path.write_text(TOOLS + "\n\nGATE = None\n\n\ndef hang(x: int) -> int:\n    '''Hang.\n\n    Args:\n"
                    "        x: ignored\n    '''\n    GATE.wait()\n    return x\n")
    tools = load_tool_file(str(path))
    tools.functions["hang"].__globals__["GATE"] = release
    tools.max_output = 100  # errors whole (the budget cuts them too: see the next test)
    try:
        # the call is abandoned while the function still runs: its thread is not killed
        assert asyncio.run(tools.run("hang", {"x": 1})) == ("error: hang timed out after 0.5 s", False)
        assert any(t.name == "posttrain-tool-hang" for t in threading.enumerate())
    finally:
        release.set()
    assert asyncio.run(tools.run("add", {"a": 2, "b": 3})) == ("5", True)
    assert asyncio.run(tools.run("boom", {"x": 1})) == ("error: boom raised ValueError: bad input", False)
    unknown = "error: unknown tool 'nope' (tools: add, shout, boom, hang)"
    assert asyncio.run(tools.run("nope", {})) == (unknown, False)
    text, ok = asyncio.run(tools.run("add", {"a": 1}))
    assert not ok and text == "error: add: missing a required argument: 'b'"
    tools.max_output = 10
    assert asyncio.run(tools.run("shout", {"text": "ab"})) == ("ABABABABAB", True)  # exactly the budget
    cut = "ABCABCABCA... [cut: 5 more characters]"
    assert asyncio.run(tools.run("shout", {"text": "abc"})) == (cut, True)


def _cut(text: str, budget: int = 10) -> str:
    return text[:budget] + f"... [cut: {len(text) - budget} more characters]"


def test_error_texts_are_cut_to_the_output_budget_as_any_output(tmp_path):
    path = tmp_path / "loud_errors.py"
    path.write_text(TOOLS + "\n\ndef long_boom(x: int) -> int:\n    '''Fail at length.\n\n    Args:\n"
                    "        x: ignored\n    '''\n    raise ValueError('x' * 500)\n")
    tools = load_tool_file(str(path))  # MAX_TOOL_OUTPUT = 10
    long = "error: long_boom raised ValueError: " + "x" * 500
    assert asyncio.run(tools.run("long_boom", {"x": 1})) == (_cut(long), False)
    unknown = "error: unknown tool 'nope' (tools: add, shout, boom, long_boom)"
    assert asyncio.run(tools.run("nope", {})) == (_cut(unknown), False)
    missing = "error: add: missing a required argument: 'b'"
    assert asyncio.run(tools.run("add", {"a": 1})) == (_cut(missing), False)


def test_an_async_tool_is_awaited_on_its_thread(tmp_path):
    path = tmp_path / "async_tools.py"
    path.write_text("import asyncio\n\n\nasync def add_later(a: int, b: int) -> int:\n    '''Add, later.\n\n"
                    "    Args:\n        a: the first\n        b: the second\n    '''\n"
                    "    await asyncio.sleep(0)\n    return a + b\n")
    tools = load_tool_file(str(path))
    assert tools.names == ["add_later"]
    assert asyncio.run(tools.run("add_later", {"a": 2, "b": 3})) == ("5", True)


def test_two_tools_of_one_name_are_refused_at_load(tmp_path):
    path = tmp_path / "twice.py"
    path.write_text(TOOLS + "\nTOOLS = [add, shout, add]\n")
    with pytest.raises(ToolFileError) as err:
        load_tool_file(str(path))
    assert str(err.value) == (f"--train.tool_path {path}: TOOLS has two tools named 'add' (a tool's name is "
                              f"its function's __name__); keep one, or rename one")


HANG = ("\n\nGATE = None\n\n\ndef hang(x: int) -> int:\n    '''Hang.\n\n    Args:\n        x: ignored\n"
        "    '''\n    GATE.wait()\n    return x\n")


def test_stuck_calls_are_counted_and_past_the_cap_no_call_starts(tmp_path):
    from posttrain.agents.tool_env import MAX_STUCK, ToolsStuck

    path = tmp_path / "stuck_tools.py"
    path.write_text(TOOLS.replace("TOOL_TIMEOUT = 0.5", "TOOL_TIMEOUT = 0.05") + HANG)
    tools = load_tool_file(str(path))
    release = threading.Event()
    tools.functions["hang"].__globals__["GATE"] = release
    try:
        for k in range(MAX_STUCK):
            assert tools.stuck_calls == k
            assert asyncio.run(tools.run("hang", {"x": 1}))[1] is False
        assert tools.stuck_calls == MAX_STUCK == 4  # as --reward.func_path's reward_func calls
        with pytest.raises(ToolsStuck) as err:
            asyncio.run(tools.run("add", {"a": 1, "b": 2}))
        line = str(err.value)
        assert line.startswith("4 timed-out tool calls (posttrain-tool-hang, ") and "\n" not in line
    finally:
        release.set()
    for t in list(tools.stuck):
        t.join(5)
    assert tools.stuck_calls == 0 and asyncio.run(tools.run("add", {"a": 1, "b": 2})) == ("3", True)


class ScriptedEngine:
    """An episode engine that answers each turn with the next scripted text (tokenised, ending with the
    end-of-turn token as a sampled stop), each token with log-prob -0.5."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.prompts = tok, list(turns), []

    async def generate(self, prompt_token_ids, sampling_params, **kwargs):
        self.prompts.append(list(prompt_token_ids))
        text = self.turns.pop(0)
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [end]
        out = CompletionOutput(0, text, ids, [{t: Logprob(-0.5)} for t in ids], "stop")
        return RequestOutput(list(prompt_token_ids), [out])


def _episode(tok, tools, turns, question="What is 2 + 3?"):
    from posttrain.data.templates import render_chat

    prompt = render_chat(tok, [{"role": "user", "content": question}], True, tools=tools.schemas)
    engine = ScriptedEngine(tok, turns)
    params = AgentSamplingParams(max_tokens=64)
    result = asyncio.run(ToolAgentExecutor(tools).execute(prompt, "5", params, 1024, tok, engine))
    return prompt, result


def test_an_episode_is_the_rendered_conversation_with_only_the_model_turns_as_actions(tool_file, tok):
    tools = load_tool_file(tool_file, tok)
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    prompt, result = _episode(tok, tools, [bad, call, "5"])
    tokens, ranges = result["observation_tokens"], result["action_ranges"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # the actions are exactly the sampled tokens
    assert [tokens[a:b] for a, b in ranges] == [tok(t, add_special_tokens=False)["input_ids"] + [end]
                                                for t in (bad, call, "5")]
    assert result["rollout_log_probs"] == [0.0 if not any(a <= i < b for a, b in ranges) else -0.5
                                           for i in range(len(tokens))]
    # the malformed call is answered with its error, counted, and the episode went on
    with pytest.raises(ToolCallError) as err:
        tool_call_format(tok).parse(bad)
    full = f"error: {err.value}"
    error = full[:10] + f"... [cut: {len(full) - 10} more characters]"  # MAX_TOOL_OUTPUT = 10
    assert full.startswith("error: hermes tool call 0: invalid JSON")
    assert result["extra_logs"] == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_stuck": 0.0}
    assert result["turns"] == 3
    assert result["tool_call_errors"] == 1  # agent/tool_call_errors, as the server counts malformed calls
    assert result["reward"] is None and not result["truncated"]
    # the whole sequence is the chat template's rendering of the conversation
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": bad},
                {"role": "tool", "tool_call_id": "call_0", "content": error},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "5"},
                {"role": "assistant", "content": "5"}]
    rendered = tok.apply_chat_template(messages, tools=tools.schemas, tokenize=False)
    assert tok.decode(tokens, skip_special_tokens=False) + "\n" == rendered
    assert tokens == tok(rendered, add_special_tokens=False)["input_ids"][:-1]
    # the reward source sees the prompt and the final answer
    assert tok.decode(result["reward_ids"]) == prompt + "5<|im_end|>"


def test_the_call_cap_ends_the_episode(tool_file, tok):
    tools = load_tool_file(tool_file, tok)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
    _, result = _episode(tok, tools, [call] * 4)
    assert result["turns"] == 4
    assert result["extra_logs"] == {"tool_calls": 3.0, "tool_errors": 0.0, "tool_stuck": 0.0}
    tokens, (start, end) = result["observation_tokens"], result["action_ranges"][-1]
    assert end == len(tokens) and result["reward_ids"][-(end - start):] == tokens[start:end]


def _bench_template(compact_results: bool) -> str:
    """bench/agent_tools.py's `--compact-tools` template (`compact_results`: with `--compact-results`)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "agent_tools.py"
    spec = importlib.util.spec_from_file_location("bench_agent_tools", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.compact_tools_template(compact_results)


@pytest.mark.parametrize("template", [None, "compact", "compact results"])
@pytest.mark.parametrize("environment", [False, True], ids=["functions", "environment"])
def test_calculator_sft_transcripts_render_as_the_tool_episodes(tiny_model_dir, environment, template):
    """`make_calculator_tool_rows` through the SFT dataset gives the tokens of the episode that samples its
    assistant turns, for `calculator_tools.py` and for `calculator_env.py` (whose `calc()` answers the
    episode's question: the tool message is the product), with the tiny chat template and with the
    benchmark's compact ones (tools listed one a line; tool results as `= result`)."""
    from posttrain.agents.examples import CALCULATOR_ENV, CALCULATOR_TOOLS
    from posttrain.agents.examples.calculator import make_calculator_tool_rows
    from posttrain.data.sft_dataset import SFTDataset
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    if template:
        tok.chat_template = _bench_template(template == "compact results")
    row = next(r for r in make_calculator_tool_rows(20, seed=3, environment=environment)
               if len(r["messages"]) == 4)
    sft = SFTDataset([row], tok, input_key="messages", apply_chat_template=True, multiturn=True,
                     max_len=1024)[0]
    tools = load_tool_file(CALCULATOR_ENV if environment else CALCULATOR_TOOLS, tok)
    call = row["messages"][1]["tool_calls"][0]["function"]
    assert call["arguments"] == ({} if environment else {"a": int(row["prompt"].split()[2]),
                                                          "b": int(row["prompt"].split()[4][:-1])})
    text = f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': call['arguments']})}\n</tool_call>"
    _, result = _episode(tok, tools, [text, row["answer"]], question=row["prompt"])
    assert result["extra_logs"]["tool_errors"] == 0.0
    tokens = result["observation_tokens"]
    assert list(sft["input_ids"][:len(tokens)]) == tokens
    assert [tokens[a:b] for a, b in result["action_ranges"]] == [
        list(sft["input_ids"][a:b]) for a, b in result["action_ranges"]]
    assert all(sft["loss_mask"][i] for a, b in result["action_ranges"] for i in range(a, b))
    assert not any(sft["loss_mask"][i] for i in range(result["prompt_length"]))
    rendered = tok.decode(tokens)
    assert (f"\n= {row['answer']}<|im_end|>" in rendered) == (template == "compact results"), rendered
    assert ("<tool_response>" in rendered) == (template != "compact results"), rendered
    assert ("\ntools:\n" in rendered) == bool(template), rendered


def test_the_reward_source_scores_the_prompt_and_the_final_answer(tok):
    """A tool episode's `reward_ids`: the query is the prompt and the final answer, and so are the TRL-style
    `completions` / `completion_ids` of a reward function that takes them."""
    from posttrain.rollout.single_turn import Rollout, score_rollouts

    class Source:
        takes_columns = True

        def score(self, queries, prompts, labels, **kwargs):
            self.seen = queries, prompts, kwargs

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt_text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    prompt, answer = ids(prompt_text), ids("5<|im_end|>")
    calls = ids('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
                "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    response = tok.decode(calls + answer, skip_special_tokens=True)
    rollout = Rollout(prompt_ids=prompt, output_ids=calls + answer, rollout_logprobs=[], finish_reason="stop",
                      prompt_text=prompt_text, response_text=response, reward_ids=prompt + answer)
    source = Source()
    score_rollouts(source, tok, [rollout])
    queries, prompts, kwargs = source.seen
    assert queries == [prompt_text + "5<|im_end|>"] and prompts == [prompt_text]
    assert kwargs["completions"] == ["5"] and kwargs["completion_ids"] == [answer]


def test_a_mistral_tool_episode_has_ids_mistrals_template_accepts(tool_file, tok):
    """The call ids of a tool episode are the family's: Mistral's template refuses any id that is not 9
    alphanumeric characters, and the episode's ids are numbered over its calls."""
    from tests.agents.mistral_template import mistral_tokenizer

    mistral = mistral_tokenizer(tok)
    tools = load_tool_file(tool_file, mistral)
    call = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'
    _, result = _episode(mistral, tools, [call, call, "5"])
    text = mistral.decode(result["observation_tokens"], skip_special_tokens=False)
    assert result["extra_logs"] == {"tool_calls": 2.0, "tool_errors": 0.0, "tool_stuck": 0.0}
    assert text.count('[TOOL_RESULTS] {"content": 5, "call_id": "000000000"}[/TOOL_RESULTS]') == 1
    assert text.count('[TOOL_RESULTS] {"content": 5, "call_id": "000000001"}[/TOOL_RESULTS]') == 1


class CallingEngine:
    """A batch engine whose every turn is `text` and the end-of-turn token (a sampled stop)."""

    def __init__(self, tok, text: str):
        end = tok.convert_tokens_to_ids("<|im_end|>")
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + [end]

    def generate(self, prompts, params, max_new_tokens=None, seeds=None):
        from posttrain.rollout import RolloutOutput

        return [[RolloutOutput(list(p), list(self.ids), [-0.5] * len(self.ids), "stop")] for p in prompts]


def test_stuck_calls_are_logged_and_past_the_cap_stop_the_run_naming_the_tool_flag(tmp_path, tok):
    from posttrain.agents.multi_turn import AgentError, AgentRunner
    from posttrain.data import Prompt
    from posttrain.data.templates import render_chat
    from posttrain.rollout import SamplingParams

    path = tmp_path / "stuck_tools.py"
    path.write_text(TOOLS.replace("TOOL_TIMEOUT = 0.5", "TOOL_TIMEOUT = 0.05")
                    .replace("MAX_TOOL_CALLS = 3", "MAX_TOOL_CALLS = 10") + HANG)
    tools = load_tool_file(str(path), tok)
    release = threading.Event()
    tools.functions["hang"].__globals__["GATE"] = release
    hang = '<tool_call>\n{"name": "hang", "arguments": {"x": 1}}\n</tool_call>'
    try:
        _, result = _episode(tok, tools, [hang] * 3 + ["done"])
        assert result["extra_logs"] == {"tool_calls": 3.0, "tool_errors": 3.0, "tool_stuck": 3.0}
        text = render_chat(tok, [{"role": "user", "content": "Q"}], True, tools=tools.schemas)
        runner = AgentRunner(ToolAgentExecutor(tools), CallingEngine(tok, hang), tok, None, max_len=4096,
                             timeout=60, max_failure_frac=1.0)
        with pytest.raises(AgentError) as err:
            runner.run([Prompt(text=text, token_ids=tok(text, add_special_tokens=False)["input_ids"],
                               label="5", source="test")], SamplingParams(n=1, seed=1))
        assert str(err.value).startswith("--train.tool_path: an agent episode stopped the run: 4 timed-out "
                                         "tool calls (posttrain-tool-hang, ")
    finally:
        release.set()


def test_openai_format_sft_rows_render_as_the_tool_episodes(tok):
    """An assistant tool-call turn as OpenAI writes it (content null or absent, arguments a JSON string)
    trains on the tokens of the row with the arguments as an object: the tool episode's."""
    from posttrain.agents.examples.calculator import make_calculator_tool_rows
    from posttrain.data.sft_dataset import SFTDataset

    def sft(row):
        item = SFTDataset([row], tok, input_key="messages", apply_chat_template=True, multiturn=True,
                          max_len=1024)[0]
        return list(item["input_ids"]), list(item["loss_mask"])

    row = next(r for r in make_calculator_tool_rows(20, seed=3) if len(r["messages"]) == 4)
    call = row["messages"][1]["tool_calls"][0]
    wire = {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
    # content "" (valid before), then null and absent: the arguments parsed, not encoded twice
    for turn in ({"role": "assistant", "content": "", "tool_calls": [wire]},
                 {"role": "assistant", "content": None, "tool_calls": [wire]},
                 {"role": "assistant", "tool_calls": [wire]}):
        messages = [row["messages"][0], turn, *row["messages"][2:]]
        assert sft({**row, "messages": messages}) == sft(row)


def test_a_malformed_tool_calls_value_in_data_is_one_line():
    from posttrain.data.errors import DataError
    from posttrain.data.validation import check_messages

    row = {"__source__": "d.jsonl", "__row__": 3}
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]}]
    with pytest.raises(DataError) as err:
        check_messages(row, "messages", messages, "--data.input_key")
    assert str(err.value).startswith("d.jsonl, row 3: key 'messages', message 1: 'tool_calls' must be a "
                                     "list of")
    assert "\n" not in str(err.value)


def test_sft_rows_hand_json_string_arguments_to_the_template_parsed(tok):
    """A template that `tojson`s the call (Mistral's, Llama 3.1's) would encode a JSON-string `arguments`
    a second time: SFT rows get the normalisation the agent server applies."""
    from posttrain.data.sft_dataset import SFTDataset
    from tests.agents.mistral_template import mistral_tokenizer

    mistral = mistral_tokenizer(tok)

    def text(arguments):
        call = {"id": "000000000", "type": "function", "function": {"name": "add", "arguments": arguments}}
        row = {"messages": [{"role": "user", "content": "2+3?"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "000000000", "content": "5"},
                            {"role": "assistant", "content": "5"}]}
        ids = SFTDataset([row], mistral, input_key="messages", apply_chat_template=True, multiturn=True,
                         max_len=1024)[0]["input_ids"]
        return mistral.decode(list(ids), skip_special_tokens=False)

    rendered = text('{"a": 2, "b": 3}')
    assert '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "000000000"}]' in rendered
    assert rendered == text({"a": 2, "b": 3})


ENVIRONMENT_FILE = '''
SEEN = []


class Base:
    def echo(self, text: str) -> str:
        """Say a text back (inherited: a tool too).

        Args:
            text: what to say
        """
        return text


class Counter(Base):
    """One episode's state: the prompt and label `reset` gave it, and a count."""

    def __init__(self):
        self.count = 0

    def reset(self, prompt: str, label=None, **kwargs) -> None:
        SEEN.append((self, prompt, label))

    def bump(self, by: int) -> int:
        """Add to the episode's count.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def label(self) -> str:
        """The episode's label, as reset saw it."""
        return str([s for s in SEEN if s[0] is self][0][2])

    @staticmethod
    def double(x: int) -> int:
        """Twice a number (a static method: a tool).

        Args:
            x: the number
        """
        return 2 * x

    def _private(self):
        return 0


def helper(x: int) -> int:
    """Not a tool: ENVIRONMENT's methods are.

    Args:
        x: ignored
    """
    return x


ENVIRONMENT = Counter
'''


def test_an_environment_class_gives_each_episode_its_own_state_and_its_row(tmp_path, tok):
    """ENVIRONMENT (TRL's environment_factory): its public methods but reset are the tools (schemas from their
    hints), one instance per episode, reset with the rendered prompt and the label before the first turn."""
    path = tmp_path / "env.py"
    path.write_text(ENVIRONMENT_FILE)
    tools = load_tool_file(str(path), tok)
    assert tools.names == ["echo", "bump", "label", "double"]
    assert [f["function"]["name"] for f in tools.schemas] == tools.names  # no `self` in any schema
    by = {"type": "integer", "description": "how much to add"}
    assert tools.schemas[1]["function"]["parameters"]["properties"] == {"by": by}
    bump = '<tool_call>\n{"name": "bump", "arguments": {"by": 2}}\n</tool_call>'
    label = '<tool_call>\n{"name": "label", "arguments": {}}\n</tool_call>'
    double = '<tool_call>\n{"name": "double", "arguments": {"x": 21}}\n</tool_call>'
    results = [_episode(tok, tools, [bump, bump, "done"])[1] for _ in range(2)]  # 2 episodes: own counts
    results.append(_episode(tok, tools, [label, double, "done"], question="Which label?")[1])
    text = [tok.decode(r["observation_tokens"], skip_special_tokens=False) for r in results]
    for t in text[:2]:
        assert "<tool_response>\n2\n</tool_response>" in t and "<tool_response>\n4\n</tool_response>" in t
    assert "<tool_response>\n5\n</tool_response>" in text[2]  # _episode's label
    assert "<tool_response>\n42\n</tool_response>" in text[2]
    seen = tools.functions["bump"].__globals__["SEEN"]
    assert len({id(s[0]) for s in seen}) == 3 and all(s[2] == "5" for s in seen)
    assert "Which label?" in seen[2][1] and seen[2][1].endswith("<|im_start|>assistant\n")
    assert all(r["extra_logs"]["tool_errors"] == 0.0 for r in results)
    with pytest.raises(TypeError, match="an episode's instance"):  # never the instance built at load
        asyncio.run(tools.run("bump", {"by": 1}))


@pytest.mark.parametrize("source, error", [
    (ENVIRONMENT_FILE + "TOOLS = [helper]\n", "set TOOLS (functions) or ENVIRONMENT"),
    ("ENVIRONMENT = 3\n", "ENVIRONMENT must be a class (one instance per episode), got int"),
    (ENVIRONMENT_FILE.replace("self.count = 0", "raise OSError('no\\nsandbox')"),
     "ENVIRONMENT Counter() raised OSError: no sandbox"),
    ("class Env:\n    def reset(self, prompt, label=None):\n        pass\n\n\nENVIRONMENT = Env\n",
     "no tools"),
    (ENVIRONMENT_FILE.replace("def reset(self, prompt: str, label=None, **kwargs)", "def reset(self, row)"),
     "Counter.reset must take prompt= and label= (or **kwargs): missing a required argument: 'row'"),
    (ENVIRONMENT_FILE.replace("def _private(self)", "def get_reward(self)"),
     "Counter.get_reward: an environment gives no rewards here"),
], ids=["with-TOOLS", "not-a-class", "constructor-raises", "no-methods", "reset-signature", "get_reward"])
def test_a_bad_environment_is_one_line_at_load(tmp_path, source, error):
    path = tmp_path / "env.py"
    path.write_text(source)
    with pytest.raises(ToolFileError, match=re.escape(error)) as err:
        load_tool_file(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_an_environment_reset_that_returns_an_observation_fails_the_episode_naming_it(tmp_path, tok):
    """An initial observation from reset is refused (the prompt is already rendered and tokenised): the
    episode fails with one line naming the file; the agent runner counts it as a failed episode."""
    path = tmp_path / "env.py"
    path.write_text(ENVIRONMENT_FILE.replace("SEEN.append((self, prompt, label))", "return 'look around'"))
    tools = load_tool_file(str(path), tok)
    with pytest.raises(ToolFileError, match=r"Counter.reset\(\) returned str, not None: put an initial "
                                            r"observation in the prompt dataset") as err:
        _episode(tok, tools, ["done"])
    assert str(path) in str(err.value)


def test_the_calculator_environment_answers_as_the_agent_files_calc():
    """calculator_env.py's `calc()` is the agent file's bare `calc` (the question's product), `calc("A op B")`
    its `calc A op B`; anything else is the call's error."""
    from posttrain.agents.examples import CALCULATOR_ENV
    from posttrain.agents.examples.calculator import evaluate_call

    tools = load_tool_file(CALCULATOR_ENV)
    env = tools.environment()
    prompt = "<|im_start|>user\nWhat is 23 * 7?<|im_end|>\n<|im_start|>assistant\n"
    env.reset(prompt=prompt, label="161")
    assert env.calc() == 161 == evaluate_call("calc", prompt)
    assert (env.calc("3 + 4"), env.calc("30 - 4"), env.calc("6 * 7")) == (7, 26, 42)
    with pytest.raises(ValueError, match="use A \\* B, A \\+ B or A - B"):
        env.calc("2 ** 8")
    assert tools.names == ["calc"] and tools.max_tool_calls == 2


def test_docs_show_the_shipped_calculator_environment():
    """docs/agents.md's ENVIRONMENT example is calculator_env.py without its module docstring."""
    import ast
    import textwrap
    from pathlib import Path

    from posttrain.agents.examples import CALCULATOR_ENV

    source = Path(CALCULATOR_ENV).read_text()
    code = source.splitlines()[ast.parse(source).body[0].end_lineno:]
    docs = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    block = docs.split("# posttrain/agents/examples/calculator_env.py (without its module docstring)\n")[1]
    block = textwrap.dedent(block.split("```")[0]).splitlines()
    assert [line for line in block if line.strip()] == [line for line in code if line.strip()]


@pytest.mark.parametrize("how", ["raises", "async-raises"])
def test_an_environment_reset_that_raises_fails_the_episode_with_one_line(tmp_path, tok, how):
    reset = {"raises": "def reset(self, prompt, label=None):\n        raise KeyError('no\\nrow')",
             "async-raises": "async def reset(self, prompt, label=None):\n        await asyncio.sleep(0)\n"
                             "        raise KeyError('no')"}[how]
    source = ENVIRONMENT_FILE.replace("def reset(self, prompt: str, label=None, **kwargs) -> None:\n"
                                      "        SEEN.append((self, prompt, label))", reset)
    path = tmp_path / "env.py"
    path.write_text("import asyncio\n" + source)
    tools = load_tool_file(str(path), tok)
    with pytest.raises(ToolFileError, match=r"Counter.reset\(\) raised KeyError: 'no") as err:
        _episode(tok, tools, ["done"])
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_an_environment_async_reset_is_awaited(tmp_path, tok):
    source = ENVIRONMENT_FILE.replace("    def reset(self, prompt: str, label=None, **kwargs) -> None:",
                                      "    async def reset(self, prompt: str, label=None, **kwargs) -> None:")
    path = tmp_path / "env.py"
    path.write_text(source)
    tools = load_tool_file(str(path), tok)
    _episode(tok, tools, ["done"])
    assert [s[2] for s in tools.functions["bump"].__globals__["SEEN"]] == ["5"]

"""Tool-call parsing per model family (agents/tool_calls.py), the family chosen from the tokenizer, and the
tiny models' tool-capable chat template (byte-identical to plain ChatML when no tools are involved)."""
from __future__ import annotations

import pytest

from posttrain.agents.tool_calls import (
    ToolCall,
    ToolCallError,
    render_tool_prompt,
    tool_call_format,
)

# the tiny models' template before it learnt tools: without tools the new one renders the same bytes
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object",
                                                          "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


class FakeTokenizer:
    def __init__(self, template="", vocab=(), name="some/model"):
        self.chat_template, self.name_or_path = template, name
        self.vocab = {v: i for i, v in enumerate(vocab)}

    def get_vocab(self):
        return self.vocab


def fmt(name):
    marks = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}
    return tool_call_format(FakeTokenizer(vocab=[marks[name]]))


# ---- hermes / Qwen ------------------------------------------------------------------------------------
def test_hermes_parses_several_calls_and_the_content_around_them():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert fmt("hermes").parse(text) == ("Let me add.", [ToolCall("add", {"a": 1, "b": 2}, "call_0"),
                                                         ToolCall("now", {}, "call_1")])
    assert fmt("hermes").parse(" just text ") == ("just text", [])
    # arguments given as a JSON string are parsed; missing arguments are no arguments
    assert fmt("hermes").parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ToolCall("f", {"x": 1}, "call_0")]
    assert fmt("hermes").parse('<tool_call>{"name": "f"}</tool_call>')[1] == [ToolCall("f", {}, "call_0")]


@pytest.mark.parametrize("family,text,says", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "invalid JSON"),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>', "missing 'name'"),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ("hermes", 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}', "unterminated <tool_call>"),
    ("hermes", '<tool_call>["add"]</tool_call>', "expected a JSON object"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', "invalid or unterminated JSON"),
    ("mistral", '[TOOL_CALLS][{"name": "", "arguments": {}}]', "missing 'name'"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": "3"}]', "must be a JSON object"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}', "unterminated"),
    ("llama3", '{"name": "add", "parameters": {"a": 1}', "unterminated JSON"),
    ("llama3", '{"parameters": {"a": 1}}', "missing 'name'"),
    ("llama3", '{"name": "add", "parameters": 7}', "'parameters' must be a JSON object"),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {}} and then', "unexpected text"),
    ("llama3", '<|python_tag|>add(1, 2)', "expected a JSON object"),
])
def test_a_malformed_call_is_one_line_naming_what_is_wrong(family, text, says):
    with pytest.raises(ToolCallError) as err:
        fmt(family).parse(text)
    assert says in str(err.value) and "\n" not in str(err.value) and family in str(err.value)


def test_mistral_and_llama3_parse_their_formats():
    text = 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]</s>'
    assert fmt("mistral").parse(text) == ("Sure.</s>", [ToolCall("add", {"a": 1}, "000000000"),
                                                        ToolCall("now", {}, "000000001")])
    assert fmt("mistral").parse("no calls") == ("no calls", [])
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}'
    assert fmt("llama3").parse(text) == ("", [ToolCall("add", {"a": 1}, "call_0"),
                                              ToolCall("now", {}, "call_1")])
    assert fmt("llama3").parse(' {"name": "add", "arguments": {"a": 2}} ')[1] == [
        ToolCall("add", {"a": 2}, "call_0")]
    assert fmt("llama3").parse("The answer is 3.") == ("The answer is 3.", [])


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3"])
def test_a_prefilled_call_completed_by_the_model_parses(family):
    f = fmt(family)
    args = ', "parameters": ' if family == "llama3" else ', "arguments": '
    completion = {"hermes": '{"a": 1}}\n</tool_call>', "mistral": '{"a": 1}}]', "llama3": '{"a": 1}}'}[family]
    assert f.prefill("add").endswith('"add"' + args)
    assert f.parse(f.prefill("add") + completion)[1] == [ToolCall("add", {"a": 1}, f.call_id(0))]
    call = '{"name": "add"' + args + completion  # "required": the model writes the whole call
    assert f.parse(f.prefill(None) + (call[1:] if family == "llama3" else call))[1] == [
        ToolCall("add", {"a": 1}, f.call_id(0))]


# ---- the family from the tokenizer ----------------------------------------------------------------------
def test_the_family_is_chosen_from_the_template_or_the_vocabulary(tok):
    assert tool_call_format(tok).name == "hermes"  # the tiny models' template
    assert tool_call_format(FakeTokenizer(template="{{ '[TOOL_CALLS]' }}")).name == "mistral"
    assert tool_call_format(FakeTokenizer(vocab=["<|python_tag|>"])).name == "llama3"
    llama = "<|start_header_id|>{% if tools %}{{ tools | tojson }}{% endif %}"
    assert tool_call_format(FakeTokenizer(template=llama)).name == "llama3"
    with pytest.raises(ValueError, match=r"tokenizer org/plain: no known tool-call format .* "
                                         r"\(known: hermes, mistral, llama3\)"):
        tool_call_format(FakeTokenizer(template=PLAIN_CHATML, name="org/plain"))


# ---- the tiny models' template ---------------------------------------------------------------------------
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_template_renders_plain_chatml(tok, messages, generation_prompt):
    new = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    old = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                  chat_template=PLAIN_CHATML)
    assert new == old
    assert render_tool_prompt(tok, messages, None) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=PLAIN_CHATML)


def test_the_template_renders_tools_calls_and_results_in_the_hermes_style(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": {"a": 1}}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "5"},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    text = render_tool_prompt(tok, messages, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add", ' in text
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # what the template renders for a call, the hermes parser reads back
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert tool_call_format(tok).parse(turn)[1] == [ToolCall("add", {"a": 2, "b": 3}, "call_0"),
                                                   ToolCall("add", {"a": 1}, "call_1")]


def test_mistral_call_ids_pass_mistrals_template_and_number_the_calls_of_an_episode(tok):
    from posttrain.agents.openai_chat import openai_tool_calls
    from tests.agents.mistral_template import mistral_tokenizer

    mistral = mistral_tokenizer(tok)
    f = tool_call_format(mistral)
    turn = ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, '
            '{"name": "add", "arguments": {"a": 1}}]')
    calls = f.parse(turn)[1]
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]},
                *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls)]
    text = render_tool_prompt(mistral, messages, TOOLS)  # Mistral's template refuses other ids
    assert '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "000000000"}, ' in text
    assert '[TOOL_RESULTS] {"content": 5, "call_id": "000000001"}[/TOOL_RESULTS]' in text
    # a later turn's calls are numbered after the episode's earlier ones: ids unique within it
    later = f.parse(turn, 2)[1]
    assert [c.id for c in later] == ["000000002", "000000003"]
    served = openai_tool_calls(later)  # the agent server's message.tool_calls
    assert [c["id"] for c in served] == ["000000002", "000000003"]
    assert [c.id for c in fmt("hermes").parse('<tool_call>{"name": "f"}</tool_call>', 3)[1]] == ["call_3"]
    assert [c.id for c in fmt("llama3").parse('{"name": "f"}', 1)[1]] == ["call_1"]

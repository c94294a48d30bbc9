"""Chat templates -> assistant tokens, on the templates model families ship.

The shipped templates are read from TRL's package (`tests.chat_families`: the originals as the model repositories
carry them). Each gets a small offline BPE tokenizer with the family's own special tokens. Checked, on multi-turn
chats with and without a system prompt and with reasoning (a field, or inline `<think>` text):
- the ids are the template's own (`apply_chat_template(tokenize=True)`);
- one run of targets per assistant turn: its content and its end-of-turn token, never the turn's header,
  never a system or user turn's text, and the reasoning wherever the template renders it;
- where TRL ships a training template with `{% generation %}` markers that renders the same text, its assistant
  mask (an independent reference) holds every target, and what it holds beyond them is only the turn header
  (the generation prompt), whitespace after the end-of-turn token, or EOS.
"""

from __future__ import annotations

import pytest

from core.chat import chat_prompt_ids, render_chat, split_last_turn
from core.chat_template import ChatTemplateError, end_of_turn_tokens, turn_stop_ids
from tests.chat_families import FAMILIES, QWEN_SPECIALS, SHIPPED, chat_tokenizer

SYSTEM, Q1, Q2 = "You add numbers.", "What is 2 + 3?", "And 10 + 7?"
A1, A2 = "2 + 3 = 5.", "It is 17."
R1, R2 = "Two plus three makes five.", "Ten and seven sum to seventeen."
TOOL = "calculator says 17"


def conversation(system: bool, reasoning: str | None, tool: bool = False) -> list[dict]:
    """Two exchanges; reasoning None, as a field (`reasoning_content`, gpt-oss's `thinking`) or inline; with `tool`,
    a tool turn (its result) between the second question and the answer."""

    def reply(answer: str, thought: str) -> dict:
        if reasoning == "field":
            return {"role": "assistant", "content": answer, "reasoning_content": thought, "thinking": thought}
        if reasoning == "inline":
            return {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}
        return {"role": "assistant", "content": answer}

    head = [{"role": "system", "content": SYSTEM}] if system else []
    middle = [{"role": "tool", "content": TOOL}] if tool else []
    return [
        *head,
        {"role": "user", "content": Q1},
        reply(A1, R1),
        {"role": "user", "content": Q2},
        *middle,
        reply(A2, R2),
    ]


CASES = [(s, r) for s in (True, False) for r in (None, "field", "inline")]
# Role words a turn's header carries; an assistant target never holds one (gpt-oss's own analysis -> final hand-over
# inside one assistant message aside: `<|start|>assistant` between its channels is the model's to write).
ROLE_WORDS = ("assistant", "<|im_start|>", "<|user|>", "<|start_header_id|>", "<start_of_turn>", "<｜User｜>")
_tokenizers: dict = {}


def make_tokenizer(tmp_path_factory, name: str, template: str | None = None, spec: dict | None = None):
    """The family's tokenizer with `template` (default: the shipped one), cached per name and template."""
    key = (name, template)
    if key not in _tokenizers:
        corpus = [SYSTEM, Q1, Q2, A1, A2, R1, R2, TOOL, "system user assistant model tool"] * 10
        _tokenizers[key] = chat_tokenizer(tmp_path_factory.mktemp(name), name, template, corpus, spec)
    return _tokenizers[key]


def target_runs(tokenizer, ids, targets) -> list[str]:
    """The decoded text of each run of consecutive target positions."""
    runs: list[list[int]] = []
    for k in targets:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return [tokenizer.decode([ids[k] for k in run], skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("system,reasoning", CASES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_shipped_templates_give_each_assistant_turn_and_its_end_token(tmp_path_factory, name, system, reasoning):
    spec = FAMILIES[name]
    tok = make_tokenizer(tmp_path_factory, name)
    messages = conversation(system, reasoning)
    if name == "gemma" and system:  # Gemma's template refuses a system turn itself: refused, with its reason
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            render_chat(tok, messages)
        return
    ids, targets = render_chat(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    text = tok.apply_chat_template(messages, tokenize=False)
    runs = target_runs(tok, ids, targets)
    assert len(runs) == 2, runs
    for run, question, answer, thought in zip(runs, (Q1, Q2), (A1, A2), (R1, R2)):
        assert answer in run, run
        assert run.endswith(spec["closers"]), run
        assert not run.startswith(spec["header"]), run
        assert not any(t in run for t in (SYSTEM, Q1, Q2)), run
        if not (name == "gptoss" and thought in run):
            body = run.removesuffix(next(c for c in spec["closers"] if run.endswith(c)))  # GLM closes with <|user|>
            assert not any(word in body for word in ROLE_WORDS), run  # no piece of any turn's header
        asked = text.find(question) + len(question)
        rendered_thought = thought in text[asked : text.find(answer, asked)]  # the template kept this turn's reasoning
        assert (thought in run) == rendered_thought, (run, rendered_thought)


# How each family's shipped template takes a tool result with no tool call before it: the templates that refuse it,
# with the reason they give; the ones that leave it out of the text; the others render it.
REFUSES_A_BARE_TOOL_TURN = {
    "cohere": "Conversation roles must alternate",
    "gemma": "Conversation roles must alternate",
    "gemma3": "Conversation roles must alternate",
    "gptoss": "no previous assistant message with a tool call",
}
LEAVES_OUT_A_TOOL_TURN = {"cohere2", "phi3", "phi3_5"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_tool_turn_is_never_a_target(tmp_path_factory, name):
    """A tool result between a question and the answer: the answer's run holds none of it. The families whose
    template refuses such a turn refuse the conversation with the template's own reason, naming the failure; the
    ones that leave it out of the text (Phi-3, Cohere2) still train the answer."""
    tok = make_tokenizer(tmp_path_factory, name)
    messages = conversation(False, None, tool=True)
    if name in REFUSES_A_BARE_TOOL_TURN:
        with pytest.raises(ChatTemplateError, match=f"cannot render it .*{REFUSES_A_BARE_TOOL_TURN[name]}"):
            render_chat(tok, messages)
        return
    ids, targets = render_chat(tok, messages)
    text = tok.apply_chat_template(messages, tokenize=False)
    runs = target_runs(tok, ids, targets)
    assert len(runs) == 2 and A2 in runs[1] and runs[1].endswith(FAMILIES[name]["closers"]), runs
    assert all(TOOL not in run and "calculator" not in run for run in runs), runs
    assert (TOOL in text) == (name not in LEAVES_OUT_A_TOOL_TURN), name  # rendered, or left out


# The families whose shipped template cannot train a structured tool call, with the reason it is refused: the
# template cannot render it, or leaves the call out of the text. The others write it.
REFUSES_TOOL_CALLS = {
    "cohere": "Conversation roles must alternate",
    "cohere2": "Conversation roles must alternate",
    "gemma": "Conversation roles must alternate",
    "gemma3": "Conversation roles must alternate",
    "deepseek_r1_distill": "does not write this assistant turn's tool calls",
    "deepseekv3": "can only concatenate str",  # DeepSeek's templates take the arguments as a JSON string
    "lfm2": "does not write this assistant turn's tool calls",
    "llama3": "does not write this assistant turn's tool calls",
    "phi3": "does not write this assistant turn's tool calls",
    "phi3_5": "does not write this assistant turn's tool calls",
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_assistant_turn_that_calls_a_tool_is_trained_with_its_call(tmp_path_factory, name):
    """A structured tool call (`tool_calls`, with the tool's schema offered), the tool's result, the answer: the
    call's turn is a target as the template writes the call (the tool's name and arguments, through the family's
    end-of-turn token), the tool's result never is, and the ids are the template's own. A template that cannot
    render or close such a turn, or leaves the call out, refuses the conversation with its reason."""
    from rollout.calculator import calculator
    from rollout.tools import tool_schema

    tok = make_tokenizer(tmp_path_factory, name)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "10 + 7"}}}
    messages = [
        {"role": "user", "content": Q1},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": Q2},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": TOOL},
        {"role": "assistant", "content": A2},
    ]
    tools = [tool_schema(calculator)]
    if name in REFUSES_TOOL_CALLS:
        with pytest.raises(ChatTemplateError, match=REFUSES_TOOL_CALLS[name]):
            render_chat(tok, messages, tools)
        return
    ids, targets = render_chat(tok, messages, tools)
    assert ids == list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"])
    runs = target_runs(tok, ids, targets)
    assert len(runs) == 3 and A1 in runs[0] and A2 in runs[2], runs
    # A calling turn ends where the template ends it: gpt-oss's `<|call|>`, GLM's `<|observation|>`
    closers = {"gptoss": ("<|call|>",), "glm4moe": ("<|observation|>",)}.get(name, FAMILIES[name]["closers"])
    assert "calculator" in runs[1] and "10 + 7" in runs[1] and runs[1].endswith(closers), runs
    assert not [run for run in runs if "says" in run or Q2 in run], runs  # the tool's result, the question: context


# TRL's training templates for these change the text (they keep every turn's reasoning, or require both think tags):
# their masks are not of the shipped rendering, so they cannot serve as its reference.
RENDERS_OTHERWISE = {
    "qwen3",
    "qwen3_5_think",
    "qwen3_5_nothink",
    "qwen3_6",
    "qwen3_8",
    "glm4moe",
    "deepseek_r1_distill",
}


@pytest.mark.parametrize(
    "name", sorted(n for n in FAMILIES if (SHIPPED / f"{n}_training.jinja").exists() and n not in RENDERS_OTHERWISE)
)
def test_the_targets_agree_with_trls_generation_marked_templates(tmp_path_factory, name):
    tok = make_tokenizer(tmp_path_factory, name)
    marked = make_tokenizer(tmp_path_factory, name, (SHIPPED / f"{name}_training.jinja").read_text())
    generation = tok.apply_chat_template([{"role": "user", "content": Q1}], tokenize=False, add_generation_prompt=True)
    header = generation[len(tok.apply_chat_template([{"role": "user", "content": Q1}], tokenize=False)) :]
    compared = 0
    for system, reasoning in CASES:
        messages = conversation(system, reasoning)
        try:
            ids, targets = render_chat(tok, messages)
        except ChatTemplateError:
            continue  # refused by the template itself (Gemma's system turn), checked above
        ref = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert list(ref["input_ids"]) == ids  # the same text: its mask is a reference for ours
        compared += 1
        mask = {k for k, m in enumerate(ref["assistant_masks"]) if m}
        assert set(targets) <= mask, target_runs(tok, ids, sorted(set(targets) - mask))
        for k in sorted(mask - set(targets)):
            piece = tok.decode([ids[k]], skip_special_tokens=False)
            assert not piece.strip() or piece in header or piece == tok.eos_token, (piece, header)
    assert compared >= 3  # the comparison ran


# A Mistral-v0.3-style template (hand-written): the system prompt goes into the last user turn, so the rendering of
# an earlier turn's prompt is not a prefix of the whole conversation's.
MISTRAL_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{{- bos_token }}"
    "{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- if loop.index0 == ns.last_user and system is defined %}{{- '[INST] ' + system + '\\n\\n' + m['content'] + "
    "'[/INST]' }}{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


def test_a_template_that_moves_the_system_prompt_still_splits(tmp_path_factory):
    mistral = dict(specials=["<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>")
    tok = make_tokenizer(tmp_path_factory, "mistral", MISTRAL_STYLE, spec=mistral)
    messages = conversation(True, None)
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(messages, tokenize=False).startswith(prompt)  # the case this is about
    ids, targets = render_chat(tok, messages)
    # the turn whose prompt renders differently starts at its content, with the space the template puts before it
    assert target_runs(tok, ids, targets) == [f" {A1}</s>", f" {A2}</s>"]


def test_temper_chatml_agrees_with_transformers_assistant_mask(arithmetic_tokenizer):
    """Temper's own ChatML template has {% generation %} markers around the content and its end token:
    transformers' assistant mask is then an independent reference, token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    messages = conversation(True, None)
    ids, targets = render_chat(tok, messages)
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"])
    assert targets == [k for k, m in enumerate(ref["assistant_masks"]) if m]


def test_temper_chatml_writes_tool_calls_that_vllms_hermes_parser_reads(arithmetic_tokenizer):
    """Temper's ChatML template offers the tools' schemas in the system turn and writes a structured call as
    Qwen2.5 does: the call's turn is a target with its call (transformers' assistant mask, from the template's
    {% generation %} markers, as the reference), the tool's result is context, and vLLM's `hermes` parser reads
    the call back from the turn's text."""
    from transformers import AutoTokenizer

    from rollout.calculator import calculator
    from rollout.tool_parsing import ToolCallParser
    from rollout.tools import tool_schema

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    tools = [tool_schema(calculator)]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4821 + 3907"}}}
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "Calculate 4821 + 3907."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "8728"},
        {"role": "assistant", "content": "8728"},
    ]
    ids, targets = render_chat(tok, messages, tools)
    ref = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(ref["input_ids"])
    assert targets == [k for k, m in enumerate(ref["assistant_masks"]) if m]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nUse the calculator.\n<tools>\n{") and '"name": "calculator"' in text
    runs = target_runs(tok, ids, targets)
    assert runs[1:] == ["8728<|im_end|>"] and len(runs) == 2, runs  # the tool's 8728 is context
    turn = ToolCallParser("hermes", tok, tools).parse(runs[0])
    assert turn.malformed is None and [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("calculator", '{"expression": "4821 + 3907"}')
    ]
    without = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    # without tools the rendering is the plain ChatML it always was
    assert without == "<|im_start|>user\nCalculate 4821 + 3907.<|im_end|>\n<|im_start|>assistant\n"


def test_an_opening_assistant_turn(tmp_path_factory, arithmetic_tokenizer):
    """A conversation that opens with an assistant turn: that turn starts at its content where the template renders
    the conversation; a template that refuses it (Gemma: roles must alternate) is a ChatTemplateError saying so."""
    from transformers import AutoTokenizer

    opening = [
        {"role": "assistant", "content": A1},
        {"role": "user", "content": Q2},
        {"role": "assistant", "content": A2},
    ]
    for tok, close in (
        (AutoTokenizer.from_pretrained(arithmetic_tokenizer), "<|im_end|>"),
        (make_tokenizer(tmp_path_factory, "qwen3"), "<|im_end|>"),
        (make_tokenizer(tmp_path_factory, "llama3"), "<|eot_id|>"),
    ):
        ids, targets = render_chat(tok, opening)
        assert target_runs(tok, ids, targets)[0] == f"{A1}{close}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(make_tokenizer(tmp_path_factory, "gemma"), opening)


def test_a_template_that_rewrites_the_content_is_refused(tmp_path_factory):
    tok = make_tokenizer(
        tmp_path_factory,
        "qwen2_5",
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content | replace('.', '!') }}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    )
    with pytest.raises(ChatTemplateError, match="message 2: the template does not write this assistant turn"):
        render_chat(tok, conversation(True, None))
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_chat(tok, conversation(True, None))


def test_end_of_turn_tokens_come_from_the_template(tmp_path_factory):
    """Where turns end in a rendering (`end_of_turn_tokens`, SFT's targets) and what a sampled turn stops on
    (`turn_stop_ids`): the latter as the families' shipped generation configs list them (gpt-oss: `<|return|>`,
    `<|call|>`, never `<|end|>`, which closes its analysis channel; GLM: `<|user|>`, `<|observation|>` and EOS;
    Cohere2: its EOS after `<|END_RESPONSE|>`); a tokenizer whose EOS is `<|endoftext|>` stops ChatML turns on
    `<|im_end|>` too."""
    stops = lambda tok: set(tok.convert_ids_to_tokens(list(turn_stop_ids(tok))))
    gptoss = make_tokenizer(tmp_path_factory, "gptoss")
    assert set(end_of_turn_tokens(gptoss)) == {"<|end|>", "<|return|>", "<|call|>"}
    assert stops(gptoss) == {"<|return|>", "<|call|>"}
    glm = make_tokenizer(tmp_path_factory, "glm4moe")
    assert set(end_of_turn_tokens(glm)) == stops(glm) == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    assert stops(make_tokenizer(tmp_path_factory, "cohere2")) == {"<|END_OF_TURN_TOKEN|>"}
    assert set(end_of_turn_tokens(make_tokenizer(tmp_path_factory, "phi3"))) == {"<|end|>", "<|endoftext|>"}
    llama = make_tokenizer(tmp_path_factory, "llama3")
    assert set(end_of_turn_tokens(llama)) == stops(llama) == {"<|eot_id|>"}
    # Markup a tokenizer makes special inside a call (`</tool_call>`, GLM's `</arg_value>`) is not the turn's end
    for name, closer in (("glm4moe", "<|observation|>"), ("qwen2_5", "<|im_end|>")):
        tags = ["<tool_call>", "</tool_call>", "<arg_value>", "</arg_value>"]
        spec = {**FAMILIES[name], "specials": [*FAMILIES[name]["specials"], *tags]}
        tagged = chat_tokenizer(tmp_path_factory.mktemp(f"{name}_tags"), name, spec=spec)
        assert "</tool_call>" in tagged.all_special_tokens and closer in stops(tagged)
        assert not {"</tool_call>", "</arg_value>"} & (stops(tagged) | set(end_of_turn_tokens(tagged)))
    # A token written after each call (Kimi K2's `<|tool_call_end|>`) closes the call, not the turn
    per_call = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<|tool_call_begin|>{{ c.function.name }} {{ c.function.arguments | tojson }}"
        "<|tool_call_end|>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}"
    )
    spec = {**FAMILIES["qwen2_5"], "specials": [*QWEN_SPECIALS, "<|tool_call_begin|>", "<|tool_call_end|>"]}
    kimi_like = chat_tokenizer(tmp_path_factory.mktemp("per_call"), "qwen2_5", per_call, spec=spec)
    assert stops(kimi_like) == {"<|im_end|>"}
    base = chat_tokenizer(
        tmp_path_factory.mktemp("base"), "qwen2_5", spec={**FAMILIES["qwen2_5"], "eos": "<|endoftext|>"}
    )
    assert base.eos_token == "<|endoftext|>" and stops(base) == {"<|endoftext|>", "<|im_end|>"}


@pytest.mark.parametrize("name", ["qwen3", "llama3", "deepseek_r1_distill", "gptoss", "phi3"])
def test_a_multi_turn_preference_prompt_splits_at_its_last_turn(tmp_path_factory, name):
    """hh-rlhf style: the prompt holds earlier assistant turns; the completion is the last turn."""
    tok = make_tokenizer(tmp_path_factory, name)
    messages = conversation(True, None)
    prompt_ids, completion_ids = split_last_turn(tok, messages)
    assert prompt_ids == chat_prompt_ids(tok, messages[:-1])
    assert prompt_ids == list(
        tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    completion = tok.decode(completion_ids, skip_special_tokens=False)
    assert A2 in completion and completion.endswith(FAMILIES[name]["closers"]) and Q2 not in completion
    assert A1 in tok.decode(prompt_ids, skip_special_tokens=False)

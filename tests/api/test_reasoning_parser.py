"""The reasoning parsers (decode_server/api/reasoning.py) on their own: each format's split of whole outputs, and a
stream cut anywhere (every split point, random chunkings) gives exactly the whole output's split."""

from __future__ import annotations

import random

import pytest

from decode_server.api.reasoning import REASONING_PARSERS, ReasoningSplitter, split_reasoning
from decode_server.model.tokenizer import Tokenizer

R1, V3, GLM = (REASONING_PARSERS[k] for k in ("deepseek-r1", "deepseek-v3", "glm45"))
THINKING = {"thinking": True}

CASES = [  # (format, template kwargs, output, reasoning_content, content)
    (R1, None, "Two and two.</think>\n\nAnswer: 4", "Two and two.", "Answer: 4"),
    (R1, None, "<think>\nhmm</think>ok", "\nhmm", "ok"),  # R1 writing <think> again at the start
    (R1, None, "cut off at max_tokens </th", "cut off at max_tokens </th", ""),
    (R1, None, "</think>no thought", None, "no thought"),
    (R1, None, "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag closes the reasoning
    (V3, None, "x</think>y", None, "x</think>y"),  # thinking off: the template closed it, all answer
    (V3, THINKING, "x</think>y", "x", "y"),
    (V3, {"thinking": False}, "plain", None, "plain"),
    (GLM, None, "  <think>a<b</think>\n c", "a<b", "c"),
    (GLM, None, "no think", None, "no think"),
    (GLM, None, "<thin", None, "<thin"),  # a tag that never completed is text
    (GLM, None, "\n\n", None, "\n\n"),
    (GLM, None, "answer then <think>x</think>", None, "answer then <think>x</think>"),  # only at the start
    (GLM, None, "<think>unfinished", "unfinished", ""),
]


@pytest.mark.parametrize(("fmt", "kwargs", "text", "reasoning", "content"), CASES)
def test_whole_output_split(fmt, kwargs, text, reasoning, content) -> None:
    assert split_reasoning(fmt, text, kwargs) == (reasoning, content)


def _streamed(fmt, kwargs, pieces: list[str]) -> tuple[str | None, str]:
    splitter = ReasoningSplitter(fmt, kwargs)
    thought, answer = "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        thought, answer = thought + r, answer + c
    r, c = splitter.finish()
    return (thought + r) or None, answer + c


@pytest.mark.parametrize(("fmt", "kwargs", "text", "reasoning", "content"), CASES)
def test_stream_cut_anywhere_equals_the_whole_split(fmt, kwargs, text, reasoning, content) -> None:
    for cut in range(len(text) + 1):
        assert _streamed(fmt, kwargs, [text[:cut], text[cut:]]) == (reasoning, content), cut
    rng = random.Random(len(text))
    for _ in range(50):
        pieces, rest = [], text
        while rest:
            n = rng.randint(1, 4)
            pieces.append(rest[:n])
            rest = rest[n:]
        assert _streamed(fmt, kwargs, pieces) == (reasoning, content), pieces


def test_random_outputs_stream_like_the_whole() -> None:
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "</th", "a", " ", "\n", "b"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        for fmt, kwargs in ((R1, None), (V3, THINKING), (V3, None), (GLM, None)):
            want = split_reasoning(fmt, text, kwargs)
            pieces = [text[i:i + 2] for i in range(0, len(text), 2)]
            assert _streamed(fmt, kwargs, pieces) == want, (fmt.name, text)
            r, c = want
            assert (r or "") in text and c in text  # nothing invented


def test_chat_template_kwargs_reach_the_template(tmp_path) -> None:
    """DeepSeek-V3.1/V3.2's templates open the reasoning when `thinking` is set; ours passes the variables through."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "<assistant>{% if thinking %}<think>{% else %}</think>{% endif %}")
    tok = Tokenizer(HFTokenizer(WordLevel({"x": 0}, unk_token="x")), {"chat_template": template})
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages).endswith("<assistant></think>")
    assert tok.apply_chat_template(messages, thinking=True).endswith("<assistant><think>")

"""`--model-path tiny-glm5` (GLM-5, `glm_moe_dsa`) served with HiSparse: chat uses the checkpoint's GLM chat
template, greedy outputs equal the dense offline engine's, and every pool is empty afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from api_server_harness import CONTEXT_LENGTH, ServerProcess, wait_until_idle

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

MODEL = "tiny-glm5"
HISPARSE_CONFIG = '{"device_buffer_size": 64, "num_recent_slots": 4}'
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": " ".join(f"w{(j * 37) % 89}" for j in range(40))}]


@pytest.fixture(scope="module")
def glm_server() -> Iterator[ServerProcess]:
    server = ServerProcess("--model-path", MODEL, "--enable-hisparse", "--hisparse-config", HISPARSE_CONFIG)
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        server.kill()


def test_glm5_chat_with_hisparse_equals_dense_offline(glm_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=glm_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    llm = LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES)
    assert prompt.startswith("[gMASK]<sop><|system|>\n")
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ids) + 10 > 64  # past index_topk and the device buffer: HiSparse swaps rows in
    expected = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == expected.text
    wait_until_idle(glm_server)

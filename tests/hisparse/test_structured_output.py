"""Structured outputs (response_format json_object / json_schema, regex, ebnf) in the engine, dense and HiSparse.

Every token is checked against a reference built from xgrammar directly: a fresh matcher replays the output, and
at each step the token must be the argmax (greedy) or the seeded draw of the model's logits with every token the
grammar forbids at −inf. Outputs that stop are complete sentences of their grammar (JSON that parses and fits its
schema). This holds with overlap scheduling (a constrained request makes the engine read each pass before the
next), through retractions and aborts; HiSparse == dense bit for bit; every ending frees the request's matcher.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from harness import PAGE, make_engine, random_prompt
from test_logits_processing import drive, reference_pick
from test_lossless import tight_hisparse_budget
from test_overlap import DENSE_ROW, Job

from decode_server.engine.engine import Engine
from decode_server.engine.sampling_params import SamplingParams, StructuredOutput
from decode_server.engine.structured_output import allowed_tokens, detect_encoding
from decode_server.errors import InvalidRequestError

xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "colour"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green", "blue"]}}}  # fmt: skip
CONSTRAINTS = {
    "schema": StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA)),
    "regex": StructuredOutput(kind="regex", spec=r"(yes|no), [0-9]{2,4}!"),
    "ebnf": StructuredOutput(kind="ebnf", spec='root ::= "<" item ("," item)* ">"\nitem ::= [a-c] | "zz"'),
    "object": StructuredOutput(kind="json_object"),
}


def engine_for(tiny, **kw) -> Engine:
    """JSON without optional whitespace: bounded, so the random model finishes it."""
    return make_engine(tiny, json_any_whitespace=False, **kw)


def structured_jobs(seed: int, num: int = 16) -> list[Job]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    names = list(CONSTRAINTS)
    jobs = []
    for i in range(num):
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": 40 + i}
        extra = {"frequency_penalty": 0.5} if i % 5 == 3 else {}
        step = rng.randrange(0, 25)
        abort = step + rng.randrange(3, 10) if i % 6 == 5 else None
        params = SamplingParams(max_tokens=48, structured=CONSTRAINTS[names[i % len(names)]], **sampling, **extra)
        jobs.append(Job(step, f"s{i}", random_prompt(gen, rng.randrange(20, 140)), params, abort))
    jobs.append(Job(3, "free", random_prompt(gen, 50), SamplingParams(max_tokens=20, temperature=0.0)))
    return jobs


def check_against_grammar(engine: Engine, jobs: list[Job], got: dict) -> None:
    """Each token is the reference's under a fresh matcher's mask; stopped outputs complete their grammar."""
    for j in jobs:
        rec = got[j.rid]
        if rec.finish[0] == "abort" or j.params.structured is None:
            continue
        compiled = engine.grammar.compile(j.params.structured)
        matcher = xgrammar.GrammarMatcher(compiled)
        for i, (token, raw) in enumerate(zip(rec.tokens, rec.logits, strict=True)):
            mask = xgrammar.allocate_token_bitmask(1, engine.grammar.vocab_size)
            matcher.fill_next_token_bitmask(mask, 0)
            want = raw.float().clone()
            if j.params.frequency_penalty:
                counts = torch.bincount(torch.tensor(rec.tokens[:i], dtype=torch.int64), minlength=want.numel())
                want = want - torch.tensor(j.params.frequency_penalty) * counts.float()
            want[~allowed_tokens(mask, want.numel())[0]] = float("-inf")
            pick = reference_pick(want, j.params, i, engine.device)
            assert token == pick, f"{j.rid}: token {i} is {token}, the grammar's reference picks {pick}"
            assert matcher.accept_token(token), f"{j.rid}: token {i} breaks the grammar"
        if rec.finish == ("stop", None):
            assert rec.tokens[-1] in engine.eos_token_ids and matcher.is_terminated(), j.rid
            if j.params.structured.kind == "json_schema":
                value = json.loads(rec.text)
                assert set(value) == {"ok", "n", "colour"} and 0 <= value["n"] <= 99, rec.text
            if j.params.structured.kind == "json_object":
                assert isinstance(json.loads(rec.text), dict), rec.text


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_every_token_follows_the_grammar_through_retractions_and_aborts(tiny_cpu, hisparse: bool, overlap: bool):
    budget = (dict(device_budget=tight_hisparse_budget(3, 12), host_budget=64 << 20) if hisparse
              else dict(device_budget=16 * PAGE * DENSE_ROW))  # fmt: skip
    engine = engine_for(tiny_cpu, hisparse=hisparse, overlap=overlap, optimistic=True, max_running=10, **budget)
    jobs = structured_jobs(seed=3)
    got = drive(engine, jobs)
    assert engine.stats().num_retractions > 0, "the budget was meant to force retractions"
    assert any(r.finish[0] == "abort" for r in got.values())
    stopped = {j.params.structured.kind for j in jobs if j.params.structured and got[j.rid].finish == ("stop", None)}
    assert {"json_schema", "regex", "ebnf"} <= stopped, stopped
    check_against_grammar(engine, jobs, got)


def test_hisparse_matches_dense_and_overlap_matches_sync(tiny_cpu):
    jobs = [Job(j.step, j.rid, j.prompt, j.params) for j in structured_jobs(seed=9)]
    runs = {(h, o): drive(engine_for(tiny_cpu, hisparse=h, overlap=o, max_running=16), jobs)
            for h in (False, True) for o in (False, True)}
    base = runs[(False, False)]
    for key, run in runs.items():
        for j in jobs:
            assert run[j.rid].tokens == base[j.rid].tokens and run[j.rid].finish == base[j.rid].finish, (key, j.rid)
            if key[0]:  # HiSparse against dense with the same scheduling: the logits bit for bit
                for a, b in zip(run[j.rid].logits, runs[(False, key[1])][j.rid].logits, strict=True):
                    assert torch.equal(a, b), (key, j.rid)


def test_bad_constraints_are_the_clients_error(tiny_cpu):
    engine = engine_for(tiny_cpu, hisparse=True)
    bad = {
        "response_format": StructuredOutput(kind="json_schema", spec='{"type": "object", "properties": 3}'),
        "regex": StructuredOutput(kind="regex", spec="(unclosed"),
        "ebnf": StructuredOutput(kind="ebnf", spec="root ::= missing_rule"),
    }
    for param, spec in bad.items():
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(param, [5, 6, 7], SamplingParams(structured=spec))
        assert err.value.param == param and "invalid" in str(err.value)
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        engine.add_request("x", [5], SamplingParams(structured=StructuredOutput(kind="json_schema", spec="{nope")))
    assert engine.is_idle_and_empty()
    off = make_engine(tiny_cpu, hisparse=False)
    off.grammar, off.grammar_error = None, "structured outputs are off on this server (--grammar-backend none)"
    with pytest.raises(InvalidRequestError, match="grammar-backend none"):
        off.add_request("y", [5], SamplingParams(structured=CONSTRAINTS["regex"]))


def test_matchers_are_freed_on_every_ending(tiny_cpu):
    engine = engine_for(tiny_cpu, hisparse=True, overlap=True)
    proc = engine.logits_processor
    for i in range(3):
        engine.add_request(f"m{i}", [5 + i] * 30, SamplingParams(max_tokens=40, temperature=0.0,
                                                                 structured=CONSTRAINTS["object"]))
    while len(proc._matchers) < 3:
        engine.step()
    engine.abort_request("m0")
    assert engine.fail_request("m1", "KVTransferError", "the peer died")
    assert len(proc._matchers) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.is_idle_and_empty() and not proc._matchers


def test_encoding_detection_and_bitmask_expansion():
    assert detect_encoding({"decoder": {"type": "ByteLevel"}}) == ("byte_level", False)
    spm = {"decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]},
           "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}]}}
    assert detect_encoding(spm) == ("byte_fallback", True)
    meta = {"decoder": {"type": "ByteFallback"}, "pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"}}
    assert detect_encoding(meta) == ("byte_fallback", False)
    assert detect_encoding({"decoder": {"type": "WordPiece"}}) == ("raw", False)
    words = torch.tensor([[0b101, -(2**31)], [-1, 0]], dtype=torch.int32)  # bit 31 set: a negative word
    allowed = allowed_tokens(words, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]  # bit 31 of word 1 is token 63: beyond 40
    assert allowed[1].nonzero().flatten().tolist() == list(range(32))
    assert allowed_tokens(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.gpu
@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_structured_output_on_cuda(tiny_cuda, hisparse: bool):
    """CUDA graphs and overlap scheduling on: every token is the grammar reference's, and HiSparse == dense."""
    engine = engine_for(tiny_cuda, hisparse=hisparse, device="cuda", max_running=16)
    assert engine.overlap and engine.graph_runner is not None, engine.cuda_graph_error
    jobs = [Job(j.step, j.rid, j.prompt, j.params) for j in structured_jobs(seed=3)]
    got = drive(engine, jobs)
    check_against_grammar(engine, jobs, got)
    if hisparse:
        dense = drive(engine_for(tiny_cuda, hisparse=False, device="cuda", max_running=16), jobs)
        for j in jobs:
            assert dense[j.rid].tokens == got[j.rid].tokens, j.rid
            for a, b in zip(dense[j.rid].logits, got[j.rid].logits, strict=True):
                assert torch.equal(a, b), j.rid

"""The engine side of PD disaggregation, in one process and without a transport: a prefill engine hands each
prompt chunk's rows to a callback, which copies them straight into a decode engine's receiving regions (what the
transfer engine does between processes); the decode engine commits the first token from the aux record and
decodes. Greedy tokens and logprobs must equal a colocated engine's, HiSparse on and off, and every pool, staging
row and held request must be free afterwards. The real transport is covered by test_pd_servers.py."""

from __future__ import annotations

import pytest
import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.disagg.aux_record import AuxRecord, AuxRecordError
from decode_server.disagg.memory import REGION_NAMES, DecodeMemory, prefill_regions, prefill_rows
from decode_server.engine.engine import Engine
from decode_server.engine.request import RequestStatus
from decode_server.engine.sampling_params import SamplingParams

# Prompts shorter and longer than the decode buffer (D = top_k = 64); chunked prefill of 32 tokens.
PROMPT_LENS = [20, 130]
MAX_TOKENS = 6


def _engine(tiny, **overrides) -> Engine:
    fields = {"device": "cpu", "page_size": 16, "chunked_prefill_size": 32, "device_kv_budget_bytes": 32 << 20,
              "context_length": 256, "hisparse": HiSparseConfig(device_buffer_size=64, num_recent_slots=2)}
    fields.update(overrides)
    model, config, tokenizer = tiny
    return Engine(EngineConfig(**fields), model=model, model_config=config, tokenizer=tokenizer)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)


def _run_colocated(engine: Engine, prompts: list[list[int]]) -> dict[str, tuple[list[int], list]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _params())
    out: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.rid][0].extend(d.new_token_ids)
            out[d.rid][1].extend(d.logprobs or [])
    return out


def _copy_rows(src: dict, dst: dict, src_rows: list[int], dst_rows: list[int]) -> None:
    for name in REGION_NAMES:
        s, d = src[name].as_rows(), dst[name].as_rows()
        d[:, torch.tensor(dst_rows)] = s[:, torch.tensor(src_rows)].to(d.device)


def _run_pd(prefill: Engine, decode: Engine, mem: DecodeMemory,
            prompts: list[list[int]]) -> dict[str, tuple[list[int], list]]:
    src_regions, dst_regions = prefill_regions(prefill.kv), mem.regions
    # Poison the receiving side: a row the transfer did not write would show up in the outputs.
    for r in dst_regions.values():
        r.tensor.view(torch.uint8).fill_(0xFF)
    for i, p in enumerate(prompts):
        decode.add_request(f"r{i}", p, _params(), remote_prefill=True)
    destinations: dict[str, tuple[int, list[int]]] = {}
    assert decode.step() == []  # admits them; nothing to compute until their KV arrives
    for req in decode.pop_remote_admitted():
        assert req.status is RequestStatus.TRANSFERRING
        destinations[req.rid] = (req.row, mem.destination(req.row, req.prompt_len))

    def on_chunks(chunks):
        for req, start, n in chunks:
            dst_rows = destinations[req.rid][1][start : start + n]
            _copy_rows(src_regions, dst_regions, prefill_rows(prefill.kv, req.row, start, n), dst_rows)

    prefill.prefill_chunk_hook = on_chunks
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, _params().model_copy(update={"max_tokens": 1}), hold_kv=True)
    firsts = {}
    while prefill.has_unfinished_requests():
        for d in prefill.step():
            assert d.finished and d.finish_reason == "length" and len(d.new_token_ids) == 1
            firsts[d.rid] = AuxRecord.from_token(123 + int(d.rid[1:]), d.prompt_tokens, d.new_token_ids[0],
                                                 d.logprobs[0])
    assert len(prefill.scheduler.held) == len(prompts)  # KV kept until the transfer ends
    for rid in firsts:
        assert prefill.release_held(rid)
    assert prefill.is_idle_and_empty()

    out: dict[str, tuple[list[int], list]] = {}
    for rid, rec in firsts.items():
        row, _ = destinations[rid]
        mem.aux[row] = torch.frombuffer(bytearray(rec.encode()), dtype=torch.uint8)
        got = AuxRecord.decode(mem.read_aux(row), expected_room=rec.room)
        mem.install(row, got.prompt_len)
        d = decode.commit_remote_prefill(rid, got.first_token, got.token_logprob())
        out[rid] = (list(d.new_token_ids), list(d.logprobs or []))
    while decode.has_unfinished_requests():
        for d in decode.step():
            out[d.rid][0].extend(d.new_token_ids)
            out[d.rid][1].extend(d.logprobs or [])
    assert decode.is_idle_and_empty()
    assert mem.staging_usage().used == 0
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "dense"])
def test_pd_rows_copied_in_process_equal_colocated(tiny_cpu, hisparse, overlap):
    """One request at a time, so that every forward pass has the same batch in both set-ups (batch composition
    changes float rounding): tokens and logprobs bit for bit. `overlap`: all three engines run overlap
    scheduling (the prefill hook, held KV, remote-admitted requests with the host one pass ahead)."""
    prompts = _prompts()
    colocated = _engine(tiny_cpu, enable_hisparse=hisparse, force_overlap_schedule=overlap)
    prefill = _engine(tiny_cpu, force_overlap_schedule=overlap)
    decode = _engine(tiny_cpu, enable_hisparse=hisparse, force_overlap_schedule=overlap)
    mem = DecodeMemory(decode.kv, decode.config.max_running_requests)
    for prompt in prompts:
        expected = _run_colocated(colocated, [prompt])["r0"]
        got = _run_pd(prefill, decode, mem, [prompt])["r0"]
        assert got[0] == expected[0] and len(got[0]) == MAX_TOKENS
        assert got[1] == expected[1]  # logprobs (and top logprobs) bit for bit


def test_aux_record_refuses_other_rooms_and_empty_rows():
    rec = AuxRecord(room=2**63 - 5, first_token=42, prompt_len=9, logprob=-0.25, top_logprobs=[(42, -0.25)])
    data = rec.encode()
    assert AuxRecord.decode(data, 2**63 - 5) == rec
    with pytest.raises(AuxRecordError, match="expected room 7"):
        AuxRecord.decode(data, 7)
    with pytest.raises(AuxRecordError, match="no record"):
        AuxRecord.decode(bytes(len(data)), 7)


def test_failed_transfer_frees_everything(tiny_cpu):
    decode = _engine(tiny_cpu, enable_hisparse=True)
    mem = DecodeMemory(decode.kv, decode.config.max_running_requests)
    decode.add_request("a", list(range(3, 100)), _params(), remote_prefill=True)
    decode.step()
    (req,) = decode.pop_remote_admitted()
    mem.destination(req.row, req.prompt_len)
    assert decode.stats().host_pages.used > 0
    row = req.row
    assert decode.fail_request("a", "KVTransferError", "prefill died", hold_kv=True)
    (delta,) = decode.step()
    assert delta.finished and delta.error_class == "KVTransferError" and delta.error == "prefill died"
    assert not decode.is_idle_and_empty()  # held until the transfer layer says the room is over
    mem.release(row)
    assert decode.release_held("a")
    assert decode.is_idle_and_empty()

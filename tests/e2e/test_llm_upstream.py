"""The fake LLM upstream (llm_upstream.py) against the providers' formats, without a
gateway: each shape's JSON answer and stream parse as the provider's do and report the
usage the request chose, streams leave event by event, and each fault is what its name
says. The parsing here is written from the providers' API references, not shared with the
fake, so that the fake cannot drift from them silently (the fields Diana reads:
crates/diana-core/src/usage.rs).

Binding-free (no `host` fixture): it runs once in every e2e run, whatever `--binding`
says, and needs nothing built."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from harness import LlmUpstream

# The usage every answer below is asked to report.
I, O, CACHE_READ, CACHE_WRITE, REASONING = 1234, 567, 200, 34, 67
KNOBS = {
    "x-fake-input": str(I),
    "x-fake-output": str(O),
    "x-fake-cache-read": str(CACHE_READ),
    "x-fake-cache-write": str(CACHE_WRITE),
    "x-fake-reasoning": str(REASONING),
    "x-fake-events": "7",
    "x-fake-delay-ms": "1",
}
TEXT = "".join(f"word{i} " for i in range(7))


@pytest.fixture
def llm(procs) -> LlmUpstream:
    return procs.add(LlmUpstream(procs.log_dir)).start()


def post(port: int, path: str, body: dict, headers: dict, timeout: float = 30.0):
    """(status, content type, body bytes, complete): urllib, as any client would read it."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            ctype = r.headers.get("content-type", "")
            try:
                return r.status, ctype, r.read(), True
            except http.client.IncompleteRead as e:
                return r.status, ctype, e.partial, False
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read(), True


# ----------------------------------------------------------------------------- SSE


@dataclass
class Event:
    event: Optional[str]
    data: str


def parse_sse(body: bytes) -> tuple[list[Event], list[str]]:
    """Server-sent events as WHATWG HTML §9.2 reads them: the events, and the comments."""
    events: list[Event] = []
    comments: list[str] = []
    name: Optional[str] = None
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", body.decode("utf-8")):
        if line == "":
            if data:
                events.append(Event(name, "\n".join(data)))
            name, data = None, []
        elif line.startswith(":"):
            comments.append(line[1:].strip())
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    return events, comments


def loads_all(events: list[Event]) -> list[dict]:
    return [json.loads(e.data) for e in events]


# ----------------------------------------------------------------------------- the shapes


def check_openai_usage(u: dict) -> None:
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (I, O, I + O), u
    assert u["prompt_tokens_details"]["cached_tokens"] == CACHE_READ, u
    assert u["completion_tokens_details"]["reasoning_tokens"] == REASONING, u


def check_responses_usage(u: dict) -> None:
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (I, O, I + O), u
    assert u["input_tokens_details"]["cached_tokens"] == CACHE_READ, u
    assert u["output_tokens_details"]["reasoning_tokens"] == REASONING, u


def check_anthropic_input(u: dict) -> None:
    # input_tokens is what the cache neither gave nor took: the three add up to the input.
    assert u["input_tokens"] == I - CACHE_READ - CACHE_WRITE, u
    assert u["cache_read_input_tokens"] == CACHE_READ, u
    assert u["cache_creation_input_tokens"] == CACHE_WRITE, u


def check_gemini_usage(u: dict, final: bool = True) -> None:
    assert u["promptTokenCount"] == I and u["cachedContentTokenCount"] == CACHE_READ, u
    assert u["thoughtsTokenCount"] == REASONING, u
    assert u["totalTokenCount"] == I + REASONING + u.get("candidatesTokenCount", 0), u
    if final:
        assert u["candidatesTokenCount"] + u["thoughtsTokenCount"] == O, u
        assert u["totalTokenCount"] == I + O, u


def openai_chat_json(body: bytes) -> None:
    doc = json.loads(body)
    assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"] == TEXT, doc
    assert doc["choices"][0]["finish_reason"] == "stop"
    check_openai_usage(doc["usage"])


def openai_chat_sse(body: bytes) -> None:
    events, _ = parse_sse(body)
    assert events[-1].data == "[DONE]", events[-1]
    chunks = loads_all(events[:-1])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # include_usage: every chunk has "usage": null but the last, which has no choices.
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [], chunks[-1]
    check_openai_usage(chunks[-1]["usage"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == TEXT and chunks[-2]["choices"][0]["finish_reason"] == "stop"


def openai_responses_json(body: bytes) -> None:
    doc = json.loads(body)
    assert doc["object"] == "response" and doc["status"] == "completed", doc
    assert doc["output"][0]["content"][0]["text"] == TEXT
    check_responses_usage(doc["usage"])


def openai_responses_sse(body: bytes) -> None:
    events, _ = parse_sse(body)
    docs = loads_all(events)
    assert [e.event for e in events] == [d["type"] for d in docs], "every event: line names its type"
    assert [d["sequence_number"] for d in docs] == list(range(len(docs)))
    assert docs[0]["type"] == "response.created" and docs[-1]["type"] == "response.completed"
    assert "".join(d["delta"] for d in docs if d["type"] == "response.output_text.delta") == TEXT
    assert docs[0]["response"]["usage"] is None
    check_responses_usage(docs[-1]["response"]["usage"])


def anthropic_json(body: bytes) -> None:
    doc = json.loads(body)
    assert doc["type"] == "message" and doc["content"][0]["text"] == TEXT, doc
    check_anthropic_input(doc["usage"])
    assert doc["usage"]["output_tokens"] == O
    assert "total_tokens" not in doc["usage"]  # Anthropic reports no total


def anthropic_sse(body: bytes) -> None:
    events, comments = parse_sse(body)
    docs = loads_all(events)
    kinds = [e.event for e in events]
    assert kinds == [d["type"] for d in docs], "every event: line names its type"
    assert kinds == (
        ["message_start", "content_block_start", "ping"]
        + ["content_block_delta"] * 7
        + ["content_block_stop", "message_delta", "message_stop"]
    ), kinds
    assert "ping" in comments, "`: ping` comment lines"
    start = docs[0]["message"]["usage"]
    check_anthropic_input(start)
    assert start["output_tokens"] == 1
    final = docs[-2]["usage"]
    assert final["output_tokens"] == O  # cumulative: the whole answer's
    check_anthropic_input(final)
    assert "".join(d["delta"]["text"] for d in docs if d["type"] == "content_block_delta") == TEXT


def gemini_json(body: bytes) -> None:
    doc = json.loads(body)
    assert doc["candidates"][0]["content"]["parts"][0]["text"] == TEXT
    assert doc["candidates"][0]["finishReason"] == "STOP"
    check_gemini_usage(doc["usageMetadata"])


def gemini_chunks(docs: list[dict]) -> None:
    assert len(docs) == 7
    seen = [d["usageMetadata"].get("candidatesTokenCount", 0) for d in docs]
    assert seen == sorted(seen), f"cumulative counts: {seen}"
    for d in docs[:-1]:
        check_gemini_usage(d["usageMetadata"], final=False)
    check_gemini_usage(docs[-1]["usageMetadata"])
    assert docs[-1]["candidates"][0]["finishReason"] == "STOP"
    assert "".join(d["candidates"][0]["content"]["parts"][0]["text"] for d in docs) == TEXT


def gemini_sse(body: bytes) -> None:
    assert b"\r\n\r\n" in body and b"\n\n" not in body.replace(b"\r\n", b""), "Google ends lines in CRLF"
    events, _ = parse_sse(body)
    assert all(e.event is None for e in events)
    gemini_chunks(loads_all(events))


def gemini_array(body: bytes) -> None:
    docs = json.loads(body)
    assert isinstance(docs, list), "streamGenerateContent without alt=sse: one JSON array"
    gemini_chunks(docs)


@dataclass(frozen=True)
class Shape:
    name: str
    path: str
    body: dict
    content_type: str
    check: Callable[[bytes], None]

    @property
    def stream(self) -> bool:
        return self.content_type.startswith("text/event-stream") or self.name == "gemini-array"


GEMINI = "/v1beta/models/gemini-2.5-flash"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": [{"role": "user", "content": "hi"}]}
CONTENTS = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
SHAPES = [
    Shape("openai-json", "/v1/chat/completions", CHAT, "application/json", openai_chat_json),
    Shape("openai-sse", "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
          "text/event-stream", openai_chat_sse),  # fmt: skip
    Shape("responses-json", "/v1/responses", {"model": "gpt-4.1", "input": "hi"}, "application/json",
          openai_responses_json),  # fmt: skip
    Shape("responses-sse", "/v1/responses", {"model": "gpt-4.1", "input": "hi", "stream": True}, "text/event-stream",
          openai_responses_sse),  # fmt: skip
    Shape("anthropic-json", "/v1/messages", MESSAGES, "application/json", anthropic_json),
    Shape("anthropic-sse", "/v1/messages", {**MESSAGES, "stream": True}, "text/event-stream", anthropic_sse),
    Shape("gemini-json", f"{GEMINI}:generateContent", CONTENTS, "application/json", gemini_json),
    Shape("gemini-sse", f"{GEMINI}:streamGenerateContent?alt=sse", CONTENTS, "text/event-stream", gemini_sse),
    Shape("gemini-array", f"{GEMINI}:streamGenerateContent", CONTENTS, "application/json", gemini_array),
]
BY_NAME = {s.name: s for s in SHAPES}


# ----------------------------------------------------------------------------- tests


def test_health_and_bad_requests(llm):
    with urllib.request.urlopen(f"http://127.0.0.1:{llm.port}/healthz", timeout=5) as r:
        assert (r.status, r.read()) == (200, b"ok\n")
    assert post(llm.port, "/v1/unknown", {}, {})[0] == 404
    for bad in ({"x-fake-input": "-1"}, {"x-fake-fault": "nonsense"}, {"x-fake-output": "1", "x-fake-reasoning": "2"}):
        assert post(llm.port, "/v1/chat/completions", CHAT, bad)[0] == 400, bad


@pytest.mark.parametrize("stream", [False, True])
def test_usage_header_carries_the_total(llm, stream: bool):
    # x-fake-usage-header: the total also in a header of that name (bench/usage_cost.py).
    body = {**CHAT, "stream": stream, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{llm.port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={**KNOBS, "x-fake-usage-header": "x-llm-tokens"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers.get("x-llm-tokens") == str(I + O)
        r.read()
    no_usage = {**KNOBS, "x-fake-usage-header": "x-llm-tokens", "x-fake-fault": "no-usage"}
    req = urllib.request.Request(req.full_url, data=req.data, headers=no_usage, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers.get("x-llm-tokens") is None
        r.read()
    assert post(llm.port, "/v1/chat/completions", CHAT, {"x-fake-usage-header": "x y"})[0] == 400


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_each_shape_reports_the_chosen_usage(llm, shape: Shape):
    # A prefix before the provider's path, as the gateway tests route them.
    status, ctype, body, complete = post(llm.port, "/any/prefix" + shape.path, shape.body, KNOBS)
    assert (status, complete) == (200, True)
    assert ctype.startswith(shape.content_type), ctype
    shape.check(body)
    # Deterministic: the same request, the same bytes (the gateway tests compare with it).
    assert post(llm.port, shape.path, shape.body, KNOBS)[2] == body


def test_an_openai_stream_without_include_usage_has_no_usage(llm):
    body = {**CHAT, "stream": True}
    status, _, raw, _ = post(llm.port, "/v1/chat/completions", body, KNOBS)
    events, _ = parse_sse(raw)
    assert status == 200 and events[-1].data == "[DONE]"
    assert not any("usage" in c for c in loads_all(events[:-1]))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.stream], ids=lambda s: s.name)
def test_a_stream_leaves_event_by_event(llm, shape: Shape):
    req = urllib.request.Request(
        f"http://127.0.0.1:{llm.port}{shape.path}",
        data=json.dumps(shape.body).encode(),
        headers={"content-type": "application/json", **KNOBS, "x-fake-delay-ms": "150", "x-fake-events": "6"},
        method="POST",
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers.get("transfer-encoding") == "chunked"
        first = r.read1()  # what has arrived: the first event(s), not the whole answer
        t_first = time.monotonic() - t0
        rest = r.read()
    total = time.monotonic() - t0
    assert rest, "the whole stream arrived at once"
    assert total >= 0.7, total  # 5 pauses of 150 ms at least
    # The first event came while the others were still being "generated" (0.35 s of slack
    # for a loaded machine).
    assert t_first < total - 0.4, (t_first, total, first[:200])


def _documents(shape: Shape, body: bytes) -> list[str]:
    """The JSON documents of an answer as text (a stream's events, an array's elements)."""
    if shape.content_type == "text/event-stream":
        return [e.data for e in parse_sse(body)[0] if e.data != "[DONE]"]
    if shape.name == "gemini-array":
        return [part.strip().lstrip("[").rstrip("]").strip() for part in body.decode().split("\r\n,\r\n")]
    return [body.decode()]


def _has_usage(doc: str) -> bool:
    try:
        value = json.loads(doc)
    except ValueError:
        return False
    usage = value.get("usage") or value.get("usageMetadata") or (value.get("message") or {}).get("usage")
    usage = usage or (value.get("response") or {}).get("usage")
    return bool(usage)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_no_usage_fault_omits_every_usage(llm, shape: Shape):
    status, _, body, complete = post(llm.port, shape.path, shape.body, {**KNOBS, "x-fake-fault": "no-usage"})
    docs = _documents(shape, body)
    assert (status, complete) == (200, True) and docs
    for doc in docs:
        json.loads(doc)  # whole
        assert not _has_usage(doc), doc
    for key in (b'"prompt_tokens"', b'"input_tokens"', b'"usageMetadata"', b'"output_tokens"'):
        assert key not in body, key


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_malformed_fault_breaks_every_document_that_carries_usage(llm, shape: Shape):
    status, _, body, complete = post(llm.port, shape.path, shape.body, {**KNOBS, "x-fake-fault": "malformed"})
    assert (status, complete) == (200, True)
    broken = whole = 0
    for doc in _documents(shape, body):
        try:
            json.loads(doc)
        except ValueError:
            broken += 1
            # Broken before any key: nothing in it can be read, usage included.
            assert doc.startswith("{,"), doc[:80]
            assert '"usage' in doc, "the broken documents are those that carried usage"
            continue
        whole += 1
        assert not _has_usage(doc), doc
    assert broken >= 1, "nothing broken"
    if shape.content_type == "text/event-stream" and not shape.name.startswith("gemini"):
        assert whole >= 7, "the events without usage stay whole"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_cut_fault_stops_mid_body_without_the_final_usage(llm, shape: Shape):
    headers = {**KNOBS, "x-fake-fault": "cut", "x-fake-linger-ms": "50"}
    status, _, body, complete = post(llm.port, shape.path, shape.body, headers)
    assert status == 200 and not complete, "the answer must end short of its framing"
    _, _, whole, _ = post(llm.port, shape.path, shape.body, KNOBS)
    assert 0 < len(body) < len(whole) and whole.startswith(body), "what was sent is the answer's beginning"
    if shape.name.startswith("gemini"):
        return  # every Gemini chunk has the usage so far: the last, final one is gone
    for doc in _documents(shape, body):
        try:
            value = json.loads(doc)
        except ValueError:
            continue  # the half event at the cut
        # No final usage: OpenAI's usage chunk, response.completed, message_delta.
        assert not (value.get("usage") and (value.get("usage") or {}).get("output_tokens", 1) != 1), doc
        assert not (value.get("response") or {}).get("usage"), doc
        assert value.get("type") != "message_delta", doc


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_huge_fault_sends_5_mib_with_the_usage_at_the_end(llm, shape: Shape):
    headers = {**KNOBS, "x-fake-fault": "huge", "x-fake-delay-ms": "0"}  # 5,120 pauses would take seconds
    status, _, body, complete = post(llm.port, shape.path, shape.body, headers, timeout=60)
    assert (status, complete) == (200, True)
    assert len(body) >= 5 * 1024 * 1024, len(body)
    docs = _documents(shape, body)
    # The last document, but for Anthropic's stream, which ends in message_stop after the usage.
    final = json.loads(docs[-2] if shape.name == "anthropic-sse" else docs[-1])
    usage = (
        final.get("usage")
        or final.get("usageMetadata")
        or (final.get("response") or {}).get("usage")
    )
    assert usage, docs[-1][-300:]
    if "usageMetadata" in final:
        check_gemini_usage(usage)
    elif "prompt_tokens" in usage:
        check_openai_usage(usage)
    elif shape.name.startswith("responses"):
        check_responses_usage(usage)
    else:
        check_anthropic_input(usage)
        assert usage["output_tokens"] == O
    # The usage comes after the content (the end of a JSON answer; the last events).
    assert body.rfind(b"sage") > len(body) - 2048, "the usage is not at the end"

#!/usr/bin/env python3
"""A fake LLM upstream for Diana's end-to-end tests (issue 42: token budgets charged from
the usage an answer reports in its body). Standard library only.

It answers the way OpenAI, Anthropic and Gemini answer, as one JSON document or as
server-sent events flushed one at a time, and reports exactly the usage the *client* asked
for, so that a test knows what the gateway was told without parsing anything itself.

Endpoints (the path may carry any prefix, e.g. `/openai/v1/chat/completions`, so that a
gateway can route several rules to this one process; only the path's end is looked at):

- `POST .../v1/chat/completions`  OpenAI Chat Completions. Streamed when the request's JSON
  says `"stream": true`; usage then only when `stream_options.include_usage` is true: every
  chunk carries `"usage": null` and one last chunk (`choices: []`) before `data: [DONE]`
  the usage of the whole answer.
- `POST .../v1/responses`  OpenAI Responses API. Streamed (`event:` lines) when
  `"stream": true`; the usage is in `response.completed`'s `response.usage`.
- `POST .../v1/messages`  Anthropic Messages. Streamed when `"stream": true`:
  `message_start` (with `message.usage`: the input and `output_tokens` 1), a
  `content_block_start`, an `event: ping`, the deltas, `content_block_stop`,
  `message_delta` (cumulative `usage.output_tokens`, and the input fields again as the API
  now sends them), `message_stop`; `: ping` comment lines in between.
- `POST .../v1beta/models/<model>:generateContent`  Gemini, one JSON answer.
  `:streamGenerateContent?alt=sse`  Gemini's SSE stream (CRLF line ends, as Google sends
  them): every chunk has the *cumulative* `usageMetadata`.
  `:streamGenerateContent` without `alt=sse`  Gemini's other stream: one JSON array of
  answers, sent element by element.
- `GET /healthz`  200 `ok`.

Request headers that choose the answer (all optional):

| header | default | meaning |
|---|---|---|
| `x-fake-input` | 10 | the call's input tokens, as the provider bills them (all of them) |
| `x-fake-output` | 20 | the call's output tokens, as billed (reasoning/thinking included) |
| `x-fake-cache-read` | 0 | of the input, read from the prompt cache: OpenAI `cached_tokens`, Gemini `cachedContentTokenCount`, Anthropic `cache_read_input_tokens` (Anthropic's `input_tokens` is then the input less the cache's tokens) |
| `x-fake-cache-write` | 0 | of the input, written to the cache: Anthropic `cache_creation_input_tokens` only |
| `x-fake-reasoning` | 0 | of the output, thinking: OpenAI `reasoning_tokens`, Gemini `thoughtsTokenCount` (`candidatesTokenCount` is the rest) |
| `x-fake-events` | 10 | content events (text deltas; the pieces of a JSON answer's text) |
| `x-fake-delay-ms` | 5 (0 with `huge`) | pause before each event after the first, at most 10 s |
| `x-fake-fault` | none | `no-usage`, `malformed`, `cut` or `huge` (below) |
| `x-fake-linger-ms` | 300 | with `cut`: how long the bytes sent stay on the wire before the close |
| `x-fake-usage-header` | none | a header name: the answer also carries that header with the call's total (input + output; not with `no-usage`), as an upstream that reports its cost in a header does (`response_cost.header`; bench/usage_cost.py) |

So for every provider the usage a reader should find is input = `x-fake-input` (Anthropic:
`input_tokens` + `cache_creation_input_tokens` + `cache_read_input_tokens`) and output =
`x-fake-output` (Gemini: `candidatesTokenCount` + `thoughtsTokenCount`), total = input +
output (`total_tokens`, `totalTokenCount`; Anthropic reports none).

Faults:

- `no-usage`: no usage anywhere (no `usage` key, no usage chunk, no `usageMetadata`).
- `malformed`: every document that would carry usage is broken JSON, broken *before* the
  usage key (`{,"id": ...`), so no reader can find usage in it: the whole JSON answer; in
  a stream, OpenAI's usage chunk, `response.completed`, Anthropic's `message_start` and
  `message_delta`, and every Gemini chunk (each carries usage). Other events stay whole.
- `cut`: half of the events are sent, then half of the next one (in a whole HTTP chunk, so
  the gateway has it all), then after `x-fake-linger-ms` the connection is closed without
  the end of the body (no last chunk; a JSON answer short of its content-length).
- `huge`: at least 5,120 content events of 1 KiB (a JSON answer's text 5 MiB), the usage at
  the end as usual.

Every answer is a function of the request alone (no clock, no random ids), so a test can
ask this upstream directly for the bytes it expects the gateway to pass on unchanged.

Usage: llm_upstream.py [--host 127.0.0.1] [--port 18090] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

FAULTS = ("no-usage", "malformed", "cut", "huge")
HUGE_EVENTS = 5120  # x 1 KiB: 5 MiB of content
HUGE_PIECE = 1024
MAX_TOKENS_KNOB = 1_000_000_000
MAX_EVENTS = 200_000
MAX_REQUEST_BODY = 1 << 20
CREATED = 1_700_000_000  # a fixed timestamp: answers must not depend on the clock


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class Knobs:
    """What the client chose (the x-fake-* headers)."""

    input: int = 10
    output: int = 20
    cache_read: int = 0
    cache_write: int = 0
    reasoning: int = 0
    events: int = 10
    delay_s: float = 0.005
    fault: str = ""
    linger_s: float = 0.3
    usage_header: str = ""

    @staticmethod
    def of(headers) -> "Knobs":
        def number(name: str, default: int, high: int) -> int:
            raw = headers.get(name)
            if raw is None:
                return default
            raw = raw.strip()
            if not raw.isdigit() or int(raw) > high:
                raise BadRequest(f"{name}: {raw!r} is not an integer from 0 to {high}")
            return int(raw)

        fault = (headers.get("x-fake-fault") or "").strip()
        if fault and fault not in FAULTS:
            raise BadRequest(f"x-fake-fault: {fault!r} is none of {', '.join(FAULTS)}")
        usage_header = (headers.get("x-fake-usage-header") or "").strip().lower()
        if usage_header and not all(c.isalnum() or c == "-" for c in usage_header):
            raise BadRequest(f"x-fake-usage-header: {usage_header!r} is not a header name")
        k = Knobs(
            input=number("x-fake-input", 10, MAX_TOKENS_KNOB),
            output=number("x-fake-output", 20, MAX_TOKENS_KNOB),
            cache_read=number("x-fake-cache-read", 0, MAX_TOKENS_KNOB),
            cache_write=number("x-fake-cache-write", 0, MAX_TOKENS_KNOB),
            reasoning=number("x-fake-reasoning", 0, MAX_TOKENS_KNOB),
            events=number("x-fake-events", 10, MAX_EVENTS),
            # A huge answer is about size, not pace: no pause unless asked for.
            delay_s=number("x-fake-delay-ms", 0 if fault == "huge" else 5, 10_000) / 1000,
            fault=fault,
            linger_s=number("x-fake-linger-ms", 300, 10_000) / 1000,
            usage_header=usage_header,
        )
        if k.cache_read + k.cache_write > k.input:
            raise BadRequest("x-fake-cache-read + x-fake-cache-write exceed x-fake-input")
        if k.reasoning > k.output:
            raise BadRequest("x-fake-reasoning exceeds x-fake-output")
        return k

    @property
    def usage_on(self) -> bool:
        return self.fault != "no-usage"

    @property
    def broken(self) -> bool:
        return self.fault == "malformed"

    def pieces(self) -> list[str]:
        """The answer's text, one piece per content event."""
        if self.fault == "huge":
            n = max(self.events, HUGE_EVENTS)
            # 1 KiB each, numbered so that a reordered or dropped piece shows in a diff.
            return [f"{i:06d} " + "x" * (HUGE_PIECE - 8) + " " for i in range(n)]
        return [f"word{i} " for i in range(self.events)]


def dumps(doc: object, broken: bool = False) -> str:
    """Compact JSON (as the providers send it); `broken`: a syntax error right after the
    first `{`, before any key, so that nothing in it can be read as usage."""
    text = json.dumps(doc, separators=(",", ":"))
    return "{," + text[1:] if broken else text


def sse(data: str, event: Optional[str] = None, eol: str = "\n") -> bytes:
    lines = ([f"event: {event}"] if event else []) + [f"data: {data}"]
    return (eol.join(lines) + eol + eol).encode()


@dataclass
class Answer:
    """What to send: a content type and the body in pieces (one per event for a stream, a
    single piece for a JSON answer)."""

    content_type: str
    pieces: list[bytes]
    stream: bool


# ------------------------------------------------------------------------------ OpenAI


def openai_chat(req: dict, k: Knobs) -> Answer:
    model = str(req.get("model", "gpt-4o-mini"))
    usage = {
        "prompt_tokens": k.input,
        "completion_tokens": k.output,
        "total_tokens": k.input + k.output,
        "prompt_tokens_details": {"cached_tokens": k.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": k.reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    text = k.pieces()
    if not req.get("stream"):
        doc: dict = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text), "refusal": None, "annotations": []},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
        }
        if k.usage_on:
            doc["usage"] = usage  # after `choices`, as OpenAI orders it
        doc["service_tier"] = "default"
        return Answer("application/json", [dumps(doc, k.broken).encode()], stream=False)
    options = req.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True

    def chunk(choices: list, usage_value: object = None) -> dict:
        c = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "system_fingerprint": "fp_fake",
            "choices": choices,
        }
        if include_usage:
            c["usage"] = usage_value  # null in every chunk but the last
        return c

    def delta(d: dict, finish: Optional[str] = None) -> list:
        return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]

    events = [sse(dumps(chunk(delta({"role": "assistant", "content": "", "refusal": None}))))]
    events += [sse(dumps(chunk(delta({"content": t})))) for t in text]
    events.append(sse(dumps(chunk(delta({}, "stop")))))
    if include_usage and k.usage_on:
        events.append(sse(dumps(chunk([], usage), k.broken)))
    events.append(sse("[DONE]"))
    return Answer("text/event-stream; charset=utf-8", events, stream=True)


def openai_responses(req: dict, k: Knobs) -> Answer:
    model = str(req.get("model", "gpt-4.1"))
    text = k.pieces()
    usage = {
        "input_tokens": k.input,
        "input_tokens_details": {"cached_tokens": k.cache_read},
        "output_tokens": k.output,
        "output_tokens_details": {"reasoning_tokens": k.reasoning},
        "total_tokens": k.input + k.output,
    }
    message = {
        "type": "message",
        "id": "msg_fake",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "".join(text), "annotations": []}],
    }

    def response(status: str, output: list, with_usage: bool) -> dict:
        r = {"id": "resp_fake", "object": "response", "created_at": CREATED, "status": status, "model": model,
             "output": output}  # fmt: skip
        if with_usage:
            r["usage"] = usage if status == "completed" else None
        return r

    if not req.get("stream"):
        body = dumps(response("completed", [message], k.usage_on), k.broken).encode()
        return Answer("application/json", [body], stream=False)
    seq = iter(range(1_000_000_000))

    def event(kind: str, broken: bool = False, **fields: object) -> bytes:
        return sse(dumps({"type": kind, "sequence_number": next(seq), **fields}, broken), event=kind)

    events = [event("response.created", response=response("in_progress", [], True))]
    events.append(event("response.output_item.added", output_index=0,
                        item={**message, "status": "in_progress", "content": []}))  # fmt: skip
    events += [
        event("response.output_text.delta", item_id="msg_fake", output_index=0, content_index=0, delta=t)
        for t in text
    ]
    events.append(event("response.output_text.done", item_id="msg_fake", output_index=0, content_index=0,
                        text="".join(text)))  # fmt: skip
    events.append(event("response.completed", k.broken, response=response("completed", [message], k.usage_on)))
    return Answer("text/event-stream; charset=utf-8", events, stream=True)


# ------------------------------------------------------------------------------ Anthropic


def anthropic_messages(req: dict, k: Knobs) -> Answer:
    model = str(req.get("model", "claude-sonnet-4-5"))
    text = k.pieces()
    # Anthropic's input_tokens counts only what was neither read from nor written to the
    # cache: the three add up to the call's input.
    inputs = {
        "input_tokens": k.input - k.cache_read - k.cache_write,
        "cache_creation_input_tokens": k.cache_write,
        "cache_read_input_tokens": k.cache_read,
    }
    if not req.get("stream"):
        doc: dict = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "".join(text)}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
        }
        if k.usage_on:
            doc["usage"] = {**inputs, "output_tokens": k.output, "service_tier": "standard"}
        return Answer("application/json", [dumps(doc, k.broken).encode()], stream=False)
    message: dict = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
    }
    if k.usage_on:
        # message_start: the input, and an output of 1 (what Anthropic sends).
        message["usage"] = {**inputs, "output_tokens": min(1, k.output)}
    events = [sse(dumps({"type": "message_start", "message": message}, k.broken), "message_start")]
    events.append(sse(dumps({"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}), "content_block_start"))  # fmt: skip
    events.append(sse(dumps({"type": "ping"}), "ping"))
    for i, t in enumerate(text):
        delta = sse(dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
                    "content_block_delta")  # fmt: skip
        # A comment line now and then (keep-alives of proxies and SDK servers): a reader
        # must skip it.
        events.append(b": ping\n\n" + delta if i % 4 == 3 else delta)
    events.append(sse(dumps({"type": "content_block_stop", "index": 0}), "content_block_stop"))
    final: dict = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    if k.usage_on:
        # Cumulative: the whole answer's output (and the input fields again).
        final["usage"] = {**inputs, "output_tokens": k.output}
    events.append(sse(dumps(final, k.broken), "message_delta"))
    events.append(sse(dumps({"type": "message_stop"}), "message_stop"))
    return Answer("text/event-stream; charset=utf-8", events, stream=True)


# ------------------------------------------------------------------------------ Gemini


def gemini_usage(k: Knobs, candidates: int) -> dict:
    """`usageMetadata` with `candidates` output tokens so far (the thoughts come first, all
    of them). proto3 JSON leaves out fields that are 0; totalTokenCount is always written
    (a real call always has a prompt, and an answer of usage 0, which the tests use to give
    a reservation back, must still report usage)."""
    fields = {
        "promptTokenCount": k.input,
        "candidatesTokenCount": candidates,
        "cachedContentTokenCount": k.cache_read,
        "thoughtsTokenCount": k.reasoning,
    }
    out = {key: v for key, v in fields.items() if v}
    out["totalTokenCount"] = k.input + k.reasoning + candidates
    return out


def gemini(req: dict, k: Knobs, model: str, method: str, alt_sse: bool) -> Answer:
    text = k.pieces()
    visible = k.output - k.reasoning

    def answer(parts: list[str], candidates: int, last: bool) -> dict:
        cand: dict = {"content": {"parts": [{"text": "".join(parts)}], "role": "model"}, "index": 0}
        if last:
            cand["finishReason"] = "STOP"
        doc: dict = {"candidates": [cand]}
        if k.usage_on:
            doc["usageMetadata"] = gemini_usage(k, candidates)
        doc["modelVersion"] = model
        doc["responseId"] = "fake"
        return doc

    if method == "generateContent":
        body = dumps(answer(text, visible, True), k.broken).encode()
        return Answer("application/json; charset=UTF-8", [body], stream=False)
    # A stream: one answer per piece (at least one, to carry the usage), each with the
    # cumulative usage; every one carries usage, so `malformed` breaks them all.
    chunks = [[t] for t in text] or [[""]]
    n = len(chunks)
    docs = [dumps(answer(c, visible * (i + 1) // n, i == n - 1), k.broken) for i, c in enumerate(chunks)]
    if alt_sse:
        return Answer("text/event-stream", [sse(d, eol="\r\n") for d in docs], stream=True)
    # Without alt=sse: one JSON array, an element at a time, separated as Google does.
    pieces = [("[" if i == 0 else "\r\n,\r\n") + d for i, d in enumerate(docs)]
    pieces[-1] += "\r\n]"
    return Answer("application/json; charset=UTF-8", [p.encode() for p in pieces], stream=True)


# ------------------------------------------------------------------------------ HTTP


def route(path: str) -> Optional[tuple[str, dict]]:
    """The shape a path asks for, and its parameters; None: not an LLM path."""
    parts = urllib.parse.urlsplit(path)
    p = parts.path.rstrip("/")
    query = urllib.parse.parse_qs(parts.query)
    if p.endswith("/v1/chat/completions"):
        return "openai-chat", {}
    if p.endswith("/v1/responses"):
        return "openai-responses", {}
    if p.endswith("/v1/messages"):
        return "anthropic", {}
    marker = "/v1beta/models/"
    if marker in p:
        model, _, method = p.rsplit(marker, 1)[1].partition(":")
        if method in ("generateContent", "streamGenerateContent"):
            return "gemini", {"model": model, "method": method, "alt_sse": query.get("alt") == ["sse"]}
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "diana-fake-llm/1"
    # Each event leaves in its own small write: without TCP_NODELAY, Nagle and the peer's
    # delayed ACK would hold some of them back ~40 ms and the stream would not be the
    # event-by-event stream the tests mean.
    disable_nagle_algorithm = True
    verbose = False

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), format % args))

    def _read_body(self) -> bytes:
        if (self.headers.get("transfer-encoding") or "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
                if len(out) > MAX_REQUEST_BODY:
                    raise BadRequest("request body too large")
        length = self.headers.get("content-length")
        if length and length.strip().isdigit():
            n = int(length)
            if n > MAX_REQUEST_BODY:
                raise BadRequest("request body too large")
            return self.rfile.read(n)
        return b""

    def _plain(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/healthz":
            self._plain(200, b"ok\n", "text/plain")
        else:
            self._plain(404, b'{"error":"not found"}\n')

    def do_POST(self) -> None:  # noqa: N802
        try:
            raw = self._read_body()
            knobs = Knobs.of(self.headers)
            req = json.loads(raw) if raw.strip() else {}
            if not isinstance(req, dict):
                raise BadRequest("the request body is not a JSON object")
        except (BadRequest, ValueError) as e:
            self._plain(400, (json.dumps({"error": {"message": str(e)}}) + "\n").encode())
            return
        found = route(self.path)
        if found is None:
            self._plain(404, b'{"error":"not found"}\n')
            return
        shape, params = found
        if shape == "openai-chat":
            answer = openai_chat(req, knobs)
        elif shape == "openai-responses":
            answer = openai_responses(req, knobs)
        elif shape == "anthropic":
            answer = anthropic_messages(req, knobs)
        else:
            answer = gemini(req, knobs, **params)
        try:
            self._send(answer, knobs)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client (the gateway) went away: nothing to do

    def _usage_header(self, k: Knobs) -> None:
        if k.usage_header and k.usage_on:
            self.send_header(k.usage_header, str(k.input + k.output))

    def _send(self, answer: Answer, k: Knobs) -> None:
        cut = k.fault == "cut"
        if not answer.stream:
            body = answer.pieces[0]
            self.send_response(200)
            self._usage_header(k)
            self.send_header("content-type", answer.content_type)
            self.send_header("content-length", str(len(body)))  # the whole body's, even when cut
            self.end_headers()
            self.wfile.write(body[: len(body) // 2] if cut else body)
            if cut:
                self._cut(k)
            return
        pieces = answer.pieces
        if cut:
            half = len(pieces) // 2
            pieces = pieces[:half] + [pieces[half][: len(pieces[half]) // 2]]
        chunked = self.request_version != "HTTP/1.0"
        self.send_response(200)
        self._usage_header(k)
        self.send_header("content-type", answer.content_type)
        self.send_header("cache-control", "no-cache")
        if chunked:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("connection", "close")  # an HTTP/1.0 client reads to the close
            self.close_connection = True
        self.end_headers()
        for i, piece in enumerate(pieces):
            if i and k.delay_s:
                time.sleep(k.delay_s)
            # One HTTP chunk per event, written at once (wfile is unbuffered): each event
            # reaches the gateway as it is "generated".
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if cut:
            self._cut(k)
        elif chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _cut(self, k: Knobs) -> None:
        """Closes the connection mid-body. The pause first lets the gateway pass on what it
        was sent, so that a test compares what Diana did with the bytes, not how a proxy
        flushes a connection its upstream dropped."""
        time.sleep(k.linger_s)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def make_server(host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> Server:
    """A server ready for serve_forever() (port 0: any; see server_address)."""
    Handler.verbose = verbose
    return Server((host, port), Handler)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    a = p.parse_args(argv)
    srv = make_server(a.host, a.port, a.verbose)
    print(f"fake LLM upstream listening on http://{a.host}:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

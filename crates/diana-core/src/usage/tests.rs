use super::*;
use proptest::prelude::*;

/// What a reader of an answer, and one of a request, gives.
type Read = Result<Usage, NoValue<Usage>>;
type ReadRequest = Result<u64, NoValue<u64>>;

fn path(text: &str) -> JsonPath {
    match JsonPath::parse(text) {
        Ok(path) => path,
        Err(error) => unreachable!("{text}: {error}"),
    }
}

fn read_chunks<'a>(
    source: &UsageSource,
    framing: Framing,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> Read {
    let mut reader = UsageReader::new(source, framing);
    for chunk in chunks {
        reader.feed(chunk);
    }
    reader.finish()
}

fn read(source: &UsageSource, framing: Framing, body: &[u8]) -> Read {
    read_chunks(source, framing, [body])
}

/// The body read whole, split in two at every offset, and a byte at a time: one result.
fn read_every_way(source: &UsageSource, framing: Framing, body: &[u8]) -> Read {
    let whole = read(source, framing, body);
    for cut in 0..=body.len() {
        let (head, tail) = body.split_at(cut);
        assert_eq!(
            read_chunks(source, framing, [head, tail]),
            whole,
            "split at {cut} of {}",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(
        read_chunks(source, framing, body.chunks(1)),
        whole,
        "a byte at a time: {}",
        String::from_utf8_lossy(body)
    );
    whole
}

fn usage(input: u64, output: u64, total: Option<u64>) -> Usage {
    Usage {
        input,
        output,
        total,
    }
}

// ---------------------------------------------------------------------------------------
// Answers shaped as the providers send them.

const OPENAI_JSON: &str = r#"{
  "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4.1-2025-04-14",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "The usage object looks like {\"usage\": {\"total_tokens\": 999}}.",
        "refusal": null,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bill", "arguments": "{\"usage\":{\"prompt_tokens\":7}}"}}],
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 3, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 4, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default"
}"#;

const OPENAI_SSE: &str = concat!(
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\\\"usage\\\": {\\\"total_tokens\\\": 5}\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_1\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_1\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21,\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n",
    "\n",
    "data: [DONE]\n",
    "\n",
);

const OPENAI_RESPONSES_JSON: &str = r#"{"id":"resp_1","object":"response","created_at":1741476542,"status":"completed","model":"gpt-4.1","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"In a peaceful grove...","annotations":[]}]}],"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},"output_tokens":87,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":123}}"#;

const OPENAI_RESPONSES_SSE: &str = concat!(
    "event: response.created\n",
    "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n",
    "\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n",
    "\n",
    "event: response.completed\n",
    "data: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":87,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":123}}}\n",
    "\n",
);

const OPENAI_EMBEDDINGS_JSON: &str = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.0023064255,-0.009327292,-0.0028842222]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":8,"total_tokens":8}}"#;

const ANTHROPIC_JSON: &str = r#"{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"text","text":"Hi! My name is Claude."},{"type":"tool_use","id":"toolu_1","name":"report","input":{"usage":{"input_tokens":1,"output_tokens":1}}}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2095,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":503,"service_tier":"standard"}}"#;

const ANTHROPIC_SSE: &str = concat!(
    "event: message_start\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n",
    "\n",
    "event: content_block_start\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n",
    "\n",
    "event: ping\n",
    "data: {\"type\": \"ping\"}\n",
    "\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n",
    "\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n",
    "\n",
    "event: content_block_stop\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\n",
    "\n",
    "event: message_delta\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\n",
    "\n",
    "event: message_stop\n",
    "data: {\"type\":\"message_stop\"}\n",
    "\n",
);

/// Google's streams end lines in CRLF.
const GEMINI_SSE: &str = concat!(
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 8,\"totalTokenCount\": 8,\"thoughtsTokenCount\": 5},\"modelVersion\": \"gemini-2.5-flash\"}\r\n",
    "\r\n",
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" sky is blue\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 8,\"candidatesTokenCount\": 12,\"totalTokenCount\": 45,\"thoughtsTokenCount\": 25},\"modelVersion\": \"gemini-2.5-flash\"}\r\n",
    "\r\n",
);

const GEMINI_JSON: &str = r#"{
  "candidates": [{"content": {"parts": [{"text": "usageMetadata is where the count is"}], "role": "model"}, "finishReason": "STOP", "index": 0}],
  "usageMetadata": {
    "promptTokenCount": 11,
    "candidatesTokenCount": 5,
    "toolUsePromptTokenCount": 3,
    "thoughtsTokenCount": 7,
    "totalTokenCount": 26,
    "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 11}]
  },
  "modelVersion": "gemini-2.5-flash"
}"#;

/// `streamGenerateContent` without `alt=sse`: one JSON array of answers.
const GEMINI_JSON_ARRAY: &str = "[{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The\"}],\"role\": \"model\"}}],\"usageMetadata\": {\"promptTokenCount\": 8,\"totalTokenCount\": 8}}\r\n,\r\n{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" end\"}],\"role\": \"model\"},\"finishReason\": \"STOP\"}],\"usageMetadata\": {\"promptTokenCount\": 8,\"candidatesTokenCount\": 2,\"totalTokenCount\": 10}}\r\n]";

type Case = (&'static str, UsageSource, Framing, &'static str, Read);

#[rustfmt::skip]
fn provider_cases() -> Vec<Case> {
    use Framing::{Json, Sse};
    use UsageSource::{Anthropic, Gemini, OpenAi};
    let total = |text| UsageSource::JsonPath(path(text));
    vec![
        ("openai chat", OpenAi, Json, OPENAI_JSON, Ok(usage(19, 10, Some(29)))),
        ("openai stream", OpenAi, Sse, OPENAI_SSE, Ok(usage(9, 12, Some(21)))),
        ("openai responses", OpenAi, Json, OPENAI_RESPONSES_JSON, Ok(usage(36, 87, Some(123)))),
        ("openai responses stream", OpenAi, Sse, OPENAI_RESPONSES_SSE, Ok(usage(36, 87, Some(123)))),
        ("openai embeddings", OpenAi, Json, OPENAI_EMBEDDINGS_JSON, Ok(usage(8, 0, Some(8)))),
        ("anthropic", Anthropic, Json, ANTHROPIC_JSON, Ok(usage(3195, 503, None))),
        ("anthropic stream", Anthropic, Sse, ANTHROPIC_SSE, Ok(usage(35, 15, None))),
        ("gemini", Gemini, Json, GEMINI_JSON, Ok(usage(14, 12, Some(26)))),
        ("gemini stream", Gemini, Sse, GEMINI_SSE, Ok(usage(8, 37, Some(45)))),
        ("gemini array", Gemini, Json, GEMINI_JSON_ARRAY, Ok(usage(8, 2, Some(10)))),
        ("json path", total("usage.total_tokens"), Json, OPENAI_JSON, Ok(usage(0, 0, Some(29)))),
        ("json path, stream", total("usage.total_tokens"), Sse, OPENAI_SSE, Ok(usage(0, 0, Some(21)))),
        ("json path, nested", total("response.usage.output_tokens"), Sse, OPENAI_RESPONSES_SSE, Ok(usage(0, 0, Some(87)))),
        // The wrong provider finds nothing of its own.
        ("anthropic source on gemini", Anthropic, Json, GEMINI_JSON, Err(NoValue::Absent)),
        ("gemini source on openai", Gemini, Sse, OPENAI_SSE, Err(NoValue::Absent)),
    ]
}

#[test]
fn each_provider_s_answers_give_their_usage_however_they_are_split() {
    for (name, source, framing, body, expected) in provider_cases() {
        assert_eq!(
            read_every_way(&source, framing, body.as_bytes()),
            expected,
            "{name}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn chunks_of_any_sizes_give_the_same_usage(cuts in proptest::collection::vec(0usize..4096, 0..24)) {
        for (name, source, framing, body, expected) in provider_cases() {
            let body = body.as_bytes();
            let mut offsets: Vec<usize> = cuts.iter().map(|cut| cut % (body.len() + 1)).collect();
            offsets.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for to in offsets {
                chunks.push(&body[from..to]);
                from = to;
            }
            chunks.push(&body[from..]);
            prop_assert_eq!(read_chunks(&source, framing, chunks), expected, "{}", name);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Streams.

#[test]
fn sse_line_endings_comments_and_fields_are_read_as_the_standard_says() {
    let source = UsageSource::JsonPath(path("usage.total_tokens"));
    let cases: &[(&str, &str, Read)] = &[
        ("lf", "data: {\"usage\":{\"total_tokens\":7}}\n\n", Ok(usage(0, 0, Some(7)))),
        ("crlf", "data: {\"usage\":{\"total_tokens\":7}}\r\n\r\n", Ok(usage(0, 0, Some(7)))),
        ("cr", "data: {\"usage\":{\"total_tokens\":7}}\r\r", Ok(usage(0, 0, Some(7)))),
        ("no space after the colon", "data:{\"usage\":{\"total_tokens\":7}}\n\n", Ok(usage(0, 0, Some(7)))),
        ("two spaces: the second is data", "data:  {\"usage\":{\"total_tokens\":7}}\n\n", Ok(usage(0, 0, Some(7)))),
        (
            "comments and other fields",
            ": ping\n\nevent: x\nid: 1\nretry: 100\n: a comment with data: {\"usage\":{\"total_tokens\":1}}\ndata: {\"usage\":{\"total_tokens\":7}}\n\n: ping\n\n",
            Ok(usage(0, 0, Some(7))),
        ),
        (
            "a data line split in two: joined with a line feed",
            "data: {\"usage\":\ndata: {\"total_tokens\": 7}}\n\n",
            Ok(usage(0, 0, Some(7))),
        ),
        (
            "a bare data line adds a line feed",
            "data: {\"usage\":\ndata\ndata: {\"total_tokens\": 7}}\n\n",
            Ok(usage(0, 0, Some(7))),
        ),
        (
            "a string cannot span data lines",
            "data: {\"usage\":{\"total_tokens\":7,\"x\":\"a\ndata: b\"}}\n\n",
            Err(NoValue::Malformed(Malformed {
                at: 39,
                problem: Problem::ControlCharacter(b'\n'),
            })),
        ),
        (
            "fields that only start like data",
            "dat: {\"usage\":{\"total_tokens\":1}}\ndatax: {\"usage\":{\"total_tokens\":2}}\nData: {\"usage\":{\"total_tokens\":3}}\n\n",
            Err(NoValue::Absent),
        ),
        ("byte-order mark", "\u{feff}data: {\"usage\":{\"total_tokens\":7}}\n\n", Ok(usage(0, 0, Some(7)))),
        (
            "the last event wins",
            "data: {\"usage\":{\"total_tokens\":7}}\n\ndata: {\"usage\":{\"total_tokens\":9}}\n\n",
            Ok(usage(0, 0, Some(9))),
        ),
        (
            "an event without the path keeps the earlier value",
            "data: {\"usage\":{\"total_tokens\":7}}\n\ndata: {\"usage\":null}\n\ndata: {}\n\n",
            Ok(usage(0, 0, Some(7))),
        ),
        ("only [DONE]", "data: [DONE]\n\n", Err(NoValue::Absent)),
        (
            "not quite [DONE]",
            "data: [DONE] \n\n",
            Err(NoValue::Malformed(Malformed {
                at: 7,
                problem: Problem::Unexpected(b'D'),
            })),
        ),
        (
            "a broken event is skipped when another has usage",
            "data: {\"usage\":{\"total_tokens\":1}\n\ndata: {\"usage\":{\"total_tokens\":7}}\n\ndata: oops\n\n",
            Ok(usage(0, 0, Some(7))),
        ),
        (
            "an event whose JSON is not whole is broken, the first one reported",
            "data: {\"usage\":{\"total_tokens\":1}\n\ndata: oops\n\n",
            Err(NoValue::Malformed(Malformed {
                at: 34,
                problem: Problem::Unfinished,
            })),
        ),
        (
            "a broken event's values are not taken",
            "data: {\"usage\":{\"total_tokens\":1}} x\n\n",
            Err(NoValue::Malformed(Malformed {
                at: 35,
                problem: Problem::Unexpected(b'x'),
            })),
        ),
        (
            "the last event may lack its blank line",
            "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":7}}",
            Ok(usage(0, 0, Some(7))),
        ),
        (
            "cut inside an event: what the whole events gave",
            "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":7}",
            Err(NoValue::CutShort {
                seen: Some(usage(0, 0, Some(1))),
            }),
        ),
        ("cut inside the first event", "data: {\"usage\":{\"total_tok", Err(NoValue::CutShort { seen: None })),
        ("empty stream", "", Err(NoValue::Absent)),
        ("only comments", ": ping\r\n\r\n: ping\r\n\r\n", Err(NoValue::Absent)),
        ("an empty data", "data:\n\ndata: \n\n", Err(NoValue::Absent)),
    ];
    for (name, body, expected) in cases {
        assert_eq!(
            &read_every_way(&source, Framing::Sse, body.as_bytes()),
            expected,
            "{name}"
        );
    }
}

#[test]
fn anthropic_fields_keep_their_last_values_across_events() {
    let stream = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":30,\"cache_read_input_tokens\":5,\"output_tokens\":15}}\n\n",
    );
    assert_eq!(
        read_every_way(&UsageSource::Anthropic, Framing::Sse, stream.as_bytes()),
        Ok(usage(35, 15, None))
    );
    // Cut after the output was counted: what was seen is there for the caller.
    let cut = &stream[..stream.len() - 20];
    assert_eq!(
        read(&UsageSource::Anthropic, Framing::Sse, cut.as_bytes()),
        Err(NoValue::CutShort {
            seen: Some(usage(25, 9, None))
        })
    );
}

#[test]
fn each_gemini_usage_object_replaces_the_one_before_as_a_whole() {
    let stream = concat!(
        "data: {\"usageMetadata\": {\"promptTokenCount\": 8, \"thoughtsTokenCount\": 5, \"totalTokenCount\": 13}}\r\n\r\n",
        "data: {\"usageMetadata\": {\"promptTokenCount\": 8, \"candidatesTokenCount\": 4, \"totalTokenCount\": 12}}\r\n\r\n",
    );
    assert_eq!(
        read_every_way(&UsageSource::Gemini, Framing::Sse, stream.as_bytes()),
        Ok(usage(8, 4, Some(12)))
    );
}

// ---------------------------------------------------------------------------------------
// JSON.

#[test]
fn malformed_json_is_reported_where_it_breaks() {
    let source = UsageSource::JsonPath(path("usage.total_tokens"));
    let broken = |at, problem| Err(NoValue::Malformed(Malformed { at, problem }));
    let cases: &[(&str, Read)] = &[
        (r#"{"a" 1}"#, broken(5, Problem::Unexpected(b'1'))),
        (r#"{"a":1,}"#, broken(7, Problem::Unexpected(b'}'))),
        (r#"[1,]"#, broken(3, Problem::Unexpected(b']'))),
        (r#"[1 2]"#, broken(3, Problem::Unexpected(b'2'))),
        (r#"{"a":01}"#, broken(6, Problem::Unexpected(b'1'))),
        ("{\"a\":\"\u{1}\"}", broken(6, Problem::ControlCharacter(1))),
        (r#"{"a":"\q"}"#, broken(7, Problem::BadEscape)),
        (r#"{"a":"\u12G4"}"#, broken(10, Problem::BadEscape)),
        (r#"{"a":1.}"#, broken(7, Problem::BadNumber)),
        (r#"{"a":-}"#, broken(6, Problem::BadNumber)),
        (r#"{"a":1e}"#, broken(7, Problem::BadNumber)),
        (r#"{"a":tru}"#, broken(8, Problem::Unexpected(b'}'))),
        (r#"{"a":1}}"#, broken(7, Problem::Unexpected(b'}'))),
        (r#"{"a":1]"#, broken(6, Problem::Unexpected(b']'))),
        (r#"{1:2}"#, broken(1, Problem::Unexpected(b'1'))),
        (r#"{"a":1} x"#, broken(8, Problem::Unexpected(b'x'))),
        ("]", broken(0, Problem::Unexpected(b']'))),
        ("data: {}", broken(0, Problem::Unexpected(b'd'))),
        (
            // Two documents: a JSON body is one.
            r#"{"usage":{"total_tokens":5}} {"usage":{"total_tokens":6}}"#,
            broken(29, Problem::Unexpected(b'{')),
        ),
        // Broken after the usage: the body is still broken.
        (
            r#"{"usage":{"total_tokens":5},]"#,
            broken(28, Problem::Unexpected(b']')),
        ),
        ("", Err(NoValue::Absent)),
        (" \r\n\t", Err(NoValue::Absent)),
        (
            r#"{"usage":{"total_tokens":5}"#,
            Err(NoValue::CutShort {
                seen: Some(usage(0, 0, Some(5))),
            }),
        ),
        (
            r#"{"usage":{"total_tokens":5"#,
            Err(NoValue::CutShort { seen: None }),
        ),
        (r#"{"usage":"#, Err(NoValue::CutShort { seen: None })),
        // A document that is one number is whole at its end.
        ("12", Err(NoValue::Absent)),
        ("12.5e+3", Err(NoValue::Absent)),
    ];
    for (body, expected) in cases {
        assert_eq!(
            &read_every_way(&source, Framing::Json, body.as_bytes()),
            expected,
            "{body}"
        );
    }
}

#[test]
fn a_value_at_a_usage_path_must_be_a_token_count() {
    let source = UsageSource::OpenAi;
    let invalid = |problem| {
        Err(NoValue::Invalid(InvalidValue {
            path: "usage.completion_tokens".into(),
            problem,
        }))
    };
    let cases: &[(&str, Read)] = &[
        ("5", Ok(usage(1, 5, None))),
        ("5.0", Ok(usage(1, 5, None))),
        ("0", Ok(usage(1, 0, None))),
        ("18446744073709551615", Ok(usage(1, u64::MAX, None))),
        ("null", Ok(usage(1, 0, None))),
        ("[5]", Ok(usage(1, 5, None))),
        ("[]", Ok(usage(1, 0, None))),
        ("18446744073709551616", invalid(NumberProblem::TooLarge)),
        (
            "99999999999999999999999999",
            invalid(NumberProblem::TooLarge),
        ),
        ("-5", invalid(NumberProblem::Negative)),
        ("-0", invalid(NumberProblem::Negative)),
        ("1.5", invalid(NumberProblem::NotAnInteger)),
        ("1e3", invalid(NumberProblem::NotAnInteger)),
        ("\"5\"", invalid(NumberProblem::NotANumber)),
        ("true", invalid(NumberProblem::NotANumber)),
        ("false", invalid(NumberProblem::NotANumber)),
        ("{\"n\": 5}", invalid(NumberProblem::NotANumber)),
    ];
    for (value, expected) in cases {
        let body =
            format!("{{\"usage\": {{\"prompt_tokens\": 1, \"completion_tokens\": {value}}}}}");
        assert_eq!(
            &read_every_way(&source, Framing::Json, body.as_bytes()),
            expected,
            "{body}"
        );
    }
    // The last of duplicate keys wins, also over an invalid one.
    let body = r#"{"usage": {"completion_tokens": "x", "completion_tokens": 4}}"#;
    assert_eq!(
        read(&source, Framing::Json, body.as_bytes()),
        Ok(usage(0, 4, None))
    );
}

#[test]
fn only_the_key_path_from_the_top_counts() {
    let source = UsageSource::JsonPath(path("usage.total_tokens"));
    let cases: &[(&str, Read)] = &[
        // In strings: text, not keys.
        (
            r#"{"content": "{\"usage\": {\"total_tokens\": 9}}"}"#,
            Err(NoValue::Absent),
        ),
        (r#"{"usage\"": {"total_tokens": 9}}"#, Err(NoValue::Absent)),
        // Deeper in the answer.
        (
            r#"{"choices": [{"usage": {"total_tokens": 9}}]}"#,
            Err(NoValue::Absent),
        ),
        (
            r#"{"x": {"usage": {"total_tokens": 9}}}"#,
            Err(NoValue::Absent),
        ),
        // Keys that only start or end like the path's.
        (
            r#"{"usages": {"total_tokens": 9}, "usage": {"total_tokens_x": 8, "total": 7}}"#,
            Err(NoValue::Absent),
        ),
        (r#"{"usage.total_tokens": 9}"#, Err(NoValue::Absent)),
        (
            r#"{"usage": {"total_tokens": {"total_tokens": 9}}}"#,
            Err(NoValue::Invalid(InvalidValue {
                path: "usage.total_tokens".into(),
                problem: NumberProblem::NotANumber,
            })),
        ),
        // Escaped keys are read as they decode.
        (
            r#"{"\u0075sage": {"total_\u0074okens": 9}}"#,
            Ok(usage(0, 0, Some(9))),
        ),
        (
            r#"{"us\u00e9age": {"total_tokens": 9}}"#,
            Err(NoValue::Absent),
        ),
        // Arrays are transparent.
        (
            r#"[{"usage": {"total_tokens": 3}}, [{"usage": [{"total_tokens": 9}]}]]"#,
            Ok(usage(0, 0, Some(9))),
        ),
        // Found anywhere in the document's order, the last wins.
        (
            r#"{"usage": {"total_tokens": 3}, "x": [1, {"a": null}], "usage": {"total_tokens": 4}}"#,
            Ok(usage(0, 0, Some(4))),
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(
            &read_every_way(&source, Framing::Json, body.as_bytes()),
            expected,
            "{body}"
        );
    }
}

#[test]
fn nesting_is_bounded() {
    let source = UsageSource::JsonPath(path("usage.total_tokens"));
    let at_most = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
    assert_eq!(
        read(&source, Framing::Json, at_most.as_bytes()),
        Err(NoValue::Absent)
    );
    let deeper = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
    assert_eq!(
        read(&source, Framing::Json, deeper.as_bytes()),
        Err(NoValue::Malformed(Malformed {
            at: MAX_DEPTH as u64,
            problem: Problem::TooDeep
        }))
    );
    // A usage field below more containers than are followed is not read.
    let followed = format!(
        "{}{{\"usage\":{{\"total_tokens\":5}}}}{}",
        "[".repeat(MAX_FOLLOWED - 2),
        "]".repeat(MAX_FOLLOWED - 2)
    );
    assert_eq!(
        read(&source, Framing::Json, followed.as_bytes()),
        Ok(usage(0, 0, Some(5)))
    );
    let not_followed = format!(
        "{}{{\"usage\":{{\"total_tokens\":5}}}}{}",
        "[".repeat(MAX_FOLLOWED - 1),
        "]".repeat(MAX_FOLLOWED - 1)
    );
    assert_eq!(
        read(&source, Framing::Json, not_followed.as_bytes()),
        Err(NoValue::Absent)
    );
}

#[test]
fn a_huge_answer_is_read_through_with_the_usage_at_its_end() {
    // 16 MiB of content, fed in 64 KiB chunks: the reader keeps its size and the usage at
    // the end is found.
    let text = "usage ".repeat(16 << 20 >> 3);
    let body = format!(
        "{{\"choices\":[{{\"message\":{{\"content\":\"{text}\\\"usage\\\"\"}}}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}}}"
    );
    let mut reader = UsageReader::new(&UsageSource::OpenAi, Framing::Json);
    for chunk in body.as_bytes().chunks(64 << 10) {
        reader.feed(chunk);
    }
    assert_eq!(reader.bytes_read(), body.len() as u64);
    assert_eq!(reader.finish(), Ok(usage(3, 4, Some(7))));
    // Likewise a stream of many events.
    let event = "data: {\"choices\":[{\"delta\":{\"content\":\"token \"}}],\"usage\":null}\n\n";
    let mut reader = UsageReader::new(&UsageSource::OpenAi, Framing::Sse);
    for _ in 0..100_000 {
        reader.feed(event.as_bytes());
    }
    reader.feed(
        b"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":100000}}\n\ndata: [DONE]\n\n",
    );
    assert_eq!(reader.finish(), Ok(usage(1, 100_000, None)));
}

// ---------------------------------------------------------------------------------------
// Against serde_json.

/// JSON values of ASCII text, with a few keys that are on the path `a.b`.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let key = prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        "[a-c \"\\\\/\n]{0,3}"
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..1000).prop_map(Value::from),
        "[ -~\t\n\u{1}]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec((key.clone(), inner), 0..5)
                .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        ]
    })
}

/// What the reader should find at `keys` in `value`: each value there in document order
/// (arrays transparent, `null` none), the last one deciding.
fn expected_at(
    value: &serde_json::Value,
    keys: &[&str],
    found: &mut Vec<Result<u64, NumberProblem>>,
) {
    use serde_json::Value;
    match (value, keys) {
        (Value::Array(items), _) => {
            for item in items {
                expected_at(item, keys, found);
            }
        }
        (Value::Null, []) => {}
        (Value::Number(number), []) => found.push(match number.as_u64() {
            Some(n) => Ok(n),
            None => Err(NumberProblem::Negative),
        }),
        (_, []) => found.push(Err(NumberProblem::NotANumber)),
        (Value::Object(entries), [key, rest @ ..]) => {
            if let Some(inner) = entries.get(*key) {
                expected_at(inner, rest, found);
            }
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_document_gives_the_value_serde_json_has_at_the_path(value in json_value()) {
        let body = serde_json::to_vec(&value).unwrap_or_default();
        let mut found = Vec::new();
        expected_at(&value, &["a", "b"], &mut found);
        let expected = match found.last() {
            None => Err(NoValue::Absent),
            Some(Ok(n)) => Ok(usage(0, 0, Some(*n))),
            Some(Err(problem)) => Err(NoValue::Invalid(InvalidValue { path: "a.b".into(), problem: *problem })),
        };
        let source = UsageSource::JsonPath(path("a.b"));
        prop_assert_eq!(read(&source, Framing::Json, &body), expected.clone());
        // Pretty-printed, and as an event of a stream.
        let pretty = serde_json::to_vec_pretty(&value).unwrap_or_default();
        prop_assert_eq!(read(&source, Framing::Json, &pretty), expected.clone());
        let event = [b"data: ".as_slice(), &body, b"\r\n\r\n"].concat();
        prop_assert_eq!(read(&source, Framing::Sse, &event), expected);
    }

    #[test]
    fn a_body_is_malformed_exactly_when_serde_json_refuses_it(
        value in json_value(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..3, prop::sample::select(b"{}[]\",:0123456789-+.eE \t\n\\/tfnrulsa".to_vec())), 1..3),
    ) {
        let mut body = serde_json::to_vec(&value).unwrap_or_default();
        for (index, edit, byte) in edits {
            let at = index.index(body.len() + 1);
            match edit {
                0 => body.insert(at, byte),
                1 if at < body.len() => { body.remove(at); }
                _ if at < body.len() => body[at] = byte,
                _ => body.push(byte),
            }
        }
        prop_assume!(!body.iter().all(u8::is_ascii_whitespace));
        let refused = serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_err();
        let outcome = read(&UsageSource::JsonPath(path("a.b")), Framing::Json, &body);
        let broken = matches!(outcome, Err(NoValue::Malformed(_) | NoValue::CutShort { .. }));
        prop_assert_eq!(broken, refused, "{} read as {:?}", String::from_utf8_lossy(&body), outcome);
    }

    #[test]
    fn no_bytes_make_the_reader_fail(body in proptest::collection::vec(any::<u8>(), 0..512), sse in any::<bool>()) {
        let framing = if sse { Framing::Sse } else { Framing::Json };
        for source in [UsageSource::OpenAi, UsageSource::Anthropic, UsageSource::Gemini] {
            let whole = read(&source, framing, &body);
            prop_assert_eq!(read_chunks(&source, framing, body.chunks(7)), whole);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The request side, and the small pieces.

#[test]
fn a_request_reservation_is_the_largest_number_at_its_path() {
    let read_request = |path_text: &str, body: &str| {
        let mut reader = RequestReader::new(&path(path_text));
        for chunk in body.as_bytes().chunks(3) {
            reader.feed(chunk);
        }
        reader.finish()
    };
    let cases: &[(&str, &str, ReadRequest)] = &[
        (
            "max_tokens",
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"max_tokens: 1"}],"max_tokens":512}"#,
            Ok(512),
        ),
        (
            "max_completion_tokens",
            r#"{"max_completion_tokens": 2048, "max_tokens": 1}"#,
            Ok(2048),
        ),
        (
            "generationConfig.maxOutputTokens",
            r#"{"contents":[],"generationConfig":{"temperature":0.2,"maxOutputTokens":800}}"#,
            Ok(800),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": 100, "max_tokens": 90000}"#,
            Ok(90000),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": 90000, "max_tokens": 100}"#,
            Ok(90000),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": 100, "max_tokens": "lots"}"#,
            Ok(100),
        ),
        ("max_tokens", r#"{"messages": []}"#, Err(NoValue::Absent)),
        (
            "max_tokens",
            r#"{"max_tokens": null}"#,
            Err(NoValue::Absent),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": "512"}"#,
            Err(NoValue::Invalid(InvalidValue {
                path: "max_tokens".into(),
                problem: NumberProblem::NotANumber,
            })),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": 512, "messages": ["#,
            Err(NoValue::CutShort { seen: Some(512) }),
        ),
        // The number may go on.
        (
            "max_tokens",
            r#"{"max_tokens": 512"#,
            Err(NoValue::CutShort { seen: None }),
        ),
        (
            "max_tokens",
            r#"{"max_tokens": 512,,}"#,
            Err(NoValue::Malformed(Malformed {
                at: 19,
                problem: Problem::Unexpected(b','),
            })),
        ),
    ];
    for (path_text, body, expected) in cases {
        assert_eq!(
            &read_request(path_text, body),
            expected,
            "{path_text} in {body}"
        );
    }
}

#[test]
fn json_paths_are_dotted_keys_of_printable_ascii() {
    let cases: &[(&str, Result<&str, JsonPathError>)] = &[
        ("usage.total_tokens", Ok("usage.total_tokens")),
        ("max_tokens", Ok("max_tokens")),
        ("a-b.$c.0", Ok("a-b.$c.0")),
        ("", Err(JsonPathError::Empty)),
        (".a", Err(JsonPathError::EmptySegment { index: 0 })),
        ("a.", Err(JsonPathError::EmptySegment { index: 1 })),
        ("a..b", Err(JsonPathError::EmptySegment { index: 1 })),
        (
            "a b",
            Err(JsonPathError::Character {
                character: ' ',
                at: 1,
            }),
        ),
        (
            "usagé",
            Err(JsonPathError::Character {
                character: 'é',
                at: 4,
            }),
        ),
        (
            "a\tb",
            Err(JsonPathError::Character {
                character: '\t',
                at: 1,
            }),
        ),
    ];
    for (text, expected) in cases {
        let parsed = JsonPath::parse(text);
        assert_eq!(
            parsed.as_ref().map(JsonPath::as_str),
            expected.as_ref().map(|s| *s),
            "{text:?}"
        );
    }
    let long = "a".repeat(JSON_PATH_MAX);
    assert!(JsonPath::parse(&long).is_ok());
    assert_eq!(
        JsonPath::parse(&format!("{long}a")),
        Err(JsonPathError::TooLong {
            length: JSON_PATH_MAX + 1
        })
    );
    assert_eq!(
        JsonPath::parse("a..b").map_err(|e| e.to_string()),
        Err("key 2 of the JSON path is empty".to_string())
    );
}

#[test]
fn providers_are_named_as_the_document_names_them() {
    let cases: &[(&str, Result<UsageSource, UnknownProvider>)] = &[
        ("openai", Ok(UsageSource::OpenAi)),
        ("anthropic", Ok(UsageSource::Anthropic)),
        ("gemini", Ok(UsageSource::Gemini)),
        ("OpenAI", Err(UnknownProvider)),
        ("azure", Err(UnknownProvider)),
        ("", Err(UnknownProvider)),
    ];
    for (name, expected) in cases {
        assert_eq!(&UsageSource::provider(name), expected, "{name}");
    }
}

#[test]
fn only_an_event_stream_is_read_as_events() {
    let cases: &[(&str, Framing)] = &[
        ("text/event-stream", Framing::Sse),
        ("text/event-stream; charset=utf-8", Framing::Sse),
        ("Text/Event-Stream ;charset=utf-8", Framing::Sse),
        (" text/event-stream", Framing::Sse),
        ("application/json", Framing::Json),
        ("application/json; charset=utf-8", Framing::Json),
        ("text/event-streams", Framing::Json),
        ("text/plain", Framing::Json),
        ("", Framing::Json),
    ];
    for (value, expected) in cases {
        assert_eq!(
            Framing::of_content_type(value.as_bytes()),
            *expected,
            "{value}"
        );
    }
}

#[test]
fn weights_price_input_and_output_apart_and_saturate() {
    let cases: &[(u64, u64, Usage, u64)] = &[
        (1, 4, usage(100, 10, Some(110)), 140),
        (1, 1, usage(100, 10, None), 110),
        (0, 1, usage(100, 10, None), 10),
        (3, 15, usage(1_000_000, 200_000, None), 6_000_000),
        (2, 1, usage(u64::MAX / 2 + 1, 0, None), u64::MAX),
        (1, 1, usage(u64::MAX, 1, None), u64::MAX),
        (u64::MAX, u64::MAX, usage(2, 2, None), u64::MAX),
        (5, 5, usage(0, 0, Some(42)), 0),
    ];
    for &(input, output, ref read, expected) in cases {
        assert_eq!(
            Weights { input, output }.cost(read),
            expected,
            "{input}/{output} on {read:?}"
        );
    }
    assert_eq!(usage(3, 4, None).tokens(), 7);
    assert_eq!(usage(3, 4, Some(9)).tokens(), 9);
    assert_eq!(usage(u64::MAX, 4, None).tokens(), u64::MAX);
}

#[test]
fn the_reader_is_small() {
    assert!(std::mem::size_of::<UsageReader>() <= READER_BYTES_MAX);
    assert!(std::mem::size_of::<RequestReader>() <= READER_BYTES_MAX);
}

proptest! {
    #[test]
    fn scanning_eight_bytes_at_a_time_finds_what_a_byte_at_a_time_finds(
        bytes in proptest::collection::vec(prop_oneof![any::<u8>(), 0x20u8..0x7f, Just(b'a')], 0..64),
    ) {
        let naive_string = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        prop_assert_eq!(string_stop(&bytes), naive_string);
        let naive_line = bytes.iter().position(|&b| b == b'\r' || b == b'\n');
        prop_assert_eq!(line_end(&bytes), naive_line);
    }
}

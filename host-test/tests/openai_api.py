"""The unmodified `openai` client against the edge: embeddings, Responses (plain and
streamed) and legacy completions.

argv: base URL, API key, then a JSON list of calls, each {"kind": "embeddings" |
"responses" | "responses_stream" | "completions", "input": ..., "model": ..., "store": ...}.
Prints one JSON line: for each call what the client read (its text or the embedding's
length and first values, the usage, the object id) and the edge's headers."""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
results = []
for call in json.loads(sys.argv[3]):
    kind, out = call["kind"], {}
    try:
        if kind == "embeddings":
            raw = client.embeddings.with_raw_response.create(model=call.get("model", "text-embedding-3-small"),
                                                             input=call["input"])
            e = raw.parse()
            out = {"vectors": [len(d.embedding) for d in e.data], "first": [d.embedding[:2] for d in e.data],
                   "indices": [d.index for d in e.data], "usage": e.usage.model_dump()}
        elif kind == "responses":
            raw = client.responses.with_raw_response.create(model=call.get("model", "gpt-4.1"), input=call["input"],
                                                            store=call.get("store", False), temperature=0)
            r = raw.parse()
            out = {"text": r.output_text, "id": r.id, "usage": r.usage.model_dump()}
        elif kind == "responses_stream":
            text, usage, ident = "", None, None
            with client.responses.with_streaming_response.create(
                    model=call.get("model", "gpt-4.1"), input=call["input"], store=call.get("store", False),
                    temperature=0, stream=True) as raw:
                for event in raw.parse():
                    if event.type == "response.output_text.delta":
                        text += event.delta
                    elif event.type == "response.completed":
                        usage, ident = event.response.usage.model_dump(), event.response.id
            out = {"text": text, "id": ident, "usage": usage}
        elif kind == "completions":
            raw = client.completions.with_raw_response.create(model=call.get("model", "gpt-4.1"),
                                                              prompt=call["input"], temperature=0, max_tokens=64)
            c = raw.parse()
            out = {"text": c.choices[0].text, "id": c.id, "usage": c.usage.model_dump()}
        out["cache"] = raw.headers.get("x-holysheep-cache")
        out["tenant"] = raw.headers.get("x-holysheep-tenant")
        out["status"] = 200
    except openai.APIStatusError as e:
        out = {"status": e.status_code, "code": (e.body or {}).get("code") if isinstance(e.body, dict) else None}
    results.append(out)
print(json.dumps(results))

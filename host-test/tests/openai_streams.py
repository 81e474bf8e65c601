"""The unmodified `openai` client reading completions and Responses, streamed and plain.

argv: base URL, API key, then a JSON list of steps. A step is a call, or a list of calls
made at once (each on its own thread). A call: {"api": "responses" | "completions",
"input": str, "stream": bool, "logprobs": bool}.

A streamed Responses call goes through `client.responses.stream`, whose accumulator checks
every event against the ones before it (an item added before its content, identities that
never change) and raises on any mismatch; a streamed completion through
`client.completions.create(stream=True)`.

Prints one JSON line: for each call, in order, the edge's `x-holysheep-cache` header and
the object the client ended with (a plain call's answer; a stream's `response.completed`
response, or its chunks accumulated as the SDK documents it: texts appended, log
probability lists extended). For a stream also: its event types with repeats collapsed,
whether the sequence numbers run from 0 without a gap, the text and log probabilities its
deltas carried, and the SDK's own final `output_text`."""
import json
import sys
import threading

import httpx2
import openai

BASE, KEY = sys.argv[1], sys.argv[2]
INCLUDE = ["message.output_text.logprobs"]


def client(seen):
    """A client whose every answer's headers are recorded in `seen`."""
    hook = lambda r: seen.update(r.headers)  # noqa: E731
    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0,
                         http_client=httpx2.Client(event_hooks={"response": [hook]}, timeout=60))


def collapsed(kinds):
    out = []
    for k in kinds:
        if not out or out[-1] != k:
            out.append(k)
    return out


def unparsed(response):
    """A response as the wire had it: without the `parsed` member the stream helper adds to
    each text part (None without a `text_format`)."""
    for item in response.get("output") or []:
        for part in item.get("content") or []:
            if part.get("parsed", 0) is None:
                del part["parsed"]
    return response


def responses(c, call):
    args = {"model": "gpt-4.1", "input": call["input"], "store": False, "temperature": 0}
    if call.get("logprobs"):
        args["include"] = INCLUDE
    if not call.get("stream"):
        return {"object": c.responses.create(**args).to_dict()}
    kinds, numbers, text, logprobs, final = [], [], "", [], None
    with c.responses.stream(**args) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
                logprobs += [lp.to_dict() for lp in event.logprobs or []]
            elif event.type == "response.completed":
                final = unparsed(event.response.to_dict())
        sdk_text = stream.get_final_response().output_text
    return {"object": final, "events": collapsed(kinds), "sequence": numbers == list(range(len(numbers))),
            "text": text, "logprobs": logprobs, "sdk_text": sdk_text}


def completions(c, call):
    args = {"model": "gpt-4.1", "prompt": call["input"], "temperature": 0, "max_tokens": 64}
    if call.get("logprobs"):
        args["logprobs"] = 2
    if not call.get("stream"):
        return {"object": c.completions.create(**args).to_dict()}
    head, choices, kinds, text = {}, {}, [], ""
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        d = chunk.to_dict()
        kinds.append(d["object"])
        usage = d.pop("usage", None)
        for choice in d.pop("choices"):
            into = choices.setdefault(choice["index"], {"text": ""})
            into["text"] += choice.get("text") or ""
            text += choice.get("text") or "" if choice["index"] == 0 else ""
            lp = choice.get("logprobs")
            if lp is not None:
                was = into.get("logprobs") or {}
                into["logprobs"] = {k: (was.get(k) or []) + v for k, v in lp.items()}
            else:
                into.setdefault("logprobs", None)
            for k, v in choice.items():
                if k not in ("text", "logprobs") and (v is not None or k not in into):
                    into[k] = v
        head.update(d)
        if usage is not None:
            head["usage"] = usage
    head["choices"] = [choices[i] for i in sorted(choices)]
    return {"object": head, "events": collapsed(kinds), "text": text}


def run(call, out, at):
    seen = {}
    try:
        c = client(seen)
        result = (responses if call["api"] == "responses" else completions)(c, call)
        result["status"] = 200
    except openai.APIStatusError as e:
        result = {"status": e.status_code}
    result["cache"] = seen.get("x-holysheep-cache")
    out[at] = result


results = []
for step in json.loads(sys.argv[3]):
    calls = step if isinstance(step, list) else [step]
    out = [None] * len(calls)
    threads = [threading.Thread(target=run, args=(call, out, i)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results += out
print(json.dumps(results))

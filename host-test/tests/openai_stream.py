"""The unmodified `openai` client against the edge, streaming and not.

argv: base URL, then a JSON list of calls: {"prompt", "stream", "include_usage", "tools"}.
Prints one JSON line: for each call the text, tool calls, usage, id and the cache header,
as the client assembled them."""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-client", max_retries=0)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
results = []
for call in json.loads(sys.argv[2]):
    kwargs = {"model": "gpt-4.1", "temperature": 0, "messages": [{"role": "user", "content": call["prompt"]}]}
    if call.get("tools"):
        kwargs["tools"] = TOOLS
    if call.get("stream"):
        kwargs["stream"] = True
        if call.get("include_usage") is not None:
            kwargs["stream_options"] = {"include_usage": call["include_usage"]}
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        text, tools, usage, ident = "", {}, None, None
        for chunk in raw.parse():
            ident = chunk.id
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for c in chunk.choices:
                text += c.delta.content or ""
                for t in c.delta.tool_calls or []:
                    slot = tools.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = t.id or slot["id"]
                    if t.function is not None:
                        slot["name"] += t.function.name or ""
                        slot["arguments"] += t.function.arguments or ""
        tools = [tools[i] for i in sorted(tools)]
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        c = raw.parse()
        m = c.choices[0].message
        text, ident = m.content or "", c.id
        usage = c.usage.model_dump() if c.usage else None
        tools = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []]
    usage = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} if usage else None
    results.append({"text": text, "tools": tools, "usage": usage, "id": ident,
                    "cache": raw.headers.get("x-holysheep-cache")})
print(json.dumps(results))

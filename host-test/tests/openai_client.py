"""The unmodified `openai` client against the edge: one call passes, the next is limited.

Prints one JSON line for the Rust test to check."""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-client", max_retries=0)
messages = [{"role": "user", "content": "hello from the openai client"}]
result = {}
first = client.chat.completions.create(model="gpt-4.1", messages=messages, temperature=0)
result["first"] = "ok" if first.choices[0].message.content else "empty"
try:
    client.chat.completions.create(model="gpt-4.1", messages=messages + [{"role": "user", "content": "again"}], temperature=0)
    result["error"] = None
except openai.RateLimitError as e:
    result["error"] = type(e).__name__
    result["status"] = e.status_code
    result["retry_after"] = e.response.headers.get("retry-after")
    result["code"] = (e.body or {}).get("code")
print(json.dumps(result))

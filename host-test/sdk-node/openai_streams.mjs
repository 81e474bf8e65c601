// The unmodified `openai` Node client reading completions and Responses, streamed and
// plain: the Node twin of host-test/tests/openai_streams.py, with the same arguments and
// the same output.
//
// argv: base URL, API key, then a JSON list of steps. A step is a call, or a list of calls
// made at once. A call: {"api": "responses" | "completions", "input", "stream", "logprobs"}.
// A streamed Responses call goes through `client.responses.stream`, whose accumulator
// throws on an event out of place; `finalResponse()` is the SDK's own final object.
import OpenAI from "openai";

const [baseURL, apiKey, steps] = process.argv.slice(2);

// A client whose answers' headers are recorded in `seen`.
function client(seen) {
  const fetchRecording = async (url, init) => {
    const r = await fetch(url, init);
    r.headers.forEach((v, k) => { seen[k] = v; });
    return r;
  };
  return new OpenAI({ baseURL, apiKey, maxRetries: 0, fetch: fetchRecording });
}

// A response as the wire had it: without what the SDK adds (`output_text` on the object,
// `parsed` on each text part of the stream helper's).
function unparsed(response) {
  const { output_text: _, ...wire } = response;
  for (const item of wire.output ?? []) {
    for (const part of item.content ?? []) if (part.parsed === null) delete part.parsed;
  }
  return wire;
}

const collapsed = (kinds) => kinds.filter((k, i) => i === 0 || kinds[i - 1] !== k);

async function responses(c, call) {
  const args = { model: "gpt-4.1", input: call.input, store: false, temperature: 0 };
  if (call.logprobs) args.include = ["message.output_text.logprobs"];
  if (!call.stream) return { object: unparsed(await c.responses.create(args)) };
  const kinds = [], numbers = [];
  let text = "", logprobs = [], final = null;
  const stream = c.responses.stream(args);
  for await (const event of stream) {
    kinds.push(event.type);
    numbers.push(event.sequence_number);
    if (event.type === "response.output_text.delta") {
      text += event.delta;
      logprobs.push(...(event.logprobs ?? []));
    }
    if (event.type === "response.completed") final = unparsed(event.response);
  }
  // The SDK's final response (its text parts joined, as `output_text` of a plain answer).
  const parts = (await stream.finalResponse()).output.flatMap((item) => item.content ?? []);
  const sdkText = parts.filter((p) => p.type === "output_text").map((p) => p.text).join("");
  return { object: final, events: collapsed(kinds), sequence: numbers.every((n, i) => n === i), text, logprobs,
    sdk_text: sdkText };
}

async function completions(c, call) {
  const args = { model: "gpt-4.1", prompt: call.input, temperature: 0, max_tokens: 64 };
  if (call.logprobs) args.logprobs = 2;
  if (!call.stream) return { object: await c.completions.create(args) };
  const head = {}, choices = new Map(), kinds = [];
  let text = "";
  const stream = await c.completions.create({ ...args, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    const { usage, choices: pieces, ...rest } = chunk;
    kinds.push(chunk.object);
    for (const choice of pieces) {
      const into = choices.get(choice.index) ?? { text: "" };
      choices.set(choice.index, into);
      into.text += choice.text ?? "";
      if (choice.index === 0) text += choice.text ?? "";
      if (choice.logprobs != null) {
        const was = into.logprobs ?? {};
        into.logprobs = Object.fromEntries(Object.entries(choice.logprobs).map(([k, v]) => [k, [...(was[k] ?? []), ...v]]));
      } else if (!("logprobs" in into)) into.logprobs = null;
      for (const [k, v] of Object.entries(choice)) {
        if (k !== "text" && k !== "logprobs" && (v != null || !(k in into))) into[k] = v;
      }
    }
    Object.assign(head, rest);
    if (usage != null) head.usage = usage;
  }
  head.choices = [...choices.keys()].sort((a, b) => a - b).map((i) => choices.get(i));
  return { object: head, events: collapsed(kinds), text };
}

async function run(call) {
  const seen = {};
  let result;
  try {
    const c = client(seen);
    result = await (call.api === "responses" ? responses(c, call) : completions(c, call));
    result.status = 200;
  } catch (e) {
    if (!(e instanceof OpenAI.APIError)) throw e;
    result = { status: e.status };
  }
  result.cache = seen["x-holysheep-cache"] ?? null;
  return result;
}

const results = [];
for (const step of JSON.parse(steps)) {
  results.push(...(await Promise.all((Array.isArray(step) ? step : [step]).map(run))));
}
console.log(JSON.stringify(results));

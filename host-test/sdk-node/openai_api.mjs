// The unmodified `openai` Node client against the edge: an embedding, a Responses call
// (plain and streamed, `store: false`) and a legacy completion, each made twice where
// the second can be served from the cache.
//
// argv: base URL, API key. Prints one JSON line: for each call the text (or vector
// length) the client read, its usage, and the edge's `x-holysheep-cache` header.
import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const results = [];

async function record(call) {
  const { data, response } = await call().withResponse();
  return { data, cache: response.headers.get("x-holysheep-cache") };
}

for (let i = 0; i < 2; i++) {
  const e = await record(() =>
    client.embeddings.create({ model: "text-embedding-3-small", input: "node embeds this" }));
  results.push({ kind: "embeddings", cache: e.cache, vectors: e.data.data.map((d) => d.embedding.length) });
}
for (let i = 0; i < 2; i++) {
  const r = await record(() =>
    client.responses.create({ model: "gpt-4.1", input: "node says hello", store: false, temperature: 0 }));
  results.push({ kind: "responses", cache: r.cache, text: r.data.output_text, usage: r.data.usage });
}
const streamed = await client.responses
  .create({ model: "gpt-4.1", input: "node streams", store: false, temperature: 0, stream: true })
  .withResponse();
let text = "";
let usage = null;
for await (const event of streamed.data) {
  if (event.type === "response.output_text.delta") text += event.delta;
  if (event.type === "response.completed") usage = event.response.usage;
}
results.push({ kind: "responses_stream", cache: streamed.response.headers.get("x-holysheep-cache"), text, usage });
for (let i = 0; i < 2; i++) {
  const c = await record(() =>
    client.completions.create({ model: "gpt-4.1", prompt: "node completes", temperature: 0, max_tokens: 32 }));
  results.push({ kind: "completions", cache: c.cache, text: c.data.choices[0].text, usage: c.data.usage });
}
console.log(JSON.stringify(results));

// A Realtime tool round trip with an image through the official Node SDK's Realtime client
// (openai/realtime/ws), then the same two turns over its Chat Completions; then an out-of-band
// response and the item events (retrieve, truncate, delete); prints what came back as one JSON
// object. Run by tests/frameworks/test_node_realtime_tools.py.
import fs from 'node:fs';
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const { BASE_URL, API_KEY, MODEL, PHOTO_FILE } = process.env;
const photo = fs.readFileSync(PHOTO_FILE, 'utf8');
const instructions =
  'You are a weather assistant. Call get_weather to look the weather up; once its result is ' +
  'back, tell the user about it in one plain sentence.';
const parameters = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 20 } },
  required: ['city'],
  additionalProperties: false,
};
const description = 'Get the current weather in the city of the photo.';
const question = 'Where is this? What is the weather like there right now?';
const result = 'Sunny and 21 degrees.';

const client = new OpenAI({ baseURL: BASE_URL, apiKey: API_KEY, maxRetries: 0 });
const rt = new OpenAIRealtimeWS({ model: MODEL }, client);
const queue = [];
let wake = null;
rt.on('event', (event) => {
  queue.push(event);
  if (wake) wake();
});
rt.on('error', () => {}); // error events are read from the queue like any other
await new Promise((resolve, reject) => {
  rt.socket.once('open', resolve);
  rt.socket.once('error', reject);
});

async function until(type, { errors = false } = {}) {
  const seen = [];
  for (;;) {
    while (queue.length === 0) await new Promise((resolve) => (wake = resolve));
    const event = queue.shift();
    if (event.type === 'error' && !(errors && type === 'error')) {
      throw new Error(`error event: ${JSON.stringify(event.error)}`);
    }
    if (event.type === type) return [event, seen];
    seen.push(event);
  }
}

await until('session.created');
rt.send({
  type: 'session.update',
  session: {
    type: 'realtime',
    instructions,
    tools: [{ type: 'function', name: 'get_weather', description, parameters }],
    tool_choice: 'required',
    parallel_tool_calls: false,
  },
});
await until('session.updated');
rt.send({
  type: 'conversation.item.create',
  item: {
    type: 'message',
    role: 'user',
    content: [
      { type: 'input_image', image_url: photo },
      { type: 'input_text', text: question },
    ],
  },
});
const [questionDone] = await until('conversation.item.done');
rt.send({ type: 'response.create', response: { max_output_tokens: 40 } });
const [called, callEvents] = await until('response.done');
const call = called.response.output[0];
const argumentsDone = callEvents.find((e) => e.type === 'response.function_call_arguments.done');
const streamed = callEvents
  .filter((e) => e.type === 'response.function_call_arguments.delta')
  .map((e) => e.delta)
  .join('');
rt.send({
  type: 'conversation.item.create',
  item: { type: 'function_call_output', call_id: call.call_id, output: result },
});
await until('conversation.item.done');
rt.send({ type: 'response.create', response: { tool_choice: 'none', max_output_tokens: 24 } });
const [answered, answerEvents] = await until('response.done');
const text = answerEvents
  .filter((e) => e.type === 'response.output_text.delta')
  .map((e) => e.delta)
  .join('');

// out of band: its own input (a reference to the question, and a message), nothing stored
rt.send({
  type: 'response.create',
  response: {
    conversation: 'none',
    instructions: 'Answer in one word.',
    metadata: { run: 'side' },
    max_output_tokens: 4,
    input: [
      { type: 'item_reference', id: questionDone.item.id },
      { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'Is it sunny?' }] },
    ],
  },
});
const [side, sideEvents] = await until('response.done');
const answerId = answered.response.output[0].id;
rt.send({ type: 'conversation.item.retrieve', item_id: call.id });
const [retrieved] = await until('conversation.item.retrieved');
rt.send({ type: 'conversation.item.truncate', item_id: answerId, content_index: 0, audio_end_ms: 0 });
const [truncated] = await until('conversation.item.truncated');
rt.send({ type: 'conversation.item.delete', item_id: answerId });
const [deleted] = await until('conversation.item.deleted');
rt.send({ type: 'conversation.item.retrieve', item_id: answerId, event_id: 'gone' });
const [gone] = await until('error', { errors: true });
rt.close();

const tools = [{ type: 'function', function: { name: 'get_weather', description, parameters } }];
const asked = [
  { role: 'system', content: instructions },
  {
    role: 'user',
    content: [
      { type: 'image_url', image_url: { url: photo } },
      { type: 'text', text: question },
    ],
  },
];
const first = await client.chat.completions.create({
  model: MODEL,
  messages: asked,
  tools,
  tool_choice: 'required',
  parallel_tool_calls: false,
  max_tokens: 40,
  temperature: 0,
});
const chatCall = first.choices[0].message.tool_calls[0];
const final = await client.chat.completions.create({
  model: MODEL,
  messages: [
    ...asked,
    first.choices[0].message,
    { role: 'tool', tool_call_id: chatCall.id, content: result },
  ],
  tools,
  tool_choice: 'none',
  parallel_tool_calls: false,
  max_tokens: 24,
  temperature: 0,
});

console.log(
  JSON.stringify({
    items: {
      side: side.response,
      side_events: sideEvents.map((e) => e.type),
      retrieved: retrieved.item,
      truncated,
      deleted,
      gone: gone.error,
      answer_id: answerId,
    },
    realtime: {
      call,
      arguments_done: argumentsDone,
      streamed,
      call_usage: called.response.usage,
      answer: answered.response.output[0],
      text,
      answer_usage: answered.response.usage,
    },
    chat: {
      call: chatCall,
      call_usage: first.usage,
      text: final.choices[0].message.content,
      answer_usage: final.usage,
    },
  }),
);

// The official OpenAI Node SDK against a live gateway: chat with an image, the chat stream
// helper, runTools, the Responses API and its stream, and the Realtime WebSocket client
// (`openai/realtime/ws`, which always dials wss://) with an image. Prints one JSON report on
// stdout for tests/frameworks/test_node_sdk.py to check; the CA the gateway's certificate comes
// from is trusted through NODE_EXTRA_CA_CERTS, as a user would.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const { BASE_URL, API_KEY, MODEL, PHOTO_URL } = process.env;
const client = new OpenAI({ baseURL: BASE_URL, apiKey: API_KEY, maxRetries: 0, timeout: 300_000 });
const report = {};

async function check(name, body) {
  try {
    report[name] = await body();
  } catch (err) {
    report[name] = { error: `${err?.constructor?.name}: ${err?.message}` };
  }
}

const look = [
  {
    role: 'user',
    content: [
      { type: 'text', text: 'What is in this photo?' },
      { type: 'image_url', image_url: { url: PHOTO_URL } },
    ],
  },
];
const ask = [{ role: 'user', content: 'Name one colour of the sky.' }];

await check('models', async () => {
  const page = await client.models.list();
  return page.data.map((m) => ({ id: m.id, root: m.root, parent: m.parent }));
});

await check('chat_image', async () => {
  const c = await client.chat.completions.create({ model: MODEL, messages: look, max_tokens: 8 });
  return {
    text: c.choices[0].message.content,
    finish_reason: c.choices[0].finish_reason,
    prompt_tokens: c.usage.prompt_tokens,
    image_tokens: c.usage.prompt_tokens_details?.image_tokens ?? 0,
  };
});

await check('chat_stream', async () => {
  const plain = await client.chat.completions.create({ model: MODEL, messages: ask, max_tokens: 8 });
  const stream = client.chat.completions.stream({ model: MODEL, messages: ask, max_tokens: 8 });
  const deltas = [];
  stream.on('content', (delta) => deltas.push(delta));
  const final = await stream.finalChatCompletion();
  return {
    plain: plain.choices[0].message.content,
    streamed: deltas.join(''),
    final: final.choices[0].message.content,
  };
});

await check('run_tools', async () => {
  const calls = [];
  const runner = client.chat.completions.runTools({
    model: MODEL,
    max_tokens: 48,
    messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
    tools: [
      {
        type: 'function',
        function: {
          name: 'get_weather',
          description: 'Get the current weather in a city',
          parameters: {
            type: 'object',
            properties: { city: { type: 'string' } },
            required: ['city'],
          },
          parse: JSON.parse,
          function: (args) => {
            calls.push(args);
            return `It is sunny and 21 C in ${args.city}.`;
          },
        },
      },
    ],
  });
  const result = await runner.finalFunctionToolCallResult();
  const messages = runner.messages.map((m) => m.role);
  return { calls, result, messages };
});

await check('responses', async () => {
  const r = await client.responses.create({
    model: MODEL,
    input: [
      {
        role: 'user',
        content: [
          { type: 'input_text', text: 'Describe the photo.' },
          { type: 'input_image', image_url: PHOTO_URL },
        ],
      },
    ],
    max_output_tokens: 8,
  });
  const stream = client.responses.stream({
    model: MODEL,
    input: 'Name one colour of the sky.',
    max_output_tokens: 8,
  });
  const deltas = [];
  stream.on('response.output_text.delta', (event) => deltas.push(event.delta));
  const final = await stream.finalResponse();
  const plain = await client.responses.create({
    model: MODEL,
    input: 'Name one colour of the sky.',
    max_output_tokens: 8,
  });
  return {
    text: r.output_text,
    status: r.status,
    input_tokens: r.usage?.input_tokens,
    plain_input_tokens: plain.usage?.input_tokens,
    streamed: deltas.join(''),
    final: final.output_text,
    plain: plain.output_text,
  };
});

await check('realtime', async () => {
  const rt = await OpenAIRealtimeWS.create(client, { model: MODEL });
  const url = rt.url.toString();
  const seen = [];
  const text = [];
  const done = new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('no response.done in 120 s')), 120_000);
    rt.on('error', (err) => {
      clearTimeout(timer);
      reject(err);
    });
    rt.on('event', (event) => seen.push(event.type));
    rt.on('response.output_text.delta', (event) => text.push(event.delta));
    rt.on('response.done', (event) => {
      clearTimeout(timer);
      resolve(event);
    });
  });
  await new Promise((resolve, reject) => {
    rt.socket.once('open', resolve);
    rt.socket.once('error', reject);
  });
  rt.send({ type: 'session.update', session: { type: 'realtime', instructions: 'Be brief.' } });
  rt.send({
    type: 'conversation.item.create',
    item: {
      type: 'message',
      role: 'user',
      content: [
        { type: 'input_image', image_url: PHOTO_URL },
        { type: 'input_text', text: 'Describe the image.' },
      ],
    },
  });
  rt.send({ type: 'response.create', response: { max_output_tokens: 8 } });
  const event = await done;
  rt.close();
  const output = event.response.output[0];
  return {
    url,
    status: event.response.status,
    streamed: text.join(''),
    text: output?.content?.[0]?.text ?? null,
    image_tokens: event.response.usage?.input_token_details?.image_tokens ?? 0,
    seen: [...new Set(seen)],
  };
});

process.stdout.write(JSON.stringify(report) + '\n');

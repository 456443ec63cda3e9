// visiongate playground: a Realtime WebSocket client in plain JavaScript.
// The image is sent as soon as it is picked (so it encodes while the question is typed); each
// answer streams in delta by delta and ends with a line of timings and cache results taken from
// response.done.response.visiongate.
//
// The page never holds a real API key. It connects with an ephemeral Realtime key (ek_...),
// minted for it by the gateway on every connect (POST /playground/session, when the operator set
// PLAYGROUND_API_KEY), or pasted into the settings (one minted with
// POST /v1/realtime/client_secrets); anything else typed there is refused and never sent. On a
// gateway without keys it connects with none.
"use strict";

const $ = (id) => document.getElementById(id);
const SESSION_KEY = "visiongate.session_id";
const EPHEMERAL = /^ek_[A-Za-z0-9_-]{16,}$/;
// close reasons of a refused ephemeral key: a pasted one will not get better by retrying
const KEY_REFUSED = ["unauthorized", "api_key_expired", "api_key_revoked", "permission_denied"];

const ui = {
  status: $("status"), sessionId: $("session-id"), log: $("log"), drop: $("drop"),
  file: $("file-input"), preview: $("preview"), hint: $("drop-hint"), imageStatus: $("image-status"),
  question: $("question"), send: $("send"), stop: $("stop"), composer: $("composer"),
  maxTokens: $("max-tokens"), temperature: $("temperature"), apiKey: $("api-key"),
  newSession: $("new-session"), visionLabel: $("vision-label"),
};

let ws = null;
let sessionId = localStorage.getItem(SESSION_KEY);
let answering = null; // {bubble, text, timings} of the response in progress
let eventSeq = 0;
let retryDelay = 500;
let retryTimer = null;
let connectGen = 0; // a connect superseded while it waited for its key gives up
let keyed = false; // whether the open connection used a key (the HTTP API then wants a real one)
let mintsForUs = null; // null: not asked yet; true/false: whether the gateway mints keys for the page

function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.status.className = "pill " + (kind || "");
}

// what encodes the images (GET /v1/models `vision`): says so when answers are not grounded
async function showVisionLabel() {
  try {
    // without a key: asked on keyless gateways only (an ephemeral key is refused over HTTP)
    const reply = await fetch("/v1/models");
    if (!reply.ok) return;
    const card = ((await reply.json()).data || [])[0] || {};
    if (card.vision) ui.visionLabel.textContent = "vision: " + card.vision;
  } catch (err) {
    // the label is informative only
  }
}

function eventId() {
  eventSeq += 1;
  return "pg_" + Date.now().toString(36) + "_" + eventSeq;
}

function send(event) {
  if (!ws || ws.readyState !== WebSocket.OPEN) {
    addError("not connected; reconnecting…");
    return false;
  }
  event.event_id = eventId();
  ws.send(JSON.stringify(event));
  return true;
}

// ---------------------------------------------------------------- connection

// The key to connect with: the pasted ephemeral key, else one the gateway mints for the page
// (a fresh one each time: they live a minute), else none.
async function ephemeralKey() {
  const pasted = ui.apiKey.value.trim();
  if (pasted) return pasted;
  if (mintsForUs === false) return null;
  try {
    const reply = await fetch("/playground/session", { method: "POST" });
    if (reply.status === 200) {
      mintsForUs = true;
      return (await reply.json()).value;
    }
    if (reply.status === 204) mintsForUs = false; // this gateway mints nothing for the page
    else addError(`the gateway did not mint a key for the page (HTTP ${reply.status})`);
  } catch (err) {
    // unreachable: the WebSocket's close says so
  }
  return null;
}

// Browsers cannot set headers on a WebSocket: the key travels as the Realtime API's
// subprotocol `openai-insecure-api-key.<key>` (never in the URL, which ends up in logs), and the
// server answers with the plain `realtime` one.
async function connect() {
  const gen = ++connectGen;
  setStatus("connecting…", "busy");
  const key = await ephemeralKey();
  if (gen !== connectGen) return;
  const pasted = Boolean(ui.apiKey.value.trim());
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const query = sessionId ? "?" + new URLSearchParams({ session_id: sessionId }) : "";
  const protocols = key ? ["realtime", "openai-insecure-api-key." + key] : ["realtime"];
  let opened = false;
  keyed = Boolean(key);
  ws = new WebSocket(`${proto}//${location.host}/v1/realtime${query}`, protocols);
  ws.onopen = () => { opened = true; };
  ws.onmessage = (msg) => handle(JSON.parse(msg.data));
  ws.onclose = (ev) => {
    setBusy(false);
    if (KEY_REFUSED.includes(ev.reason) && pasted) {
      // the pasted key is unknown, expired or revoked: wait for another rather than retry
      setStatus("key refused", "down");
      addError(`the ephemeral key was refused (${ev.reason}): paste a new one`);
      ws = null;
      return;
    }
    if (ev.code === 1008 && sessionId && !KEY_REFUSED.includes(ev.reason)) {
      // the session is gone (expired or another key's): start a new one
      sessionId = null;
      localStorage.removeItem(SESSION_KEY);
    }
    if (!opened && !key) {
      // refused before the handshake ended, without a key: this gateway wants one
      setStatus("needs an ephemeral key", "down");
    } else {
      setStatus(ev.code === 1013 ? "model loading…" : "disconnected", ev.code === 1013 ? "busy" : "down");
    }
    retryTimer = setTimeout(connect, retryDelay);
    retryDelay = Math.min(retryDelay * 2, 8000);
  };
}

function restart(withSession) {
  sessionId = withSession;
  if (withSession) localStorage.setItem(SESSION_KEY, withSession);
  else localStorage.removeItem(SESSION_KEY);
  // the old socket goes quietly: no reconnect from its close, none pending from an earlier one
  clearTimeout(retryTimer);
  if (ws) { ws.onclose = null; ws.onmessage = null; ws.close(); ws = null; }
  retryDelay = 500;
  setBusy(false);
  ui.log.replaceChildren();
  resetImage();
  connect();
}

// ---------------------------------------------------------------- server events

function handle(event) {
  switch (event.type) {
    case "session.created": {
      retryDelay = 500;
      sessionId = event.session.id;
      localStorage.setItem(SESSION_KEY, sessionId);
      ui.sessionId.textContent = sessionId;
      setStatus("ready · " + event.session.model, "ready");
      if (!keyed) showVisionLabel(); // an ephemeral key is for the WebSocket only
      const ext = event.session.visiongate || {};
      if (ext.resumed) renderHistory(ext.items || []);
      break;
    }
    case "visiongate.image.encoded": {
      const cache = event.cache === "hit" ? '<span class="hit">cache hit</span>'
        : '<span class="miss">encoded</span>';
      ui.imageStatus.innerHTML = `${cache} · ${event.tokens_kept}/${event.tokens_total} visual tokens` +
        (event.cache === "hit" ? "" : ` · ${fmt(event.encode_ms)} ms`);
      ui.imageStatus.dataset.state = "encoded";
      break;
    }
    case "response.created":
      if (!answering) answering = newAnswer();
      answering.id = event.response.id;
      break;
    case "response.output_text.delta":
      if (!answering) answering = newAnswer();
      answering.text.textContent += event.delta;
      scrollDown();
      break;
    case "response.done":
      finishAnswer(event.response);
      break;
    case "error":
      if (answering && !answering.id) {
        // the response never started (e.g. refused): drop its empty bubble
        answering.bubble.remove();
        answering = null;
        setBusy(false);
      }
      addError(`${event.error.code}: ${event.error.message}`);
      if (event.error.code === "busy") setStatus("model loading…", "busy");
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------- chat log

function scrollDown() { ui.log.scrollTop = ui.log.scrollHeight; }

function addUser(text, imageUrl) {
  const div = document.createElement("div");
  div.className = "msg user";
  if (imageUrl) {
    const img = document.createElement("img");
    img.src = imageUrl;
    img.alt = "image";
    div.append(img);
  }
  if (text) div.append(document.createTextNode(text));
  ui.log.append(div);
  scrollDown();
}

function newAnswer() {
  const div = document.createElement("div");
  div.className = "msg assistant";
  const text = document.createElement("div");
  text.className = "text";
  const timings = document.createElement("div");
  timings.className = "timings";
  div.append(text, timings);
  ui.log.append(div);
  scrollDown();
  return { bubble: div, text, timings };
}

function addError(message) {
  const div = document.createElement("div");
  div.className = "msg error";
  div.textContent = message;
  ui.log.append(div);
  scrollDown();
}

function fmt(ms) {
  return ms >= 100 ? Math.round(ms).toString() : (Math.round(ms * 10) / 10).toString();
}

function finishAnswer(response) {
  const answer = answering || newAnswer();
  answering = null;
  setBusy(false);
  const ext = response.visiongate;
  if (response.status === "failed") {
    answer.timings.textContent = "failed";
    return;
  }
  if (!ext) return;
  const t = ext.timings, c = ext.cache;
  const details = (response.usage || {}).input_token_details || {};
  // a miss that cost no wait was encoded ahead of the question (pre-encoding)
  const label = c.vision === "miss" && t.encode_ms === 0 ? "pre-encoded" : c.vision;
  const vision = c.vision === "none" ? "no image"
    : `<span class="${c.vision === "miss" && label !== "pre-encoded" ? "miss" : "hit"}">vision ${label}</span>`;
  answer.timings.innerHTML =
    `encode <b>${fmt(t.encode_ms)} ms</b> · prefill <b>${fmt(t.prefill_ms)} ms</b> · ` +
    `TTFT <b>${fmt(t.ttft_ms)} ms</b> · total <b>${fmt(t.total_ms)} ms</b> · ${vision} · ` +
    `KV reused <b>${c.kv_tokens_reused}</b> tokens` +
    (details.image_tokens ? ` · image tokens ${details.image_tokens}/${ext.image_tokens_total}` : "") +
    (response.status !== "completed" ? ` · ${response.status}` : "");
  answer.timings.dataset.status = response.status;
  scrollDown();
}

function renderHistory(items) {
  ui.log.replaceChildren();
  for (const item of items) {
    const text = (item.content || []).map((p) => p.text || "").join("");
    const hasImage = (item.content || []).some((p) => p.type === "input_image");
    if (item.role === "assistant") newAnswer().text.textContent = text;
    else if (item.role === "user") addUser((hasImage ? "[image] " : "") + text, null);
  }
}

// ---------------------------------------------------------------- image

function resetImage() {
  ui.preview.hidden = true;
  ui.preview.removeAttribute("src");
  ui.hint.hidden = false;
  ui.imageStatus.textContent = "No image yet. Images start encoding as soon as they arrive.";
  delete ui.imageStatus.dataset.state;
}

function sendImage(file) {
  if (!file || !file.type.startsWith("image/")) {
    addError("that is not an image file");
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    const url = reader.result;
    ui.preview.src = url;
    ui.preview.hidden = false;
    ui.hint.hidden = true;
    ui.imageStatus.textContent = `encoding ${file.name} (${Math.round(file.size / 1024)} KiB)…`;
    ui.imageStatus.dataset.state = "encoding";
    if (send({ type: "conversation.item.create",
               item: { type: "message", role: "user", content: [{ type: "input_image", image_url: url }] } })) {
      addUser(null, url);
    }
  };
  reader.readAsDataURL(file);
}

ui.file.addEventListener("change", () => sendImage(ui.file.files[0]));
ui.drop.addEventListener("dragover", (ev) => { ev.preventDefault(); ui.drop.classList.add("over"); });
ui.drop.addEventListener("dragleave", () => ui.drop.classList.remove("over"));
ui.drop.addEventListener("drop", (ev) => {
  ev.preventDefault();
  ui.drop.classList.remove("over");
  sendImage(ev.dataTransfer.files[0]);
});

// ---------------------------------------------------------------- asking

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

ui.composer.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const question = ui.question.value.trim();
  if (!question || ui.send.disabled) return;
  const params = { max_output_tokens: Number(ui.maxTokens.value) || 64 };
  const temperature = Number(ui.temperature.value);
  if (!Number.isNaN(temperature)) params.temperature = temperature;
  if (!send({ type: "conversation.item.create",
              item: { type: "message", role: "user", content: [{ type: "input_text", text: question }] } })) return;
  addUser(question, null);
  ui.question.value = "";
  answering = newAnswer();
  setBusy(true);
  send({ type: "response.create", response: params });
});

ui.question.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.stop.addEventListener("click", () => send({ type: "response.cancel" }));
ui.newSession.addEventListener("click", () => restart(null));
ui.apiKey.addEventListener("change", () => {
  const value = ui.apiKey.value.trim();
  if (value && !EPHEMERAL.test(value)) {
    // never sent anywhere: only an ephemeral key belongs in a page
    ui.apiKey.value = "";
    setStatus("key refused", "down");
    addError("only an ephemeral key (ek_...) goes here, never a real API key: " +
      "mint one with POST /v1/realtime/client_secrets");
    return;
  }
  restart(sessionId);
});

connect();

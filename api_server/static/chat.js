// Tandem's chat page: streams /v1/chat/completions, keeps conversations in localStorage.
"use strict";

const STORE = "tandem.conversations";
const KEY_STORE = "tandem.apiKey";
const TEMPERATURE_STORE = "tandem.temperature";
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let currentId = localStorage.getItem(STORE + ".current");
let controller = null; // AbortController of the stream in flight
let modelName = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  if (currentId) localStorage.setItem(STORE + ".current", currentId);
}

function current() {
  let c = conversations.find((c) => c.id === currentId);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
    conversations.unshift(c);
    currentId = c.id;
    save();
  }
  return c;
}

function showError(text) {
  $("error-text").textContent = text;
  $("error-banner").hidden = false;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.textContent = c.title;
    li.dataset.id = c.id;
    if (c.id === currentId) li.classList.add("active");
    li.onclick = () => { currentId = c.id; save(); render(); $("sidebar").classList.remove("open"); };
    list.appendChild(li);
  }
}

function bubble(message) {
  const div = document.createElement("div");
  div.className = "message " + message.role + (message.stopped ? " stopped" : "");
  div.textContent = message.content;
  return div;
}

function render() {
  renderList();
  const box = $("messages");
  box.replaceChildren(...current().messages.map(bubble));
  box.scrollTop = box.scrollHeight;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { showError("This server needs an API key: enter it in the sidebar."); return; }
    if (!r.ok) { showError(await errorMessage(r)); return; }
    modelName = (await r.json()).data[0].id;
    $("model-name").textContent = modelName;
  } catch (e) {
    showError("Cannot reach the server: " + e);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("cancel").hidden = !busy;
}

async function send(text) {
  if (!modelName) await loadModel();
  if (!modelName) return;
  const conv = current();
  conv.messages.push({ role: "user", content: text });
  if (conv.title === "New chat") conv.title = text.slice(0, 40);
  const reply = { role: "assistant", content: "" };
  conv.messages.push(reply);
  save();
  render();
  const node = $("messages").lastChild;
  controller = new AbortController();
  setBusy(true);
  try {
    const history = conv.messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model: modelName,
        messages: history,
        stream: true,
        temperature: Number($("temperature").value),
      }),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorMessage(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
        if (delta) {
          reply.content += delta;
          node.textContent = reply.content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
      node.classList.add("stopped");
    } else {
      showError(String(e.message || e));
      if (!reply.content) conv.messages.pop();
    }
  } finally {
    controller = null;
    setBusy(false);
    save();
    render();
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("cancel").onclick = () => controller && controller.abort();
$("new-chat").onclick = () => {
  currentId = null;
  current();
  render();
  $("sidebar").classList.remove("open");
};
$("close-sidebar").onclick = () => $("sidebar").classList.remove("open");
$("error-close").onclick = () => { $("error-banner").hidden = true; };
$("toggle-sidebar").onclick = () => $("sidebar").classList.toggle("open");
// The key lives only as long as the tab (sessionStorage), never in localStorage.
$("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
$("temperature").value = localStorage.getItem(TEMPERATURE_STORE) || "0.7";
$("temperature").addEventListener("change", () => {
  localStorage.setItem(TEMPERATURE_STORE, $("temperature").value);
});
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
  $("error-banner").hidden = true;
  loadModel();
});

render();
loadModel();

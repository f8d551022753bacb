// diffusiond's page: plain JavaScript over the daemon's own API (docs/api.md), same origin, no
// build step and nothing fetched from elsewhere. The sign-in cookie (HttpOnly) travels with every
// request by itself; this script never sees the token.
"use strict";

const $ = (id) => document.getElementById(id);
const EXTENSIONS = { "image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "image/gif": "gif",
                     "video/mp4": "mp4", "application/x-npy": "npy" };
const PREVIEW = { every: 1, format: "jpeg", max_side: 256 };  // the request's "preview" field
// protocol.VIDEO_TASKS (a video model's job takes no upscale) and protocol.STRENGTH_TASKS (the edits
// with a strength); tests/test_web_js_edits.py checks them against protocol.py
const VIDEO_TASKS = ["text-to-video", "image-to-video"];
const STRENGTH_TASKS = ["image-to-image", "inpainting"];
// files: each file input's picture as a data: URL (read when chosen); reading: those still being read
const state = { job: null, events: null, previews: true, models: [], files: {}, reading: {} };
const FINAL = ["succeeded", "failed", "cancelled"];

// The wait before the next try of something the daemon refused or did not answer (it may be restarting):
// doubling from 1 s, at most 15 s, so a page left open finds the daemon soon after it is back.
const backoff = (attempt) => Math.min(1000 * 2 ** attempt, 15000);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class ApiError extends Error {
  constructor(message, status, error) { super(message); this.status = status; this.error = error || {}; }
}

async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    throw new ApiError(`the daemon did not answer (${err.message}); is it still running?`, 0);
  }
  let data = null;
  try { data = await resp.json(); } catch (_) { data = null; }
  if (resp.status === 401) showSignIn();
  if (!resp.ok) {
    const error = data && data.error ? data.error : {};
    const where = error.field ? ` (field ${error.field})` : "";
    throw new ApiError((error.message || `${method} ${path}: HTTP ${resp.status}`) + where, resp.status, error);
  }
  return data;
}

function showSignIn() {
  $("signin").hidden = false;
  $("app").hidden = true;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const child of children) node.append(child);
  return node;
}

// the form ---------------------------------------------------------------------------------------

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function selectedModel() {
  return state.models.find((m) => m.id === $("model").value);
}

// Whether a job on `model` may ask for previews: /v1/models says so per model (some models cannot preview,
// docs/api.md "Live previews"); only a daemon whose entries lack the flag is judged as a whole.
function previewsFor(model) {
  return model && typeof model.previews === "boolean" ? model.previews : state.previews;
}

function formRequest() {
  const body = { prompt: $("prompt").value.trim(), n: number("n") || 1 };
  if ($("model").value) body.model = $("model").value;
  const negative = $("negative").value.trim();
  if (negative && !$("negative").disabled) body.negative_prompt = negative;  // kept for the next model that takes one
  for (const [id, field] of [["width", "width"], ["height", "height"], ["steps", "steps"],
                             ["guidance", "guidance_scale"], ["seed", "seed"]]) {
    const value = number(id);
    if (value !== undefined) body[field] = value;
  }
  const loras = [...document.querySelectorAll("#lora-list .lora")]
    .filter((row) => !row.hidden && row.querySelector("input[type=checkbox]").checked)
    .map((row) => ({ name: row.dataset.name, weight: Number(row.querySelector("input[type=number]").value || 1) }));
  if (loras.length) body.loras = loras;
  addSteers(body);  // control and ip_adapter, a row each (steer.js)
  if (!$("input-image").hidden && state.files.image) {
    body.image = state.files.image;  // a data: URL, read when the file was chosen
    if (!$("mask-box").hidden && state.files.mask) body.mask = state.files.mask;  // then it is inpainting
    const strength = number("strength");
    if (!$("strength-box").hidden && strength !== undefined) body.strength = strength;
  }
  if (!$("upscale").hidden && $("upscale-name").value) {
    body.upscale = { name: $("upscale-name").value };
    const scale = number("upscale-scale");
    if (scale !== undefined) body.upscale.scale = scale;
  }
  if ($("previews").checked && previewsFor(selectedModel())) body.preview = { ...PREVIEW };
  return body;
}

function fillForm(job) {
  const r = job.request || {};
  $("prompt").value = r.prompt || "";
  $("negative").value = r.negative_prompt || "";
  if (state.models.some((m) => m.id === job.model)) $("model").value = job.model;
  $("width").value = r.width ?? "";
  $("height").value = r.height ?? "";
  $("steps").value = r.steps ?? "";
  $("guidance").value = r.guidance_scale ?? "";
  $("n").value = r.n ?? 1;
  const seed = r.seed ?? (job.outputs && job.outputs.length ? job.outputs[0].seed : null);
  $("seed").value = seed ?? "";
  const weights = new Map((r.loras || []).map((l) => [l.name, l.weight]));
  for (const row of document.querySelectorAll("#lora-list .lora")) {
    row.querySelector("input[type=checkbox]").checked = weights.has(row.dataset.name);
    if (weights.has(row.dataset.name)) row.querySelector("input[type=number]").value = weights.get(row.dataset.name);
  }
  fillSteers(r);
  $("upscale-name").value = (r.upscale && r.upscale.name) || "";
  $("upscale-scale").value = (r.upscale && r.upscale.scale) ?? "";
  modelChanged();
  $("prompt").focus();
}

function rollDice() {
  $("seed").value = crypto.getRandomValues(new Uint32Array(1))[0];
}

// LoRAs and an input image: shown only when the daemon and the selected model can use them
// (GET /v1/loras answers; the model's "edits" in /v1/models lists image-to-image or inpainting).
function modelChanged() {
  const model = selectedModel();
  $("input-image").hidden = !(model && (model.edits || []).length);
  $("mask-box").hidden = !(model && (model.edits || []).includes("inpainting"));
  // the edits that take a strength (protocol.STRENGTH_TASKS); the engine refuses it for the others
  $("strength-box").hidden = !(model && (model.edits || []).some((t) => STRENGTH_TASKS.includes(t)));
  let shown = 0;
  for (const row of document.querySelectorAll("#lora-list .lora")) {
    const fits = JSON.parse(row.dataset.models);
    row.hidden = !(model && (fits === null || fits.includes(model.id)));
    shown += row.hidden ? 0 : 1;
  }
  $("loras").hidden = shown === 0;
  fitSteers(model);  // the control and reference boxes (steer.js)
  $("steps").min = String((model && model.min_steps) || 1);  // 2 where one step makes NaN (docs/api.md)
  // a guidance-distilled model (FLUX) has no negative prompt: the daemon refuses one (docs/api.md)
  const noNegative = Boolean(model && model.negative_prompt === false);
  $("negative").disabled = noNegative;
  $("negative").title = noNegative ? `${model.id} has no negative prompt` : "";
  // an upscaler takes any picture a model makes (a video model's job is refused: docs/api.md)
  $("upscale").hidden = !(model && !VIDEO_TASKS.includes(model.task) && $("upscale-name").options.length > 1);
  // the box keeps the user's choice (checked) for the next model that can preview
  const previews = previewsFor(model);
  $("previews").disabled = !previews;
  $("previews").parentElement.title = previews ? "" : model && typeof model.previews === "boolean"
    ? `${model.id} shows no previews` : "this daemon does not send previews";
}

async function loadUpscalers() {
  let list;
  try {
    list = await api("GET", "/v1/upscalers");
  } catch (_) {
    return;  // a daemon without upscalers: the box stays hidden
  }
  $("upscale-name").replaceChildren(el("option", { value: "", textContent: "none" }),
    ...((list && list.data) || []).map((u) => el("option", { value: u.name, textContent: `${u.name} (${u.scale}x)` })));
  modelChanged();
}

async function loadLoras() {
  let list;
  try {
    list = await api("GET", "/v1/loras");
  } catch (_) {
    return;  // no LoRA support in this daemon: the section stays hidden
  }
  $("lora-list").replaceChildren(...((list && list.data) || []).map((l) => {
    const row = el("div", { className: "lora row" },
      el("label", { className: "check" }, el("input", { type: "checkbox" }), ` ${l.name}`),
      el("input", { type: "number", step: "0.05", value: "1", title: "weight" }));
    row.dataset.name = l.name;
    row.dataset.models = JSON.stringify(l.models ?? null);
    return row;
  }));
  modelChanged();
}

function readFile(input) {
  const id = input.id;
  state.files[id] = null;
  const file = input.files[0];
  state.reading[id] = file ? new Promise((resolve) => {
    const reader = new FileReader();
    reader.onload = () => { state.files[id] = reader.result; resolve(); };
    reader.onerror = () => { showError(`could not read ${file.name}`); resolve(); };
    reader.readAsDataURL(file);
  }) : null;
}

async function loadModels() {
  const list = await api("GET", "/v1/models");
  state.models = list.data || [];
  showResidency(state.models);
  $("model").replaceChildren(...state.models.map((m) =>
    el("option", { value: m.id, textContent: `${m.id} (${m.task}${m.state === "ready" ? "" : ", " + m.state})` })));
  modelChanged();
}

async function loadHealth() {
  // /health answers 503 with the same report while a worker is not ready: show it either way.
  try {
    const resp = await fetch("/health", { credentials: "same-origin" });
    const h = await resp.json();
    if (h.version) {
      $("daemon-state").textContent = `${h.version} · ${h.status}${h.sleeping ? " · sleeping" : ""}`;
    }
  } catch (_) {
    $("daemon-state").textContent = "";
  }
}

// the current job ----------------------------------------------------------------------------

function setStatus(job) {
  const running = job.status === "running" || job.status === "queued";
  let text = job.status + (running && job.stage ? ` (${job.stage})` : "");
  if (job.error && job.error.message) text += `: ${job.error.message}`;
  $("status").textContent = text;
  $("status").dataset.status = job.status;
}

function setBusy(busy) {
  $("generate").disabled = busy;
  $("cancel").disabled = !busy;
}

async function generate() {
  if (state.job || state.waiting) return;
  showError("");
  state.waiting = true;  // for a picture chosen a moment ago, still being read
  try {
    await Promise.all(Object.values(state.reading).filter(Boolean));
  } finally {
    state.waiting = false;
  }
  const body = formRequest();
  if (!body.prompt) {
    showError("Write a prompt first.");
    $("prompt").focus();
    return;
  }
  const problem = steerProblem(body);
  if (problem) {
    showError(problem);
    return;
  }
  setBusy(true);
  let job;
  try {
    job = await submit(body);
  } catch (err) {
    setBusy(false);
    showError(err.message);
    return;
  }
  follow(job);
}

async function submit(body) {
  try {
    return await api("POST", "/v1/jobs", body);
  } catch (err) {
    // A refused preview: send this job without. Only a daemon that does not say which models preview
    // (no `previews` flag) is taken to have none at all; else the next model may well.
    if (body.preview && err.status === 400 && String(err.error.field || "").startsWith("preview")) {
      const model = state.models.find((m) => m.id === body.model);
      if (!(model && typeof model.previews === "boolean")) {
        state.previews = false;
        modelChanged();
      }
      delete body.preview;
      return await api("POST", "/v1/jobs", body);
    }
    throw err;
  }
}

function follow(job) {
  state.job = job;
  $("job-id").textContent = job.id;
  setStatus(job);
  const bar = $("progress");
  bar.max = (job.progress && job.progress.total) || 1;
  bar.value = 0;
  bar.dataset.events = "0";
  const preview = $("preview");
  preview.hidden = true;
  preview.removeAttribute("src");
  preview.dataset.count = "0";
  listen(job, 0);
}

// The job's event stream; `attempt`: how many were refused before it.
function listen(job, attempt) {
  const bar = $("progress");
  const preview = $("preview");
  const events = new EventSource(`/v1/jobs/${encodeURIComponent(job.id)}/events`);
  state.events = events;
  events.addEventListener("open", () => { attempt = 0; });
  events.addEventListener("status", (ev) => setStatus(JSON.parse(ev.data)));
  events.addEventListener("progress", (ev) => {
    const p = JSON.parse(ev.data);
    bar.max = p.total || bar.max;
    bar.value = p.step;
    bar.dataset.events = String(Number(bar.dataset.events) + 1);
    $("status").textContent = `running: step ${p.step} of ${p.total}`;
  });
  events.addEventListener("preview", (ev) => {
    const p = JSON.parse(ev.data);
    preview.src = p.image ? `data:image/${p.format};base64,${p.image}` : p.url;
    preview.hidden = false;
    preview.dataset.step = String(p.step);
    preview.dataset.count = String(Number(preview.dataset.count) + 1);
  });
  for (const name of ["done", "error"]) {
    // "error" is also EventSource's own event for a broken connection (no data): onerror handles that
    events.addEventListener(name, (ev) => { if (ev.data) finish(JSON.parse(ev.data)); });
  }
  // A dropped connection is retried by the EventSource itself; a refused one (any answer but 200: signed out,
  // the daemon restarting, a proxy's 502) closes it for good, so ask for the job and, unfinished, follow again.
  events.onerror = async () => {
    if (events.readyState !== EventSource.CLOSED || state.events !== events) return;
    let now;
    try {
      now = await api("GET", `/v1/jobs/${encodeURIComponent(job.id)}`);
    } catch (err) {
      if (state.events === events) lost(job, err);
      return;
    }
    if (state.events !== events) return;
    if (FINAL.includes(now.status)) return finish(now);
    const wait = backoff(attempt);
    setStatus(now);
    $("status").textContent += ` · its event stream was refused; following again in ${wait / 1000} s`;
    await sleep(wait);
    if (state.events === events) listen(job, attempt + 1);
  };
}

// Neither the stream nor the job's record answers: its status is unknown, not the one it had when sent.
function lost(job, err) {
  if (state.events) state.events.close();
  state.events = null;
  state.job = null;
  $("status").textContent = "status unknown";
  $("status").dataset.status = "unknown";
  showError(`lost job ${job.id}: its event stream was refused and asking for it failed (${err.message}); ` +
            "press ↻ by Recent jobs once the daemon answers to see how it ended");
  setBusy(false);
}

function finish(job) {
  if (state.events) state.events.close();
  state.events = null;
  state.job = null;
  setStatus(job);
  if (job.status === "succeeded") {
    $("progress").value = $("progress").max;
    const first = (job.outputs || [])[0];
    if (first && first.content_type.startsWith("image/")) {  // the result takes the last preview's place
      $("preview").src = first.url;
      $("preview").hidden = false;
    }
  }
  setBusy(false);
  refreshGallery();
}

async function cancel() {
  if (!state.job) return;
  $("status").textContent = "cancelling…";
  try {
    // finished=keep: a cancel that comes after the end must not delete the result (a plain DELETE does)
    await api("DELETE", `/v1/jobs/${encodeURIComponent(state.job.id)}?finished=keep`);
  } catch (err) {
    if (err.status !== 409) showError(err.message);  // 409: it had already finished
  }
}

// the gallery ----------------------------------------------------------------------------------

function jobCard(job) {
  const r = job.request || {};
  const thumbs = el("div", { className: "thumbs" });
  const links = el("div", { className: "links" });
  for (const out of job.outputs || []) {
    const ext = EXTENSIONS[out.content_type] || "bin";
    if (out.content_type.startsWith("image/")) {
      thumbs.append(el("img", { src: out.url, alt: `output ${out.index}`, loading: "lazy" }));
    } else if (out.content_type.startsWith("video/")) {
      thumbs.append(el("video", { src: out.url, controls: true, muted: true, loop: true }));
    }
    links.append(el("a", { className: "download", href: out.url, download: `${job.id}-${out.index}.${ext}`,
                           textContent: job.outputs.length > 1 ? `Download ${out.index}` : "Download" }));
  }
  const reuse = el("button", { type: "button", className: "reuse", textContent: "Use these settings" });
  reuse.addEventListener("click", () => fillForm(job));
  links.append(reuse);
  const seeds = (job.outputs || []).map((o) => o.seed).join(", ") || (r.seed ?? "random");
  // the job's wall time (``total``, created to ended); its stages overlap and would add up to more
  const took = (job.timings_ms || {}).total || 0;
  const meta = [job.model, `${r.width}×${r.height}`, `${r.steps} steps`, `guidance ${r.guidance_scale}`,
                `seed ${seeds}`, new Date(job.created * 1000).toLocaleTimeString()];
  for (const c of r.control || []) meta.push(`control ${controlText(c)}`);  // steer.js
  for (const a of r.ip_adapter || []) meta.push(`IP-Adapter ${a.name}:${a.scale}`);
  if (r.upscale) meta.push(`upscale ${r.upscale.name}:${r.upscale.scale}`);
  if (job.attention) meta.push(`attention ${job.attention}`);
  if ((job.approximations || []).length) meta.push(`approximations ${job.approximations.join(", ")}`);
  if (took) meta.push(`${(took / 1000).toFixed(1)} s`);
  let stateText = job.status;
  if (job.error && job.error.message) stateText += `: ${job.error.message}`;
  const card = el("article", { className: "job" },
    thumbs,
    el("div", { className: "prompt", textContent: r.prompt || "" }),
    r.negative_prompt ? el("div", { className: "meta", textContent: `not: ${r.negative_prompt}` }) : "",
    el("div", { className: "meta", textContent: meta.join(" · ") }),
    el("div", { className: "state", textContent: stateText }),
    links);
  card.dataset.jobId = job.id;
  card.dataset.status = job.status;
  return card;
}

async function refreshGallery() {
  try {
    const list = await api("GET", "/v1/jobs");
    $("gallery").replaceChildren(...(list.data || []).map(jobCard));
  } catch (err) {
    if (err.status !== 401) showError(`could not list the jobs: ${err.message}`);
  }
}

// start ----------------------------------------------------------------------------------------

async function start() {
  $("form").addEventListener("submit", (ev) => { ev.preventDefault(); generate(); });
  $("cancel").addEventListener("click", cancel);
  $("dice").addEventListener("click", rollDice);
  $("refresh").addEventListener("click", refreshGallery);
  $("model").addEventListener("change", modelChanged);
  for (const id of ["image", "mask"]) $(id).addEventListener("change", () => readFile($(id)));
  startSteers();
  document.addEventListener("keydown", (ev) => {
    if ((ev.ctrlKey || ev.metaKey) && ev.key === "Enter") {
      ev.preventDefault();
      generate();
    }
  });
  for (let attempt = 0; ; attempt += 1) {  // a daemon restarting (or not yet started) answers later
    try {
      await loadModels();
      break;
    } catch (err) {
      if (err.status === 401) return;  // api() shows how to sign in
      const wait = backoff(attempt);
      showError(`could not list the models: ${err.message}; trying again in ${wait / 1000} s`);
      await sleep(wait);
    }
  }
  showError("");
  await Promise.all([loadHealth(), loadLoras(), loadSteers(), loadUpscalers(), refreshGallery()]);
  startResidency();
  document.body.dataset.ready = "true";
}

start();

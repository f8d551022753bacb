// Runs the page's scripts (those index.html names, in its order) in Node against a stand-in DOM and API
// (tests/test_web_js.py drives it).
// Not a browser: no layout, no real events, no real HTTP. What it checks is the page's own logic
// (which boxes it shows for which model, the job body it builds, what it does when the daemon refuses or
// does not answer) where no Chromium is installed.
"use strict";
const fs = require("fs");
const vm = require("vm");

const SELECTS = new Set(["model", "upscale-name"]);  // the selects of index.html (the rows' are made)
const made = [];  // every element the scripts made, found by id once they give it one

class El {
  constructor(tag, id) {
    Object.assign(this, { tagName: tag, id, children: [], dataset: {}, hidden: false, disabled: false,
                          checked: false, textContent: "", files: [], listeners: {}, parentElement: {} });
    this._value = tag === "select" ? null : "";  // a select shows its first option until one is chosen
    this.parentNode = null;
    made.push(this);
  }
  get value() {
    if (this.tagName !== "select") return this._value;
    const values = this.children.map((o) => o.value);
    if (this._value === null) return values[0] ?? "";
    return values.includes(this._value) ? this._value : "";  // as a browser's: no option chosen
  }
  set value(v) { this._value = String(v); }
  get options() { return this.children; }
  get selectedOptions() { return this.children.filter((o) => o.value === this.value); }
  addEventListener(name, fn) { (this.listeners[name] ||= []).push(fn); }
  fire(name) { for (const fn of this.listeners[name] || []) fn({ preventDefault() {} }); }
  replaceChildren(...c) { this.children = []; this.append(...c); }
  append(...c) {
    for (const child of c) if (child instanceof El) child.parentNode = this;
    this.children.push(...c);
  }
  remove() {
    if (this.parentNode) this.parentNode.children = this.parentNode.children.filter((c) => c !== this);
    this.parentNode = null;
  }
  click() { if (!this.disabled) this.fire("click"); }
  focus() {}
  removeAttribute() {}
}

const elements = new Map();
const byId = (id) => {
  if (!elements.has(id)) {
    elements.set(id, made.find((e) => e.id === id) || new El(SELECTS.has(id) ? "select" : "input", id));
  }
  return elements.get(id);
};
const document = {
  getElementById: byId,
  createElement: (tag) => new El(tag),
  querySelectorAll: () => [],
  addEventListener() {},
  body: { dataset: {} },
};
const answers = JSON.parse(process.argv[3]);  // path -> the JSON the daemon gives
// answers.fail: path -> the statuses its next requests get before it answers again (0: no answer at all)
const failing = answers.fail || {};
const fetched = {};  // path -> how many requests it got
const posted = [];
async function fetch(path, init) {
  fetched[path] = (fetched[path] || 0) + 1;
  const status = (failing[path] || []).shift();
  if (status === 0) throw new TypeError("Failed to fetch");
  if (status !== undefined) {
    return { ok: false, status, json: async () => ({ error: { message: `refused with ${status}` } }) };
  }
  if (init && init.method === "POST") {
    posted.push(JSON.parse(init.body));
    const body = posted[posted.length - 1];  // answers.refuse_preview: the models whose jobs refuse the field
    if (body.preview && (answers.refuse_preview || []).includes(body.model || "")) {
      return { ok: false, status: 400, json: async () => ({ error: { message: "no previews", field: "preview" } }) };
    }
    return { ok: true, status: 202, json: async () => ({ id: `j_${posted.length}`, status: "queued" }) };
  }
  const data = answers[path];
  if (data === undefined) return { ok: false, status: 404, json: async () => ({ error: { message: "no" } }) };
  return { ok: true, status: 200, json: async () => data };
}
class FileReader {
  readAsDataURL(file) {
    setTimeout(() => { this.result = `data:image/png;base64,${file.b64}`; this.onload(); }, 5);
  }
}
// The page's event streams, each refused or fed by a step.
const streams = [];
class EventSource {
  constructor(url) { Object.assign(this, { url, readyState: 0, listeners: {}, onerror: null }); streams.push(this); }
  addEventListener(name, fn) { (this.listeners[name] ||= []).push(fn); }
  close() { this.readyState = EventSource.CLOSED; }
}
EventSource.CLOSED = 2;
// The page's timers run only when a step says "tick" (each due once), so a wait of seconds takes none.
let timers = [];
let lastTimer = 0;
const addTimer = (every) => (fn, ms) => { timers.push({ id: ++lastTimer, fn, ms: ms || 0, every }); return lastTimer; };
const clearTimer = (id) => { timers = timers.filter((t) => t.id !== id); };
const ctx = vm.createContext({ document, fetch, FileReader, EventSource, setTimeout: addTimer(false),
                               setInterval: addTimer(true), clearTimeout: clearTimer, clearInterval: clearTimer,
                               console, crypto: globalThis.crypto, JSON, Promise, Number, String, Object,
                               Boolean, Date, Math, Error, Map, Uint32Array, encodeURIComponent });
const html = fs.readFileSync(`${process.argv[2]}/index.html`, "utf8");
for (const [, name] of html.matchAll(/<script src="\/static\/([\w.-]+)"/g)) {
  vm.runInContext(fs.readFileSync(`${process.argv[2]}/${name}`, "utf8"), ctx, { filename: name });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const enabled = (select) => select.options.filter((o) => !o.disabled).map((o) => o.value);
// each row of a box: its file input's id, the names offered, the one chosen, its scale, its remove button;
// a control row also its preprocess, start, end and mode picker (null while hidden: a single-mode ControlNet)
const rowsOf = (box) => byId(`${box}-list`).children.map((row) => {
  const f = row.fields;
  const shown = { id: f.image.id, names: enabled(f.name), name: f.name.value, scale: f.scale.value,
                  removable: !f.remove.hidden };
  if (box === "control") {
    Object.assign(shown, { preprocess: f.preprocess.value, start: f.start.value, end: f.end.value,
                           mode: f.modeBox.hidden ? null : f.mode.options.map((o) => o.value), mode_value: f.mode.value });
  }
  return shown;
});
const shown = () => ({ control: !byId("control").hidden, reference: !byId("reference").hidden,
                       upscale: !byId("upscale").hidden, previews: !byId("previews").disabled,
                       previews_title: byId("previews").parentElement.title || "", mask: !byId("mask-box").hidden, steps_min: byId("steps").min,
                       upscale_names: byId("upscale-name").options.map((o) => o.value),
                       controls: rowsOf("control"), can_add_control: !byId("control-add").disabled,
                       references: rowsOf("reference"), can_add: !byId("reference-add").disabled,
                       error: byId("error").hidden ? "" : byId("error").textContent,
                       residency: byId("residency-rows").children.map((tr) => tr.children.map((td) => td.textContent)),
                       ready: document.body.dataset.ready === "true", signed_out: byId("app").hidden,  // showSignIn()
                       status: byId("status").textContent, status_code: byId("status").dataset.status || "",
                       generate_disabled: byId("generate").disabled, streams: streams.filter((e) => e.readyState !== 2).length,
                       opened: streams.length, timers: timers.map((t) => ({ ms: t.ms, every: t.every })),
                       fetched: { ...fetched },
                       cards: byId("gallery").children.map((card) => card.children.map((c) => c.textContent || "")) });
const choose = (id, value) => { byId(id).value = value; byId(id).fire("change"); };

(async () => {
  const waiting = () => timers.some((t) => !t.every);  // the page waits to try again
  for (let i = 0; i < 200 && document.body.dataset.ready !== "true" && !waiting(); i++) await sleep(5);
  const out = { ready: document.body.dataset.ready === "true", steps: [] };
  for (const step of JSON.parse(process.argv[4])) {
    Object.assign(answers, step.serve || {});
    Object.assign(failing, step.fail || {});
    if (step.refuse_stream) {  // the stream's reconnect got a non-200: closed for good
      const events = streams[streams.length - 1];
      events.readyState = EventSource.CLOSED;
      events.onerror({});
    }
    for (let i = 0; i < (step.tick || 0); i++) {
      const due = timers;
      timers = timers.filter((t) => t.every);
      for (const t of due) t.fn();
      await sleep(20);  // what they started
    }
    if (step.refuse_stream) await sleep(20);
    if (step.model) choose("model", step.model);
    if (step.reuse) ctx.fillForm(step.reuse);  // a gallery card's "Use these settings"
    for (const id of step.click || []) byId(id).click();
    for (const [id, on] of Object.entries(step.check || {})) byId(id).checked = on;
    for (const [id, value] of Object.entries(step.choose || {})) choose(id, value);
    for (const [id, value] of Object.entries(step.values || {})) byId(id).value = value;
    for (const [id, b64] of Object.entries(step.files || {})) {
      byId(id).files = [{ name: "picture.png", b64 }];
      byId(id).fire("change");
    }
    const before = posted.length;
    if (step.submit) {
      ctx.finish({ id: "j_0", status: "succeeded", outputs: [] });  // the job before, done: one at a time
      byId("form").fire("submit");
      for (let i = 0; i < 200 && posted.length === before; i++) await sleep(5);
      await sleep(20);  // a refused job's second post
    }
    out.steps.push({ ...shown(), body: posted.length > before ? posted[posted.length - 1] : null,
                     posts: posted.length - before });
  }
  process.stdout.write(JSON.stringify(out));
})().catch((err) => { process.stdout.write(JSON.stringify({ error: String(err.stack || err) })); });

// diffusiond's page: the pictures that steer a job, in two boxes of rows: control images, each with its
// ControlNet (and the mode of a union one), and reference images, each with its IP-Adapter; a row each
// picture, up to the engine's cap. Loaded before app.js, which calls these functions (they use its $,
// el, api, state, selectedModel, modelChanged and readFile).
"use strict";

// The engine's caps, MAX_CONTROLS (diffusiond/daemon/core/controls.py) and MAX_IP_ADAPTERS
// (diffusiond/daemon/core/ip_adapters.py): GET /v1/controlnets and /v1/ip-adapters do not say them, and
// a fifth row would only earn a 400 naming control or ip_adapter.
const MAX_ROWS = { control: 4, reference: 4 };
const NOUNS = { control: "control image", reference: "reference" };
// The tasks each kind steers (docs/api.md): ControlNets a text-to-image model, its edits and dedicated
// image-to-image and inpainting models; IP-Adapters text-to-image models (their edits included).
const STEERED_TASKS = { control: ["text-to-image", "image-to-image", "inpainting"], reference: ["text-to-image"] };
// what GET /v1/controlnets and /v1/ip-adapters listed; made: the rows each box made so far (for their ids)
const steers = { control: [], reference: [], made: { control: 0, reference: 0 } };

function fits(entry, model, box) {  // those that fit the model, or that no worker has refused yet
  return Boolean(entry && model && STEERED_TASKS[box].includes(model.task)
    && ((entry.models || []).includes(model.id) || !Object.keys(entry.unfit || {}).includes(model.id)));
}

function steerOptions(box) {
  return steers[box].map((e) => el("option", { value: e.name, textContent: e.name }));
}

// Offers in one select only the entries that fit the model.
function fitSelect(select, box, model) {
  for (const option of select.options) {
    option.disabled = option.hidden = !fits(steers[box].find((e) => e.name === option.value), model, box);
  }
  const chosen = select.selectedOptions[0];  // none once a model that takes none of them was selected
  if (!chosen || chosen.disabled) select.value = ([...select.options].find((o) => !o.disabled) || {}).value || "";
}

function fitSteers(model) {
  for (const box of ["control", "reference"]) {
    for (const row of rows(box)) fitSelect(row.fields.name, box, model);
    $(box).hidden = !steers[box].some((e) => fits(e, model, box));
  }
  for (const row of rows("control")) modeChanged(row);
}

async function loadSteers() {
  await Promise.all([["control", "/v1/controlnets"], ["reference", "/v1/ip-adapters"]].map(async ([box, path]) => {
    try {
      steers[box] = ((await api("GET", path)) || {}).data || [];
    } catch (_) {
      steers[box] = [];  // a daemon without this endpoint: the box stays hidden
    }
    for (const row of rows(box)) row.fields.name.replaceChildren(...steerOptions(box));
    if (!rows(box).length) addRow(box);
  }));
  modelChanged();
}

function startSteers() {
  for (const box of ["control", "reference"]) $(`${box}-add`).addEventListener("click", () => addRow(box));
}

// the rows of a box ------------------------------------------------------------------------------

function rows(box) {
  return [...$(`${box}-list`).children];
}

// A row: its picture, its ControlNet or IP-Adapter, its scale; a control row also its preprocess, the
// fraction of the steps it acts in (start, end; empty: all of them) and a union ControlNet's mode.
function addRow(box) {
  const k = steers.made[box]++;
  const field = (kind, tag, props, ...children) => el(tag, { id: `${box}-${kind}-${k}`, ...props }, ...children);
  const number = (kind, props) => field(kind, "input", { type: "number", step: "0.05", min: "0", ...props });
  const fields = {
    image: field("image", "input", { type: "file", accept: "image/*" }),
    name: field("name", "select", {}, ...steerOptions(box)),
    scale: number("scale", { max: "4", value: "1" }),
    remove: field("remove", "button", { type: "button", className: "remove", textContent: "Remove",
                                        title: `take this ${NOUNS[box]} out` }),
  };
  const grid = el("div", { className: "grid" });
  if (box === "control") {
    Object.assign(fields, {
      preprocess: field("preprocess", "select", {}, el("option", { value: "none", textContent: "none (the picture is the map)" }),
                        el("option", { value: "canny", textContent: "canny edges" })),
      start: number("start", { max: "1", placeholder: "0", title: "the fraction of the steps it starts acting at" }),
      end: number("end", { max: "1", placeholder: "1", title: "the fraction of the steps it stops acting at" }),
      mode: field("mode", "select"),
    });
    fields.modeBox = field("mode-box", "label", { hidden: true, title: "a union ControlNet's control mode: named "
      + "where serve named them (modes=), else its model card says which number is which" }, "Mode ", fields.mode);
    grid.append(el("label", { className: "wide" }, "ControlNet ", fields.name), el("label", {}, "Scale ", fields.scale),
      el("label", {}, "Start ", fields.start), el("label", {}, "End ", fields.end),
      el("label", { className: "seed" }, "Preprocess ", fields.preprocess), fields.modeBox);
  } else {
    grid.append(el("label", { className: "seed" }, "IP-Adapter ", fields.name), el("label", {}, "Scale ", fields.scale));
  }
  const row = el("div", { className: `steer ${box}` }, fields.image, grid, fields.remove);
  row.fields = fields;
  fields.image.addEventListener("change", () => readFile(fields.image));
  fields.remove.addEventListener("click", () => removeRow(box, row));
  $(`${box}-list`).append(row);
  fitSelect(fields.name, box, selectedModel());
  if (box === "control") {
    fields.name.addEventListener("change", () => modeChanged(row));
    modeChanged(row);
  }
  rowsChanged(box);
  return row;
}

function removeRow(box, row) {
  row.remove();
  delete state.files[row.fields.image.id];  // its picture leaves with it
  delete state.reading[row.fields.image.id];
  rowsChanged(box);
}

function rowsChanged(box) {
  const list = rows(box);
  const full = list.length >= MAX_ROWS[box];
  $(`${box}-add`).disabled = full;
  $(`${box}-add`).title = full ? `at most ${MAX_ROWS[box]} ${NOUNS[box]}s act at once` : "";
  for (const row of list) row.fields.remove.hidden = list.length === 1;  // one row stays: leave its picture out
}

// A union ControlNet needs its mode, sent as its number; the names serve gave them (GET /v1/controlnets'
// "modes", e.g. canny, depth) label the choices where there are any. A single-mode one takes none.
function modeChanged(row) {
  const entry = steers.control.find((e) => e.name === row.fields.name.value) || {};
  const modes = entry.num_modes || 0;
  const names = entry.modes || [];
  const select = row.fields.mode;
  const kept = select.value;
  row.fields.modeBox.hidden = modes === 0;
  select.replaceChildren(el("option", { value: "", textContent: "choose…" }),
    ...Array.from({ length: modes }, (_, k) =>
      el("option", { value: String(k), textContent: names[k] ? `${k}: ${names[k]}` : String(k) })));
  select.value = kept !== "" && Number(kept) < modes ? kept : "";
}

// The box's field: an entry each row with a picture and a name, in the rows' order; a number left
// empty is left out (the engine's default).
function rowsField(box, numbers, more) {
  if ($(box).hidden) return undefined;
  const entries = rows(box).filter((row) => state.files[row.fields.image.id] && row.fields.name.value)
    .map((row) => {
      const entry = { name: row.fields.name.value, image: state.files[row.fields.image.id] };
      for (const key of numbers) {
        const text = row.fields[key].value.trim();
        if (text !== "") entry[key] = Number(text);
      }
      if (more) more(row.fields, entry);
      return entry;
    });
  return entries.length ? entries : undefined;
}

function controlEntry(fields, entry) {
  entry.preprocess = fields.preprocess.value;
  if (!fields.modeBox.hidden && fields.mode.value !== "") entry.mode = Number(fields.mode.value);
}

// the request, and a job's settings back into the boxes ------------------------------------------

function addSteers(body) {
  const control = rowsField("control", ["scale", "start", "end"], controlEntry);
  if (control) body.control = control;
  const references = rowsField("reference", ["scale"]);
  if (references) body.ip_adapter = references;
}

// What the daemon would refuse anyway, said before the round trip.
function steerProblem(body) {
  for (const c of body.control || []) {
    const modes = (steers.control.find((e) => e.name === c.name) || {}).num_modes || 0;
    if (modes && c.mode === undefined) {
      return `Choose the mode of the union ControlNet ${c.name} (0 to ${modes - 1}: its model card `
        + "says which number is which).";
    }
  }
  return "";
}

// As many rows as the job had entries (one at least), each set as its entry was.
function fillRows(box, entries, fill) {
  const list = rows(box);
  while (list.length > Math.max(1, entries.length)) removeRow(box, list.pop());
  while (list.length < entries.length) list.push(addRow(box));
  entries.forEach((e, k) => {
    list[k].fields.name.value = e.name;
    list[k].fields.scale.value = e.scale ?? 1;
    if (fill) fill(list[k], e);
  });
}

function fillSteers(r) {  // the pictures themselves are not kept: choose them again
  fillRows("control", r.control || [], (row, c) => {
    row.fields.preprocess.value = c.preprocess || "none";
    row.fields.start.value = c.start ?? "";
    row.fields.end.value = c.end ?? "";
    row.fields.mode.value = "";
    modeChanged(row);
    row.fields.mode.value = c.mode ?? "";
  });
  fillRows("reference", r.ip_adapter || []);
}

// A control entry as a PNG's "control" text names it (daemon/outputs/metadata.py): name(@mode):scale, then
// the step range and the preprocess where they are not the defaults.
function controlText(c) {
  const range = (c.start ?? 0) === 0 && (c.end ?? 1) === 1 ? "" : `[${c.start}-${c.end}]`;
  const preprocess = c.preprocess && c.preprocess !== "none" ? ` ${c.preprocess}` : "";
  return `${c.name}${c.mode == null ? "" : "@" + c.mode}:${c.scale}${range}${preprocess}`;
}

// diffusiond's page: the pictures that steer a job, one control image with its ControlNet (and the
// mode of a union one) and up to MAX_REFERENCES reference images, each with its IP-Adapter. Loaded
// before app.js, which calls these functions (they use its $, el, api, number, state and readFile).
"use strict";

// The engine's MAX_IP_ADAPTERS (diffusiond/daemon/core/ip_adapters.py): GET /v1/ip-adapters does
// not say it, and a fifth row would only earn a 400 naming ip_adapter.
const MAX_REFERENCES = 4;
// The tasks each kind steers (docs/api.md): ControlNets a text-to-image model, its edits and dedicated
// image-to-image and inpainting models; IP-Adapters text-to-image models (their edits included).
const STEERED_TASKS = { control: ["text-to-image", "image-to-image", "inpainting"], reference: ["text-to-image"] };
// what GET /v1/controlnets and /v1/ip-adapters listed; rows: reference rows made so far (for their ids)
const steers = { control: [], reference: [], rows: 0 };

function fits(entry, model, box) {  // those that fit the model, or that no worker has refused yet
  return Boolean(entry && model && STEERED_TASKS[box].includes(model.task)
    && ((entry.models || []).includes(model.id) || !Object.keys(entry.unfit || {}).includes(model.id)));
}

function steerOptions(box) {
  return steers[box].map((e) => el("option", { value: e.name, textContent: e.name }));
}

// Offers in one select only the entries that fit the model; says how many do.
function fitSelect(select, box, model) {
  let fitting = 0;
  for (const option of select.options) {
    const ok = fits(steers[box].find((e) => e.name === option.value), model, box);
    option.disabled = option.hidden = !ok;
    fitting += ok ? 1 : 0;
  }
  const chosen = select.selectedOptions[0];  // none once a model that takes none of them was selected
  if (!chosen || chosen.disabled) select.value = ([...select.options].find((o) => !o.disabled) || {}).value || "";
  return fitting;
}

function fitSteers(model) {
  $("control").hidden = fitSelect($("control-name"), "control", model) === 0;
  for (const row of referenceRows()) fitSelect(row.fields.name, "reference", model);
  $("reference").hidden = !steers.reference.some((e) => fits(e, model, "reference"));
  controlChanged();
}

async function loadSteers() {
  await Promise.all([["control", "/v1/controlnets"], ["reference", "/v1/ip-adapters"]].map(async ([box, path]) => {
    try {
      steers[box] = ((await api("GET", path)) || {}).data || [];
    } catch (_) {
      steers[box] = [];  // a daemon without this endpoint: the box stays hidden
    }
  }));
  $("control-name").replaceChildren(...steerOptions("control"));
  for (const row of referenceRows()) row.fields.name.replaceChildren(...steerOptions("reference"));
  if (!referenceRows().length) addReference();
  modelChanged();
}

function startSteers() {
  $("control-name").addEventListener("change", controlChanged);
  $("reference-add").addEventListener("click", addReference);
  $("control-image").addEventListener("change", () => readFile($("control-image")));
}

// the control image ------------------------------------------------------------------------------

function controlEntry() {
  return steers.control.find((e) => e.name === $("control-name").value);
}

function controlModes() {  // a union ControlNet's number of modes (GET /v1/controlnets' "num_modes"), else 0
  const entry = controlEntry();
  return (entry && entry.num_modes) || 0;
}

// A union ControlNet needs its mode, sent as its number; the names serve gave them (GET /v1/controlnets'
// "modes", e.g. canny, depth) label the choices where there are any. A single-mode one takes none.
function controlChanged() {
  const modes = controlModes();
  const names = (controlEntry() || {}).modes || [];
  const select = $("control-mode");
  const kept = select.value;
  $("control-mode-box").hidden = modes === 0;
  select.replaceChildren(el("option", { value: "", textContent: "choose…" }),
    ...Array.from({ length: modes }, (_, k) =>
      el("option", { value: String(k), textContent: names[k] ? `${k}: ${names[k]}` : String(k) })));
  select.value = kept !== "" && Number(kept) < modes ? kept : "";
}

function controlField() {
  const image = state.files["control-image"];
  if ($("control").hidden || !image || !$("control-name").value) return undefined;
  const entry = { name: $("control-name").value, image, preprocess: $("control-preprocess").value };
  const scale = number("control-scale");
  if (scale !== undefined) entry.scale = scale;
  if (controlModes() && $("control-mode").value !== "") entry.mode = Number($("control-mode").value);
  return [entry];
}

// the reference images ---------------------------------------------------------------------------

function referenceRows() {
  return [...$("reference-list").children];
}

function addReference() {
  const k = steers.rows++;
  const image = el("input", { id: `reference-image-${k}`, type: "file", accept: "image/*" });
  const name = el("select", { id: `reference-name-${k}` }, ...steerOptions("reference"));
  const scale = el("input", { id: `reference-scale-${k}`, type: "number", min: "0", max: "4", step: "0.05", value: "1" });
  const remove = el("button", { id: `reference-remove-${k}`, type: "button", className: "remove",
                                textContent: "Remove", title: "take this reference out" });
  const row = el("div", { className: "reference" }, image,
    el("div", { className: "grid" }, el("label", { className: "seed" }, "IP-Adapter ", name),
       el("label", {}, "Scale ", scale)), remove);
  row.fields = { image, name, scale, remove };
  image.addEventListener("change", () => readFile(image));
  remove.addEventListener("click", () => removeReference(row));
  $("reference-list").append(row);
  fitSelect(name, "reference", selectedModel());
  referencesChanged();
  return row;
}

function removeReference(row) {
  row.remove();
  delete state.files[row.fields.image.id];  // its picture leaves with it
  delete state.reading[row.fields.image.id];
  referencesChanged();
}

function referencesChanged() {
  const rows = referenceRows();
  $("reference-add").disabled = rows.length >= MAX_REFERENCES;
  $("reference-add").title = rows.length >= MAX_REFERENCES ? `at most ${MAX_REFERENCES} references act at once` : "";
  for (const row of rows) row.fields.remove.hidden = rows.length === 1;  // one row stays: leave its picture out
}

function referenceField() {
  if ($("reference").hidden) return undefined;
  const entries = referenceRows().filter((row) => state.files[row.fields.image.id] && row.fields.name.value)
    .map((row) => {
      const entry = { name: row.fields.name.value, image: state.files[row.fields.image.id] };
      const text = row.fields.scale.value.trim();
      if (text !== "") entry.scale = Number(text);
      return entry;
    });
  return entries.length ? entries : undefined;
}

// the request, and a job's settings back into the boxes ------------------------------------------

function addSteers(body) {
  const control = controlField();
  if (control) body.control = control;
  const references = referenceField();
  if (references) body.ip_adapter = references;
}

// What the daemon would refuse anyway, said before the round trip.
function steerProblem(body) {
  const modes = controlModes();
  if (body.control && modes && body.control[0].mode === undefined) {
    return `Choose the mode of the union ControlNet ${body.control[0].name} (0 to ${modes - 1}: its model card `
      + "says which number is which).";
  }
  return "";
}

function fillSteers(r) {  // the pictures themselves are not kept: choose them again
  const control = (r.control || [])[0];
  if (control) {
    $("control-name").value = control.name;
    $("control-scale").value = control.scale;
    if (control.preprocess) $("control-preprocess").value = control.preprocess;
    $("control-mode").value = "";
    controlChanged();
    $("control-mode").value = control.mode ?? "";
  }
  const references = r.ip_adapter || [];
  let rows = referenceRows();
  while (rows.length > Math.max(1, references.length)) removeReference(rows.pop());
  while (rows.length < references.length) rows.push(addReference());
  references.forEach((a, k) => {
    rows[k].fields.name.value = a.name;
    rows[k].fields.scale.value = a.scale;
  });
  referencesChanged();
}

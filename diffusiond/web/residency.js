// diffusiond's page: the residency panel, what is where (each model's device, memory and keep-alive), from
// GET /v1/models every few seconds. Loaded before app.js, whose $, el and api it uses; app.js starts the
// poll once the models are listed.
"use strict";

const RESIDENCY_EVERY_MS = 3000;
const residency = { timer: null };  // the poll's, while it runs

function formatBytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (n >= 1024 && k < units.length - 1) { n /= 1024; k += 1; }
  return `${k === 0 ? n : n.toFixed(1)} ${units[k]}`;
}

function keptUntil(m) {
  if (m.keep_alive_forever) return "forever";
  if (m.keep_alive_until === null || m.keep_alive_until === undefined) return "—";
  const when = new Date(m.keep_alive_until * 1000);
  if (Number.isNaN(when.getTime())) return "forever";  // past what a Date holds: a daemon before the 100-year horizon
  const left = Math.max(0, Math.round(m.keep_alive_until - Date.now() / 1000));
  const at = when.toLocaleTimeString();
  return `${at} (in ${left >= 120 ? Math.round(left / 60) + " min" : left + " s"})`;
}

function showResidency(models) {
  $("residency-rows").replaceChildren(...models.map((m) => {
    const cell = (text, cls) => el("td", { textContent: String(text), className: cls || "" });
    const row = el("tr", { title: m.residency_reason || "" },
      cell(m.id), cell(m.device), cell(m.residency || "?", "where"), cell(formatBytes(m.device_bytes), "num device"),
      cell(formatBytes(m.host_bytes), "num host"), cell(keptUntil(m), "until"), cell(m.pinned ? "pinned" : "", "pinned"),
      cell(m.queued || 0, "num queued"), cell(m.running || 0, "num running"),
      cell(m.attention || "default", "attention"), cell((m.approximations || []).join(", ") || "none", "approximations"));
    row.dataset.model = m.id;
    row.dataset.residency = m.residency || "";
    return row;
  }));
  $("residency-updated").textContent = `· ${new Date().toLocaleTimeString()}`;
}

async function refreshResidency() {
  try {
    showResidency((await api("GET", "/v1/models")).data || []);
  } catch (err) {
    // Signed out (a daemon restarted with a new random token): api() shows how to sign in again, and
    // asking every few seconds would only earn 401s until then (each counted in web_refused_total).
    if (err.status === 401) stopResidency();
    $("residency-updated").textContent = err.status === 401 ? "" : `· not updated: ${err.message}`;
  }
}

function startResidency() {
  if (residency.timer === null) residency.timer = setInterval(refreshResidency, RESIDENCY_EVERY_MS);
}

function stopResidency() {
  clearInterval(residency.timer);
  residency.timer = null;
}

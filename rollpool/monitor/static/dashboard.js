// rollpool dashboard: polls /api/state and redraws the tables and charts.
"use strict";

const POLL_MS = 2000;
const charts = {};

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function seriesMatching(series, prefix, suffix) {
  const out = [];
  for (const [name, points] of Object.entries(series)) {
    if (name.startsWith(prefix) && name.endsWith(suffix) && name.length > prefix.length + suffix.length) {
      out.push({ name: name.slice(prefix.length, name.length - suffix.length), points });
    }
  }
  return out.sort((a, b) => a.name.localeCompare(b.name));
}

function rate(points) {
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const dt = points[i][0] - points[i - 1][0];
    if (dt > 0) out.push([points[i][0], Math.max(0, (points[i][1] - points[i - 1][1]) / dt)]);
  }
  return out;
}

// A weight version; -1 (nothing published or applied yet) reads "none".
function fmtVersion(v) {
  return typeof v === "number" && v < 0 ? "none" : v;
}

// Lag of one worker: the broker's version at each worker sample (the latest broker sample before it) minus the worker's version.
// No point while either side has no version yet (-1): before the first publish there is no lag to draw.
function lagSeries(brokerVersion, workerVersion) {
  const out = [];
  let j = 0;
  for (const [t, v] of workerVersion) {
    while (j + 1 < brokerVersion.length && brokerVersion[j + 1][0] <= t) j++;
    if (brokerVersion.length && brokerVersion[j][0] <= t + 5 && brokerVersion[j][1] >= 0 && v >= 0) {
      out.push([t, brokerVersion[j][1] - v]);
    }
  }
  return out;
}

function renderCharts(state) {
  const s = state.series || {};
  const pick = (name, label) => (s[name] ? [{ name: label, points: s[name] }] : []);
  charts.queue.draw([...pick("broker:queued", "queued"), ...pick("broker:leased", "leased"), ...pick("broker:held", "held")]);
  charts.tokens.draw(seriesMatching(s, "worker:", ":tokens_per_s"));
  const lag = [...pick("obs:staleness", "staleness at consumption (mean)"), ...pick("obs:staleness:max", "staleness (max)")];
  if (s["broker:version"]) {
    for (const w of seriesMatching(s, "worker:", ":weight_version")) {
      lag.push({ name: "lag " + w.name, points: lagSeries(s["broker:version"], w.points) });
    }
  }
  charts.lag.draw(lag);
  const req = [];
  for (const [field, label] of [["requeued", "requeued/s"], ["failed", "failed/s"], ["dropped_stale", "dropped stale/s"]]) {
    if (s["broker:" + field]) req.push({ name: label, points: rate(s["broker:" + field]) });
  }
  charts.requeues.draw(req);
}

function renderBroker(state) {
  const box = document.getElementById("broker");
  box.replaceChildren();
  const b = state.broker;
  if (!b) { box.append(el("span", "no broker state", "muted")); return; }
  const names = ["version", "queued", "leased", "held", "dispatched", "completed", "requeued", "duplicates", "failed", "dropped_stale", "workers_alive"];
  for (const n of names) {
    if (!(n in b)) continue;
    const card = el("div", null, "stat");
    card.append(el("div", n === "version" ? fmtVersion(b[n]) : b[n], "value"), el("div", n.replace("_", " "), "label"));
    box.append(card);
  }
  // generated tokens never delivered to training, as a share, by reason
  if (typeof b.wasted_share === "number" && b.generated_tokens > 0) {
    for (const [field, label] of [["wasted_share", "wasted"], ["wasted_share_stale_drop", "wasted: stale drop"],
      ["wasted_share_cancel", "wasted: cancel"], ["wasted_share_failure", "wasted: failure"], ["wasted_share_duplicate", "wasted: duplicate"]]) {
      if (typeof b[field] !== "number") continue;
      const card = el("div", null, "stat");
      card.append(el("div", (100 * b[field]).toFixed(1) + "%", "value"), el("div", label, "label"));
      box.append(card);
    }
  }
}

function renderWorkers(state) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  const lags = state.version_lag || {};
  const ids = Object.keys(state.workers).sort();
  for (const id of ids) {
    const w = state.workers[id];
    const tr = el("tr");
    const tps = typeof w.tokens_per_s === "number" ? w.tokens_per_s.toFixed(1) : "-";
    for (const v of [id, w.host, w.engine, w.state, fmtVersion(w.weight_version), lags[id], w.inflight, w.credits, tps, w.tokens_total, w.age_s]) {
      tr.append(el("td", v === undefined || v === null ? "-" : v));
    }
    if ((lags[id] || 0) > 0) tr.className = "lagging";
    body.append(tr);
  }
  document.getElementById("alive").textContent = String(ids.length);
}

function renderHistogram(state) {
  const box = document.getElementById("hist");
  box.replaceChildren();
  const h = (state.histograms || {}).staleness;
  if (!h || !h.count) { box.append(el("span", "no samples", "muted")); return; }
  const top = Math.max(...h.buckets.map((b) => b[1]), 1);
  for (const [bound, n] of h.buckets) {
    if (!n) continue;
    const row = el("div", null, "bar-row");
    const bar = el("span", null, "bar");
    bar.style.width = Math.max(2, (300 * n) / top) + "px";
    row.append(el("span", "<= " + bound, "bar-label"), bar, el("span", " " + n));
    box.append(row);
  }
  box.append(el("div", "n=" + h.count + ", mean " + (h.sum / h.count).toFixed(2), "muted"));
}

function renderEvents(state) {
  const body = document.querySelector("#events tbody");
  body.replaceChildren();
  for (const ev of [...state.events].reverse().slice(0, 30)) {
    const tr = el("tr");
    const detail = Object.entries(ev.fields).map(([k, v]) => k + "=" + v).join(" ");
    tr.append(el("td", new Date(ev.ts * 1000).toTimeString().slice(0, 8)), el("td", ev.kind), el("td", ev.src), el("td", detail));
    if (/error|lost|failed/.test(ev.kind)) tr.className = "bad";
    body.append(tr);
  }
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("api/state", { cache: "no-store" });
    const state = await resp.json();
    if (!resp.ok) throw new Error(state.error || resp.statusText);
    document.getElementById("pool").textContent = state.pool;
    renderBroker(state);
    renderWorkers(state);
    renderHistogram(state);
    renderEvents(state);
    renderCharts(state);
    status.textContent = "updated " + new Date().toTimeString().slice(0, 8);
    status.className = "ok";
    document.body.dataset.loaded = "1";
  } catch (err) {
    status.textContent = "cannot read state: " + err.message;
    status.className = "bad";
  }
}

window.addEventListener("load", () => {
  charts.queue = new LineChart(document.getElementById("chart-queue"), { title: "Queue depth", unit: "tasks" });
  charts.tokens = new LineChart(document.getElementById("chart-tokens"), { title: "Tokens/s per worker", unit: "tok/s" });
  charts.lag = new LineChart(document.getElementById("chart-lag"), { title: "Version lag", unit: "versions" });
  charts.requeues = new LineChart(document.getElementById("chart-requeues"), { title: "Requeues", unit: "per s" });
  poll();
  setInterval(poll, POLL_MS);
});

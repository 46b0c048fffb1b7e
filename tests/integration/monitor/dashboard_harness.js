// Runs the dashboard's own scripts under Node with a recording canvas and a minimal DOM,
// feeds them one /api/state reply, and prints what each chart drew (as JSON).
// Usage: node dashboard_harness.js STATIC_DIR STATE_JSON_FILE
"use strict";
const fs = require("fs");
const path = require("path");
const vm = require("vm");

const [staticDir, stateFile] = process.argv.slice(2);
const state = JSON.parse(fs.readFileSync(stateFile, "utf8"));
const elements = {};
const drawn = {};

function recordingContext(id) {
  drawn[id] = { lineTo: 0, moveTo: 0, text: [] };
  return {
    font: "", fillStyle: "", strokeStyle: "", lineWidth: 1,
    setTransform() {}, clearRect() {}, beginPath() {}, stroke() {}, strokeRect() {}, fillRect() {},
    moveTo() { drawn[id].moveTo += 1; },
    lineTo() { drawn[id].lineTo += 1; },
    fillText(t) { drawn[id].text.push(String(t)); },
    measureText(t) { return { width: String(t).length * 6 }; },
  };
}

function fakeElement(id) {
  const el = {
    id, children: [], dataset: {}, style: {}, className: "", textContent: "",
    clientWidth: 480, clientHeight: 240, width: 0, height: 0,
    append(...c) { this.children.push(...c); },
    replaceChildren(...c) { this.children = c; },
    getContext() { return this._ctx || (this._ctx = recordingContext(id)); },
  };
  return el;
}

const document = {
  body: fakeElement("body"),
  getElementById(id) { return elements[id] || (elements[id] = fakeElement(id)); },
  querySelector(sel) { return elements[sel] || (elements[sel] = fakeElement(sel)); },
  createElement(tag) { return fakeElement(tag); },
};
let onLoad = null;
const sandbox = {
  document, console, Date, Math, Number, Object, String, JSON, Promise, Error,
  devicePixelRatio: 1,
  setInterval() {},
  addEventListener(kind, fn) { if (kind === "load") onLoad = fn; },
  fetch: async () => ({ ok: true, statusText: "OK", json: async () => state }),
};
sandbox.window = sandbox;
vm.createContext(sandbox);
for (const name of ["chart.js", "dashboard.js"]) {
  vm.runInContext(fs.readFileSync(path.join(staticDir, name), "utf8"), sandbox, { filename: name });
}
onLoad();
setTimeout(() => {
  const out = { loaded: document.body.dataset.loaded || "0", status: elements.status.textContent, charts: {} };
  for (const id of ["chart-queue", "chart-tokens", "chart-lag", "chart-requeues"]) {
    out.charts[id] = { points: Number(elements[id].dataset.points || 0), lineTo: drawn[id] ? drawn[id].lineTo : 0,
                       text: drawn[id] ? drawn[id].text : [] };
  }
  out.brokerCards = (elements.broker ? elements.broker.children : []).map((c) => c.children.map((x) => String(x.textContent)));
  out.workerRows = elements["#workers tbody"].children.length;
  out.eventRows = elements["#events tbody"].children.length;
  process.stdout.write(JSON.stringify(out));
}, 50);

// rollpool's dashboard charts: a small line chart on a <canvas>, no dependencies.
// new LineChart(canvas, {title, unit}).draw([{name, points: [[unix_s, value], ...]}, ...])
"use strict";

const PALETTE = ["#2f7ed8", "#e4572e", "#29a329", "#a35bd6", "#f0a30a", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];

function niceStep(range, ticks) {
  const raw = range / Math.max(1, ticks);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  const step = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
  return step * mag;
}

function formatValue(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  return v.toFixed(2);
}

function formatTime(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

class LineChart {
  constructor(canvas, options) {
    this.canvas = canvas;
    this.options = Object.assign({ title: "", unit: "", minY: 0 }, options || {});
    this.series = [];
  }

  draw(series) {
    this.series = series || [];
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || 480;
    const cssH = canvas.clientHeight || 220;
    if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    ctx.font = "12px system-ui, sans-serif";

    const pad = { left: 48, right: 12, top: 24, bottom: 34 };
    const plotW = cssW - pad.left - pad.right;
    const plotH = cssH - pad.top - pad.bottom;
    ctx.fillStyle = "#222";
    ctx.fillText(this.options.title + (this.options.unit ? " (" + this.options.unit + ")" : ""), pad.left, 15);

    let tMin = Infinity, tMax = -Infinity, yMin = this.options.minY, yMax = -Infinity;
    for (const s of this.series) {
      for (const [t, v] of s.points) {
        if (!Number.isFinite(v)) continue;
        tMin = Math.min(tMin, t); tMax = Math.max(tMax, t);
        yMin = Math.min(yMin, v); yMax = Math.max(yMax, v);
      }
    }
    if (!Number.isFinite(tMin)) {
      ctx.fillStyle = "#888";
      ctx.fillText("no data yet", pad.left + plotW / 2 - 30, pad.top + plotH / 2);
      canvas.dataset.points = "0";
      return;
    }
    if (tMax - tMin < 1) tMin = tMax - 60;
    if (yMax <= yMin) yMax = yMin + 1;
    const step = niceStep(yMax - yMin, 4);
    yMax = Math.ceil(yMax / step) * step;
    const x = (t) => pad.left + ((t - tMin) / (tMax - tMin)) * plotW;
    const y = (v) => pad.top + plotH - ((v - yMin) / (yMax - yMin)) * plotH;

    ctx.strokeStyle = "#e6e6e6";
    ctx.fillStyle = "#666";
    ctx.lineWidth = 1;
    for (let v = yMin; v <= yMax + step / 2; v += step) {
      ctx.beginPath(); ctx.moveTo(pad.left, y(v)); ctx.lineTo(pad.left + plotW, y(v)); ctx.stroke();
      ctx.fillText(formatValue(v), 4, y(v) + 4);
    }
    const tStep = niceStep(tMax - tMin, 4);
    for (let t = Math.ceil(tMin / tStep) * tStep; t <= tMax; t += tStep) {
      ctx.fillText(formatTime(t), x(t) - 24, pad.top + plotH + 16);
    }
    ctx.strokeStyle = "#999";
    ctx.strokeRect(pad.left, pad.top, plotW, plotH);

    let drawn = 0;
    let legendX = pad.left;
    this.series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      ctx.strokeStyle = color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let started = false;
      for (const [t, v] of s.points) {
        if (!Number.isFinite(v)) { started = false; continue; }
        if (!started) { ctx.moveTo(x(t), y(v)); started = true; } else { ctx.lineTo(x(t), y(v)); }
        drawn += 1;
      }
      ctx.stroke();
      ctx.fillStyle = color;
      ctx.fillRect(legendX, cssH - 12, 10, 4);
      ctx.fillStyle = "#333";
      ctx.fillText(s.name, legendX + 14, cssH - 6);
      legendX += 24 + ctx.measureText(s.name).width;
    });
    canvas.dataset.points = String(drawn);
  }
}

window.LineChart = LineChart;

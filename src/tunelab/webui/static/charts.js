// SVG charts for the web UI: line charts of a run's log and the bar chart of sample lengths.
// Each chart has a title, labelled axes with round tick values and a legend; the <svg> carries
// data-points (how many points it draws) so that a test can watch a curve grow.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
function ticks(lo, hi, count, integer = false) {
  if (!(hi > lo)) { hi = lo + (lo === 0 ? 1 : Math.abs(lo) * 0.1); }
  const raw = Math.max((hi - lo) / Math.max(count, 1), integer ? 1 : 0);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= raw);
  const out = [];  // from the last round value at or below lo to the first at or above hi
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  for (let v = first; v <= last + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return {values: out, lo: Math.min(lo, out[0]), hi: Math.max(hi, out[out.length - 1])};
}

function formatNumber(v) {
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e15) return v.toLocaleString("en-US");
  if (a !== 0 && (a < 1e-4 || a >= 1e5)) return v.toExponential(1);
  return String(+v.toPrecision(4));
}

function frame(container, title, xLabel, yLabel, width, height) {
  container.innerHTML = "";
  const svg = svgEl("svg", {viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img", "aria-label": title});
  svg.appendChild(svgEl("text", {x: width / 2, y: 18, "text-anchor": "middle", class: "title"}, title));
  svg.appendChild(svgEl("text", {x: width / 2, y: height - 6, "text-anchor": "middle", class: "axis-label"}, xLabel));
  svg.appendChild(svgEl("text", {x: 14, y: height / 2, "text-anchor": "middle", class: "axis-label",
    transform: `rotate(-90 14 ${height / 2})`}, yLabel));
  container.appendChild(svg);
  return svg;
}

function axes(svg, box, xt, yt, sx, sy) {
  for (const v of yt.values) {
    const y = sy(v);
    svg.appendChild(svgEl("line", {x1: box.left, x2: box.right, y1: y, y2: y, class: "grid"}));
    svg.appendChild(svgEl("text", {x: box.left - 6, y: y + 4, "text-anchor": "end", class: "tick"}, formatNumber(v)));
  }
  for (const v of xt.values) {
    const x = sx(v);
    svg.appendChild(svgEl("line", {x1: x, x2: x, y1: box.bottom, y2: box.bottom + 4, class: "axis"}));
    svg.appendChild(svgEl("text", {x: x, y: box.bottom + 17, "text-anchor": "middle", class: "tick"}, formatNumber(v)));
  }
  svg.appendChild(svgEl("line", {x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom, class: "axis"}));
  svg.appendChild(svgEl("line", {x1: box.left, x2: box.left, y1: box.top, y2: box.bottom, class: "axis"}));
}

// series: [{name, points: [[x, y], ...]}]
function lineChart(container, {title, xLabel, yLabel, series, width = 460, height = 260}) {
  const svg = frame(container, title, xLabel, yLabel, width, height);
  const box = {left: 66, right: width - 14, top: 30, bottom: height - 42};
  const all = series.flatMap(s => s.points).filter(p => Number.isFinite(p[1]));
  svg.setAttribute("data-points", String(all.length));
  if (!all.length) {
    svg.appendChild(svgEl("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty"}, "no points yet"));
    return svg;
  }
  const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
  const xt = ticks(Math.min(0, ...xs), Math.max(...xs), 6, true);  // steps are whole numbers
  const yt = ticks(Math.min(...ys), Math.max(...ys), 5);
  const sx = v => box.left + (v - xt.lo) / (xt.hi - xt.lo) * (box.right - box.left);
  const sy = v => box.bottom - (v - yt.lo) / (yt.hi - yt.lo) * (box.bottom - box.top);
  axes(svg, box, xt, yt, sx, sy);
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    const pts = s.points.filter(p => Number.isFinite(p[1]));
    if (pts.length > 1) {
      svg.appendChild(svgEl("polyline", {points: pts.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "),
        fill: "none", stroke: color, "stroke-width": 2}));
    }
    for (const p of pts) {
      const dot = svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.6, fill: color});
      dot.appendChild(svgEl("title", {}, `${s.name}: step ${p[0]}, ${formatNumber(p[1])}`));
      svg.appendChild(dot);
    }
    if (series.filter(t => t.points.length).length > 1 && pts.length) {  // a legend when curves need telling apart
      const y = box.top + 6 + i * 15;
      svg.appendChild(svgEl("rect", {x: box.right - 150, y: y - 8, width: 10, height: 10, fill: color}));
      svg.appendChild(svgEl("text", {x: box.right - 136, y: y + 1, class: "legend"}, s.name));
    }
  });
  return svg;
}

// bins: [[first length, last length, count], ...]; marker: a vertical line at x (cutoff_len)
function barChart(container, {title, xLabel, yLabel, bins, marker, markerLabel, width = 460, height = 260}) {
  const svg = frame(container, title, xLabel, yLabel, width, height);
  const box = {left: 66, right: width - 14, top: 30, bottom: height - 42};
  svg.setAttribute("data-points", String(bins.length));
  if (!bins.length) return svg;
  const lo = bins[0][0], hi = Math.max(bins[bins.length - 1][1] + 1, marker || 0);
  const xt = ticks(lo, hi, 6, true);
  const yt = ticks(0, Math.max(...bins.map(b => b[2])), 5);
  const sx = v => box.left + (v - xt.lo) / (xt.hi - xt.lo) * (box.right - box.left);
  const sy = v => box.bottom - (v - yt.lo) / (yt.hi - yt.lo) * (box.bottom - box.top);
  axes(svg, box, xt, yt, sx, sy);
  for (const [a, b, n] of bins) {
    const bar = svgEl("rect", {x: sx(a), y: sy(n), width: Math.max(1, sx(b + 1) - sx(a) - 1),
      height: box.bottom - sy(n), fill: PALETTE[0]});
    bar.appendChild(svgEl("title", {}, `${a}-${b} tokens: ${n}`));
    svg.appendChild(bar);
  }
  if (marker) {
    const x = sx(marker);
    svg.appendChild(svgEl("line", {x1: x, x2: x, y1: box.top, y2: box.bottom, stroke: "#d62728", "stroke-dasharray": "4 3"}));
    svg.appendChild(svgEl("text", {x: x - 4, y: box.top + 10, "text-anchor": "end", class: "legend"}, markerLabel || ""));
  }
  return svg;
}

// rlharvest monitor: polls api/stats twice a second and draws the fleet (no library, no network
// beyond this page's server). Read-only: it only ever sends GET requests.
"use strict";

const POLL_MS = 500;
const HISTORY_S = 300;          // seconds of throughput and learner wait the charts show
const RATE_WINDOW_S = 3;        // seconds a rate is measured over
const MAX_EVENTS = 300;         // timeline entries kept on the page
const query = new URLSearchParams(location.search);
const token = query.get("token");

const state = {
  lastSeq: 0, samples: [], workers: new Map(), restarts: new Map(), failures: 0, lastTime: 0,
};

const $ = (id) => document.getElementById(id);
const metric = (name) => document.querySelector(`[data-metric="${name}"]`);
const SVG = "http://www.w3.org/2000/svg";

function fmtInt(n) { return n == null ? "–" : Math.round(n).toLocaleString("en-US"); }
function fmtRate(n) {
  if (n == null || !isFinite(n)) return "–";
  if (n === 0) return "0";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + "M";
  if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return n >= 100 ? Math.round(n).toString() : n.toFixed(1);
}
function fmtSeconds(s) {
  if (s == null || !isFinite(s)) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
function fmtBound(s) {  // a bucket's bound, short: 500µs, 2.5ms, 10s
  const [value, unit] = s < 1e-3 ? [s * 1e6, "µs"] : s < 1 ? [s * 1e3, "ms"] : [s, "s"];
  return String(+value.toPrecision(3)) + unit;
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false }); }

// ------------------------------------------------------------------------------------------- polling
async function poll() {
  const params = new URLSearchParams({ since: String(state.lastSeq) });
  if (token) params.set("token", token);
  try {
    const response = await fetch(`api/stats?${params}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    state.failures = 0;
  } catch (err) {
    state.failures += 1;
    if (state.failures >= 2) setStatus("unreachable", `monitor unreachable (${err.message})`);
  }
  setTimeout(poll, POLL_MS);
}

function setStatus(kind, text) {
  $("status").dataset.state = kind;
  $("status-text").textContent = text;
}

// ------------------------------------------------------------------------------------------- rendering
function render(data) {
  const stats = data.stats;
  $("collector").textContent = data.collector;
  document.title = `${data.collector} · rlharvest monitor`;
  setStatus(data.closed ? "shut down" : "running", data.closed ? "shut down" : "running");
  $("updated").textContent = `updated ${clock(data.time)}`;
  if (data.time > state.lastTime) {
    state.samples.push({ t: data.time, frames: stats.frames, wait: data.learner_wait_s });
    while (state.samples.length > 2 && state.samples[0].t < data.time - HISTORY_S - RATE_WINDOW_S) state.samples.shift();
    state.lastTime = data.time;
  }
  renderKpis(data, stats);
  renderWorkers(data.workers, data.time);
  renderEvents(data.events);
  state.lastSeq = Math.max(state.lastSeq, data.last_seq);
  drawSeries($("chart-fps"), rates("frames"), "fps", fmtRate);
  drawSeries($("chart-wait"), rates("wait").map(([t, v]) => [t, Math.min(100, v * 100)]), "wait",
             (v) => v.toFixed(0) + "%", 100);
  drawHistogram($("chart-sync"), data.weight_syncs, stats);
}

function renderKpis(data, stats) {
  metric("frames").textContent = String(stats.frames);
  metric("batches").textContent = fmtInt(stats.batches);
  const series = rates("frames");
  metric("fps").textContent = series.length ? fmtRate(series[series.length - 1][1]) : "–";
  const budget = stats.total_frames;
  $("budget").textContent = budget ? `of ${fmtInt(budget)} (${(100 * stats.frames / budget).toFixed(1)}%)` : "no frame budget";
  $("budget-fill").style.width = budget ? `${Math.min(100, 100 * stats.frames / budget)}%` : "0";
  $("fpb").textContent = `${fmtInt(stats.requested_frames_per_batch)} frames each`;
  const active = stats.workers != null ? stats.workers : data.workers.length;
  metric("workers").textContent = String(active);
  const alive = stats.workers_alive;
  $("alive").textContent = alive == null ? "in process" : `${alive} alive` +
    (stats.workers_removed ? `, ${stats.workers_removed} gone` : "") +
    (stats["autoscale/collectors"] != null ? " · autoscaled" : "");
  const restarts = metric("restarts");
  restarts.textContent = String(stats.restarts || 0);
  restarts.classList.toggle("alert", (stats.restarts || 0) > 0);
  $("preemptions").textContent = `${stats.preemptions || 0} preempted`;
  metric("policy-version").textContent = String(data.policy_version);
  $("lag").textContent = stats.policy_lag != null ? `last batch ${stats.policy_lag} behind` : "";
  const waits = rates("wait");
  metric("learner-wait").textContent = waits.length ? `${Math.min(100, 100 * waits[waits.length - 1][1]).toFixed(0)}%` : "–";
}

// [time, rate] of a cumulative field of the samples, each over the last RATE_WINDOW_S seconds
function rates(field) {
  const out = [], samples = state.samples;
  let start = 0;
  for (let i = 1; i < samples.length; i++) {
    while (start < i - 1 && samples[i].t - samples[start + 1].t >= RATE_WINDOW_S) start++;
    const dt = samples[i].t - samples[start].t;
    if (dt > 0) out.push([samples[i].t, Math.max(0, (samples[i][field] - samples[start][field]) / dt)]);
  }
  return out;
}

// ------------------------------------------------------------------------------------------- workers
function renderWorkers(rows, now) {
  const body = $("workers");
  const seen = new Set();
  const fastest = Math.max(1, ...rows.map((row) => workerRate(row, now) || 0));
  rows.forEach((row, position) => {
    seen.add(row.index);
    let tr = body.querySelector(`tr[data-worker="${row.index}"]`);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.worker = String(row.index);
      tr.innerHTML = '<td class="num" data-field="index"></td><td class="host" data-field="host"></td>' +
        '<td data-field="state"><span class="state"></span></td><td class="num" data-field="frames"></td>' +
        '<td class="num" data-field="fps"><span class="speedbar"><i></i></span><span></span></td>' +
        '<td class="num" data-field="policy"></td><td class="num" data-field="held"></td>' +
        '<td class="num" data-field="restarts"></td>';
    }
    if (body.children[position] !== tr) body.insertBefore(tr, body.children[position] || null);
    const cell = (name) => tr.querySelector(`[data-field="${name}"]`);
    cell("index").textContent = String(row.index);
    cell("host").textContent = row.host || "–";
    cell("host").title = row.host || "";
    const badge = cell("state").firstChild;
    badge.textContent = row.state;
    badge.dataset.state = row.state;
    cell("frames").textContent = fmtInt(row.frames);
    const rate = workerRate(row, now);
    cell("fps").lastChild.textContent = fmtRate(rate);
    cell("fps").querySelector("i").style.width = `${rate ? Math.round(100 * rate / fastest) : 0}%`;
    cell("fps").title = row.rollout_frames_per_s != null ? `its rollouts run at ${fmtRate(row.rollout_frames_per_s)} frames/s` : "";
    cell("policy").textContent = row.policy_version == null ? "–" :
      `v${row.policy_version}` + (row.policy_lag ? ` (−${row.policy_lag})` : "");
    cell("held").textContent = fmtSeconds(row.held_s);
    const restarts = row.restarts + (row.preemptions || 0);
    const previous = state.restarts.get(row.index);
    cell("restarts").textContent = String(row.restarts) + (row.preemptions ? ` +${row.preemptions} left` : "");
    cell("restarts").classList.toggle("restarts-hot", row.restarts > 0);
    if (previous != null && restarts > previous) {
      tr.classList.remove("flash"); void tr.offsetWidth; tr.classList.add("flash");
    }
    state.restarts.set(row.index, restarts);
  });
  for (const tr of [...body.querySelectorAll("tr[data-worker]")]) {
    if (!seen.has(Number(tr.dataset.worker))) { tr.remove(); state.workers.delete(Number(tr.dataset.worker)); }
  }
  $("no-workers").hidden = rows.length > 0;
  $("workers-note").textContent = rows.length ? `${rows.length} active` : "";
}

// frames per second a worker delivered over the last few seconds (a replacement starts afresh)
function workerRate(row, now) {
  if (row.frames == null) return null;
  let history = state.workers.get(row.index);
  if (!history || (history.length && row.frames < history[history.length - 1].frames)) history = [];
  if (!history.length || history[history.length - 1].t < now) history.push({ t: now, frames: row.frames });
  while (history.length > 2 && now - history[1].t >= RATE_WINDOW_S) history.shift();
  state.workers.set(row.index, history);
  const first = history[0], last = history[history.length - 1];
  return last.t > first.t ? (last.frames - first.frames) / (last.t - first.t) : null;
}

// ------------------------------------------------------------------------------------------- events
function renderEvents(events) {
  const list = $("timeline");
  for (const event of events) {
    if (event.seq <= state.lastSeq) continue;
    const item = document.createElement("li");
    item.className = "new";
    item.dataset.event = event.kind;
    item.dataset.seq = String(event.seq);
    const when = document.createElement("time");
    when.textContent = clock(event.time);
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.dataset.kind = event.kind;
    kind.textContent = event.kind.replace("_", " ");
    const message = document.createElement("span");
    message.className = "msg";
    message.textContent = event.message;
    const why = reason(event);
    if (why) {
      const detail = document.createElement("span");
      detail.className = "why";
      detail.textContent = why;
      message.appendChild(detail);
    }
    item.append(when, kind, message);
    list.insertBefore(item, list.firstChild);
  }
  while (list.children.length > MAX_EVENTS) list.removeChild(list.lastChild);
  $("no-events").hidden = list.children.length > 0;
  $("events-note").textContent = list.children.length ? `${list.children.length} shown, newest first` : "";
}

function reason(event) {
  const d = event.details || {};
  if (event.kind === "autoscale" && d.reason) return `why: ${d.reason}`;
  if (event.kind === "restart" && d.cause) return `cause: ${d.cause}`;
  if (event.kind === "join_refused" && d.reason) return `reason: ${d.reason}`;
  return "";
}

// ------------------------------------------------------------------------------------------- charts
function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  if (parent) parent.appendChild(el);
  return el;
}

function frame(svg) {
  const width = Math.max(200, svg.clientWidth || 300), height = Math.max(100, svg.clientHeight || 150);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  return { width, height, left: 44, right: width - 8, top: 8, bottom: height - 18 };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function drawSeries(svg, points, kind, format, fixedMax) {
  const box = frame(svg);
  if (points.length < 2) {
    svgEl("text", { x: box.width / 2, y: box.height / 2, "text-anchor": "middle", class: "none" }, svg)
      .textContent = "waiting for batches…";
    return;
  }
  const tEnd = points[points.length - 1][0], tStart = Math.max(points[0][0], tEnd - HISTORY_S);
  const shown = points.filter(([t]) => t >= tStart);
  const yMax = fixedMax || niceMax(Math.max(...shown.map(([, v]) => v)) * 1.1);
  const x = (t) => box.left + (box.right - box.left) * (tEnd > tStart ? (t - tStart) / (tEnd - tStart) : 1);
  const y = (v) => box.bottom - (box.bottom - box.top) * Math.min(1, v / yMax);
  for (const fraction of [0, 0.5, 1]) {
    const value = yMax * fraction, py = y(value);
    svgEl("line", { x1: box.left, x2: box.right, y1: py, y2: py, class: "grid" }, svg);
    svgEl("text", { x: box.left - 4, y: py + 3, "text-anchor": "end" }, svg).textContent = format(value);
  }
  const span = tEnd - tStart;
  svgEl("text", { x: box.left, y: box.height - 4 }, svg).textContent = `−${Math.round(span)} s`;
  svgEl("text", { x: box.right, y: box.height - 4, "text-anchor": "end" }, svg).textContent = "now";
  const line = shown.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  svgEl("polygon", { points: `${x(shown[0][0])},${box.bottom} ${line} ${x(tEnd)},${box.bottom}`,
                     class: `${kind}-area` }, svg);
  svgEl("polyline", { points: line, class: `${kind}-line` }, svg);
}

function drawHistogram(svg, histogram, stats) {
  const box = frame(svg);
  if (!histogram || !histogram.count) {
    $("sync-summary").textContent = "none yet";
    svgEl("text", { x: box.width / 2, y: box.height / 2, "text-anchor": "middle", class: "none" }, svg)
      .textContent = "no weight update yet";
    return;
  }
  $("sync-summary").textContent = `${fmtInt(histogram.count)} · last ${fmtSeconds(stats.weight_sync_s_last)}` +
    ` · median ${fmtSeconds(stats.weight_sync_s_median)}`;
  $("sync-summary").title = `mean ${fmtSeconds(histogram.sum_s / histogram.count)} over all updates`;
  const counts = histogram.cumulative.map((c, i) => c - (i ? histogram.cumulative[i - 1] : 0));
  counts.push(histogram.count - histogram.cumulative[histogram.cumulative.length - 1]);
  let first = counts.findIndex((c) => c > 0), last = counts.length - 1 - [...counts].reverse().findIndex((c) => c > 0);
  first = Math.max(0, first - 1); last = Math.min(counts.length - 1, last + 1);
  const shown = counts.slice(first, last + 1);
  const labels = histogram.bounds.map((b) => "≤" + fmtBound(b)).concat([">" + fmtBound(histogram.bounds[histogram.bounds.length - 1])]);
  const yMax = niceMax(Math.max(...shown));
  const slot = (box.right - box.left) / shown.length;
  for (const fraction of [0, 0.5, 1]) {
    const py = box.bottom - (box.bottom - box.top) * fraction;
    svgEl("line", { x1: box.left, x2: box.right, y1: py, y2: py, class: "grid" }, svg);
    svgEl("text", { x: box.left - 4, y: py + 3, "text-anchor": "end" }, svg).textContent = fmtInt(yMax * fraction);
  }
  shown.forEach((count, i) => {
    const h = (box.bottom - box.top) * count / yMax;
    const bar = svgEl("rect", { x: box.left + i * slot + 2, y: box.bottom - h, width: Math.max(1, slot - 4),
                                height: h, class: "bar" }, svg);
    svgEl("title", {}, bar).textContent = `${labels[first + i]}: ${count}`;
    if (slot >= 46 || i % Math.ceil(46 / slot) === 0) {  // labels never overlap
      svgEl("text", { x: box.left + (i + 0.5) * slot, y: box.height - 4, "text-anchor": "middle" }, svg)
        .textContent = labels[first + i];
    }
  });
}

poll();

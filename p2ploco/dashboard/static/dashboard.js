// The p2ploco dashboard: reads the node's JSON documents (format 1: p2ploco/dashboard/documents.py) every
// REFRESH_MS and redraws. Every string a peer wrote reaches the page as text (textContent), never as markup; the
// server's Content-Security-Policy runs no script but this page's own.
"use strict";

const FORMAT = 1;
const REFRESH_MS = 2000;
const ROUNDS_SHOWN = 20; // rows of the rounds table

const state = {
  run: null, // the run document
  rounds: [], // every round the node served, oldest first
  peers: null, // the status document
  weights: {}, // the newest applied aggregate's weights, by peer
  sort: { key: "round", up: false },
  charts: {},
  timings: { firstLoad: null, updates: [] }, // ms: navigation to the first full render; each update's fetch + render
  updates: 0,
};
window.p2plocoDashboard = state; // what a test or a curious person reads

const $ = (id) => document.getElementById(id);

function text(tag, value, className) {
  const element = document.createElement(tag);
  element.textContent = value === null || value === undefined ? "-" : String(value);
  if (className) element.className = className;
  return element;
}

function number(value, digits) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function bytes(count) {
  const units = ["B", "kB", "MB", "GB"];
  let unit = 0;
  while (Math.abs(count) >= 1000 && unit < units.length - 1) { count /= 1000; unit += 1; }
  return unit === 0 ? `${count.toFixed(0)} B` : `${count.toFixed(1)} ${units[unit]}`;
}

function tokens(count) {
  if (count >= 1e9) return `${(count / 1e9).toFixed(2)}B`;
  if (count >= 1e6) return `${(count / 1e6).toFixed(2)}M`;
  if (count >= 1e3) return `${(count / 1e3).toFixed(1)}k`;
  return String(count);
}

async function read(path) {
  const answer = await fetch(path); // the node says no-store: nothing is cached
  if (!answer.ok) throw new Error(`${path} answered ${answer.status}: ${(await answer.text()).slice(0, 200)}`);
  const document_ = await answer.json();
  if (document_.format !== FORMAT) throw new Error(`${path} is in format ${document_.format}; this page reads ${FORMAT}`);
  return document_;
}

function problem(message) {
  const banner = $("problem");
  banner.hidden = message === null;
  banner.textContent = message === null ? "" : message;
}

// ---- charts (uPlot) ----

const orBlank = (format) => (value) => (value === null || value === undefined ? "" : format(value)); // axis ticks

// Each chart: where it goes, its series after x, its axes and scales, and its data from the rounds.
const line = (label, stroke, extra) => ({ label, stroke, width: 2, spanGaps: true, ...extra });
const points = (label, stroke) => ({ label, stroke, fill: stroke, paths: () => null,
                                     points: { show: true, size: 9, fill: stroke } });
const CHARTS = {
  lossByRound: {
    element: "chart-loss-round", x: "round", axes: [{ label: "round" }, { label: "loss" }],
    series: () => [line("train loss", "#2f6fdf"), line("eval loss", "#e0762b", { points: { show: true, size: 5 } })],
    data: (rounds) => [rounds.map((r) => r.round), rounds.map((r) => r.loss), rounds.map((r) => r.eval_loss)],
  },
  lossByTokens: {
    element: "chart-loss-tokens", x: "tokens",
    axes: [{ label: "tokens", values: (u, ticks) => ticks.map(orBlank(tokens)) }, { label: "loss" }],
    series: () => [line("train loss", "#2f6fdf"), line("eval loss", "#e0762b", { points: { show: true, size: 5 } })],
    data: (rounds) => {
      let total = 0;
      return [rounds.map((r) => (total += r.aggregate_tokens)), rounds.map((r) => r.loss),
              rounds.map((r) => r.eval_loss)];
    },
  },
  peers: {
    element: "chart-peers", x: "round", axes: [{ label: "round" }, { label: "peers" }],
    series: () => [line("peers in the group", "#4b8b3b", { paths: uPlot.paths.stepped({ align: 1 }) }),
                   points("not applied", "#c62828")],
    data: (rounds) => [rounds.map((r) => r.round), rounds.map((r) => r.peers),
                       rounds.map((r) => (r.applied ? null : r.peers))],
  },
  time: {
    element: "chart-time", x: "round", axes: [{ label: "round" }, { label: "seconds" }],
    series: () => [line("round (inner + communication)", "#e0762b", { fill: "rgba(224,118,43,0.25)" }),
                   line("inner steps", "#2f6fdf", { fill: "rgba(47,111,223,0.3)" })],
    data: (rounds) => [rounds.map((r) => r.round), rounds.map((r) => r.inner_seconds + r.comm_seconds),
                       rounds.map((r) => r.inner_seconds)],
  },
  bytes: {
    element: "chart-bytes", x: "round",
    axes: [{ label: "round" }, { label: "bytes", values: (u, ticks) => ticks.map(orBlank(bytes)), size: 70 }],
    scales: { x: { time: false }, y: { distr: 3 } }, // log: dense fp32 is two orders above what is sent
    series: () => [line("sent + received", "#2f6fdf"), line("dense fp32", "#9aa3b5", { dash: [6, 4] })],
    data: (rounds) => [rounds.map((r) => r.round), rounds.map((r) => r.bytes_sent + r.bytes_received || null),
                       rounds.map((r) => r.dense_fp32_bytes || null)],
  },
};

function drawCharts() { // built with their data the first time (one layout each), given new data after
  const widths = Object.fromEntries(Object.entries(CHARTS).map(([name, c]) => [name, $(c.element).clientWidth]));
  for (const [name, c] of Object.entries(CHARTS)) {
    const data = c.data(state.rounds);
    if (state.charts[name]) { state.charts[name].setData(data); continue; }
    state.charts[name] = new uPlot({ width: Math.max(300, widths[name] || 600), height: 240,
                                     series: [{ label: c.x }, ...c.series()], axes: c.axes,
                                     scales: c.scales || { x: { time: false } }, legend: { live: true } },
                                   data, $(c.element));
  }
}

// ---- tables ----

function roleOf(peer) {
  return peer.role === "stage" ? `stage ${peer.stage} of ${peer.group}` : peer.role;
}

function peerRows() {
  const ttl = state.run ? state.run.peer_ttl : 0;
  const weighed = Object.values(state.weights).reduce((a, b) => a + b, 0);
  return state.peers.peers.map((p) => {
    const weight = Object.prototype.hasOwnProperty.call(state.weights, p.peer_id) ? state.weights[p.peer_id] : null;
    const trains = p.role !== "bootstrap";
    return {
      id: p.peer_id, name: p.name, peer: p.peer_id.slice(-8), role: roleOf(p), reach: p.reachability,
      part: (state.peers.takes_part || {})[p.peer_id] || "-",
      round: trains ? p.round : null, state: p.state, step: p.step_seconds || null, tokens: weight,
      share: weight !== null && weighed ? weight / weighed : null, rate: trains ? p.tokens_per_second : null,
      seen: Math.max(0, ttl - p.expires_in), device: p.device || "-",
    };
  });
}

const SHOWN = { // how a column shows a value (other than null, shown "-"); String where none is named
  step: (v) => v.toFixed(2), share: (v) => `${(100 * v).toFixed(1)} %`, rate: (v) => `${(v / 1e3).toFixed(1)}k`,
  seen: (v) => `${v.toFixed(0)} s ago`, tokens: (v) => v.toLocaleString("en-US"),
};

function renderPeers() {
  const { key, up } = state.sort;
  const rows = peerRows().sort((a, b) => {
    const [u, v] = [a[key], b[key]];
    const order = u === v ? 0 : u === null ? 1 : v === null ? -1 : u < v ? -1 : 1;
    return up ? order : -order;
  });
  const body = document.createElement("tbody");
  for (const row of rows) {
    const tr = document.createElement("tr");
    tr.dataset.peer = row.id;
    for (const th of $("peers").tHead.rows[0].cells) {
      const column = th.dataset.key;
      const value = row[column];
      const cell = text("td", value === null ? "-" : (SHOWN[column] || String)(value), th.className);
      if (column === "peer") cell.title = row.id;
      cell.dataset.key = column;
      tr.appendChild(cell);
    }
    body.appendChild(tr);
  }
  $("peers").replaceChild(body, $("peers").tBodies[0]);
  for (const th of $("peers").tHead.rows[0].cells) {
    th.classList.toggle("sorted-up", th.dataset.key === key && up);
    th.classList.toggle("sorted-down", th.dataset.key === key && !up);
  }
  const roles = {};
  for (const p of state.peers.peers) roles[p.role] = (roles[p.role] || 0) + 1;
  $("peers-title").textContent = Object.entries(roles).map(([role, n]) => `${n} ${role}`).join(", ")
    + (state.peers.truncated ? `, ${state.peers.truncated} record(s) left out by the node` : "");
}

function renderRounds() {
  const body = document.createElement("tbody");
  for (const r of state.rounds.slice(-ROUNDS_SHOWN).reverse()) {
    const tr = document.createElement("tr");
    if (!r.applied) tr.className = "failed";
    const traffic = r.bytes_sent + r.bytes_received;
    const cells = [[r.round, "num"], [r.peers, "num"], [r.outcome], [number(r.loss, 3), "num"],
                   [number(r.eval_loss, 3), "num"], [number(r.inner_seconds, 2), "num"],
                   [number(r.comm_seconds, 2), "num"], [bytes(r.bytes_sent), "num"], [bytes(r.bytes_received), "num"],
                   [traffic ? `${(r.dense_fp32_bytes / traffic).toFixed(0)}x` : "-", "num"],
                   [r.dropped + r.opposed, "num"]];
    for (const [value, className] of cells) tr.appendChild(text("td", value, className));
    body.appendChild(tr);
  }
  $("rounds").replaceChild(body, $("rounds").tBodies[0]);
}

function renderOverview() {
  const last = state.rounds[state.rounds.length - 1];
  const evaluated = state.rounds.filter((r) => r.eval_loss !== null);
  const trainers = state.peers ? state.peers.peers.filter((p) => p.role !== "bootstrap") : [];
  $("now-round").textContent = last ? last.round : "-";
  $("now-peers").textContent = state.peers ? trainers.length : "-";
  $("now-loss").textContent = last ? number(last.loss, 3) : "-";
  $("now-eval").textContent = evaluated.length ? number(evaluated[evaluated.length - 1].eval_loss, 3) : "-";
  $("now-tokens").textContent = tokens(state.rounds.reduce((sum, r) => sum + r.aggregate_tokens, 0));
  $("now-bytes").textContent = last ? bytes(last.bytes_sent + last.bytes_received) : "-";
  $("now-failed").textContent = state.rounds.filter((r) => !r.applied).length;
}

function renderRun() {
  const run = state.run;
  $("run-id").textContent = run.run_id;
  document.title = `p2ploco: ${run.run_id}`;
  $("served-by").textContent = `served by ${run.name || "-"} (${run.peer_id})`;
  $("join-command").textContent = run.join_command;
  const body = document.createElement("tbody");
  for (const [label, value] of run.config) {
    const tr = document.createElement("tr");
    tr.appendChild(text("td", label));
    tr.appendChild(text("td", value));
    body.appendChild(tr);
  }
  $("config").replaceChild(body, $("config").tBodies[0]);
}

// ---- the loop ----

async function readRounds() {
  for (;;) { // a long run's rounds come in a few answers
    const after = state.rounds.length ? state.rounds[state.rounds.length - 1].round : null;
    const answer = await read(after === null ? "/api/v1/rounds" : `/api/v1/rounds?after=${after}`);
    state.rounds.push(...answer.rounds);
    if (Object.keys(answer.weights).length) state.weights = answer.weights;
    if (!answer.more) return;
  }
}

function fetchDocuments() { // the three requests at once: peers, the rounds not held yet, and the run once
  return Promise.all([read("/api/v1/peers"), readRounds(), state.run ? null : read("/api/v1/run")]);
}

async function update(fetching, started) {
  try {
    const [peers, , run] = await fetching;
    if (run) { state.run = run; renderRun(); }
    state.peers = peers;
    drawCharts();
    renderPeers();
    renderRounds();
    renderOverview();
    problem(null);
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    state.updates += 1;
    if (state.timings.firstLoad === null) state.timings.firstLoad = performance.now();
    else state.timings.updates.push(performance.now() - started);
  } catch (error) {
    problem(`cannot read the node: ${error.message}; trying again in ${REFRESH_MS / 1000} s`);
  }
  setTimeout(() => update(fetchDocuments(), performance.now()), REFRESH_MS);
}

function sortBy(event) {
  const key = event.target.dataset.key;
  if (!key || !state.peers) return;
  state.sort = { key, up: state.sort.key === key ? !state.sort.up : true };
  renderPeers();
}

$("peers").tHead.addEventListener("click", sortBy);
$("copy-join").addEventListener("click", () => {
  const command = $("join-command").textContent;
  if (navigator.clipboard) navigator.clipboard.writeText(command);
  else window.getSelection().selectAllChildren($("join-command"));
});
window.addEventListener("resize", () => {
  for (const c of Object.values(state.charts)) c.setSize({ width: c.root.parentNode.clientWidth, height: 240 });
});
const first = fetchDocuments(); // on the wire while uPlot loads and the charts are built
document.addEventListener("DOMContentLoaded", () => update(first, 0)); // every deferred script ran: uPlot too

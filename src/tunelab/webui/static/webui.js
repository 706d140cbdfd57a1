// The web UI's page logic: the four screens, the form checks, the runs' live view, chat, eval and export.
// Everything the page shows comes from the JSON routes of tunelab/webui/app.py.
"use strict";

const $ = sel => document.querySelector(sel);
const state = {selected: null, compare: new Set(), runs: [], chat: [], timer: null};

async function api(path, body) {
  const init = body === undefined ? {} : {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, init);
  const data = await response.json();
  return {ok: response.ok, status: response.status, data};
}

function text(el, value, cls) { el.textContent = value; if (cls !== undefined) el.className = cls; }

function showScreen(name) {
  document.querySelectorAll(".screen").forEach(s => s.classList.toggle("hidden", s.id !== `screen-${name}`));
  document.querySelectorAll(".tab").forEach(t => t.classList.toggle("active", t.dataset.screen === name));
  if (name === "runs" || name === "try") refreshRuns();
}

// ---- Configure -------------------------------------------------------------------------------------------

function formValues() {
  const out = {};
  for (const el of $("#config-form").elements) if (el.name) out[el.name] = el.value;
  return out;
}

function fillForm(values) {
  for (const el of $("#config-form").elements) if (el.name) el.value = values[el.name] ?? "";
  updateVisibility();
  scheduleCheck();
}

function updateVisibility() {
  const values = formValues();
  document.querySelectorAll("[data-shows-for]").forEach(row => {
    const rule = JSON.parse(row.dataset.showsFor);
    row.classList.toggle("hidden", !Object.entries(rule).every(([k, allowed]) => allowed.includes(values[k] ?? "")));
  });
}

let checkTimer = null, checkSeq = 0, lastChecked = null;
function scheduleCheck() { clearTimeout(checkTimer); checkTimer = setTimeout(runCheck, 300); }

async function runCheck() {
  const values = JSON.stringify(formValues());
  if (values === lastChecked) return;  // a change event after the input events of the same edit
  lastChecked = values;
  const seq = ++checkSeq;
  text($("#check-status"), "checking…", "status");
  const {data} = await api("/api/check", formValues());
  if (seq !== checkSeq) return;  // a newer change is being checked
  document.querySelectorAll(".msg").forEach(m => { m.textContent = ""; });
  document.querySelectorAll(".field.bad").forEach(f => f.classList.remove("bad"));
  if (data.ok) {
    text($("#check-status"), "✓ " + data.message, "status ok");
  } else {
    const msg = data.key && $(`#m-${data.key}`);
    if (msg) { msg.textContent = data.message; msg.parentElement.classList.add("bad"); }
    text($("#check-status"), "✗ " + data.message, "status bad");
  }
  $("#yaml-out").textContent = data.yaml;
  return data;
}

// The dataset fields offer the names of the built-in registry and of dataset_dir's dataset_info.json.
let datasetDir = null;
async function refreshDatasetNames() {
  const dir = $("#f-dataset_dir").value.trim();
  if (dir === datasetDir) return;
  datasetDir = dir;
  const {ok, data} = await api(`/api/datasets?dataset_dir=${encodeURIComponent(dir)}`);
  const list = $("#dataset-names");
  list.innerHTML = "";
  for (const name of ok ? data.names : []) { const o = document.createElement("option"); o.value = name; list.appendChild(o); }
}

async function startTraining() {
  text($("#launch-status"), "starting…", "status");
  const {ok, data} = await api("/api/launch", formValues());
  if (!ok) {
    text($("#launch-status"), "✗ " + data.error, "status bad");
    const msg = data.key && $(`#m-${data.key}`);
    if (msg) msg.textContent = data.error;
    return;
  }
  text($("#launch-status"), `started: pid ${data.pid}, writing to ${data.dir}`, "status ok");
  state.selected = data.dir;
  showScreen("runs");
}

async function loadYaml(textValue) {
  const {ok, data} = await api("/api/yaml", {text: textValue});
  if (!ok) { text($("#check-status"), "✗ " + data.error, "status bad"); return; }
  fillForm(data.form);
  $("#yaml-load").classList.add("hidden");
}

// ---- Data ------------------------------------------------------------------------------------------------

async function preview() {
  text($("#preview-status"), "reading the data…", "status");
  const {ok, data} = await api("/api/preview", formValues());
  if (!ok) { text($("#preview-status"), "✗ " + data.error, "status bad"); return; }
  text($("#preview-status"), "✓ the data as training would see it", "status ok");
  const box = $("#examples");
  box.innerHTML = "";
  for (const example of data.examples) {
    const div = document.createElement("div");
    div.className = "example";
    const head = document.createElement("h4");
    head.textContent = `${example.title}: ${example.tokens} tokens`;
    const pre = document.createElement("pre");
    for (const seg of example.segments) {
      const span = document.createElement("span");
      span.textContent = seg.text;
      if (seg.supervised) span.className = "sup";
      pre.appendChild(span);
    }
    div.append(head, pre);
    box.appendChild(div);
  }
  const list = $("#stats-lines");
  list.innerHTML = "";
  for (const line of data.lines) { const li = document.createElement("li"); li.textContent = line; list.appendChild(li); }
  barChart($("#histogram"), {title: "Training sample lengths", xLabel: "length (tokens)", yLabel: "samples",
    bins: data.histogram, marker: data.cutoff_len, markerLabel: `cutoff_len ${data.cutoff_len}`});
}

// ---- Runs ------------------------------------------------------------------------------------------------

function seconds(s) {
  if (s === undefined || s === null) return "";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.round(s % 3600 / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
}

async function refreshRuns() {
  const {data} = await api("/api/runs");
  state.runs = data.runs;
  const body = $("#runs-table tbody");
  body.innerHTML = "";
  for (const run of data.runs) {
    const tr = document.createElement("tr");
    tr.dataset.dir = run.dir;
    if (run.dir === state.selected) tr.className = "selected";
    const progress = run.max_steps ? `${run.step} / ${run.max_steps}` : "";
    tr.innerHTML = `<td><input type="checkbox" class="cmp"></td><td class="name"></td><td class="state"></td><td>${progress}</td>` +
      `<td>${run.state === "running" ? seconds(run.eta_seconds) : ""}</td><td class="loss"></td>`;
    tr.querySelector(".name").textContent = run.name;
    tr.querySelector(".state").textContent = run.state;
    tr.querySelector(".state").classList.add(run.state.split(" ")[0]);
    const box = tr.querySelector(".cmp");
    box.checked = state.compare.has(run.dir);
    box.addEventListener("click", ev => { ev.stopPropagation(); box.checked ? state.compare.add(run.dir) : state.compare.delete(run.dir); drawCompare(); });
    tr.addEventListener("click", () => { state.selected = run.dir; refreshRuns(); });
    body.appendChild(tr);
  }
  fillTryRuns(data.runs);
  if (state.selected) await refreshRun();
  drawCompare();
}

const cachedLogs = {};
async function runLog(dir) {
  const {data} = await api(`/api/run?dir=${encodeURIComponent(dir)}`);
  cachedLogs[dir] = data.log;
  return data;
}

function curve(log, key) { return log.filter(r => r[key] !== undefined).map(r => [r.step, r[key]]); }

async function refreshRun() {
  const run = await runLog(state.selected);
  $("#run-detail").classList.remove("hidden");
  text($("#run-name"), run.name);
  text($("#run-state"), run.state, "state " + run.state.split(" ")[0]);
  const err = $("#run-error");
  err.classList.toggle("hidden", !run.error);
  err.textContent = run.error || "";
  const fraction = run.max_steps ? run.step / run.max_steps : 0;
  $("#run-progress").style.width = `${Math.round(100 * fraction)}%`;
  text($("#run-progress-text"), run.max_steps ? `step ${run.step} of ${run.max_steps}` +
    (run.state === "running" && run.eta_seconds !== undefined ? `, ETA ${seconds(run.eta_seconds)}` : "") +
    (run.elapsed_seconds !== undefined ? `, ${seconds(run.elapsed_seconds)} elapsed` : "") : "no log yet");
  $("#btn-stop").disabled = run.state !== "running";
  $("#btn-resume").disabled = run.state === "running" || !run.checkpoints.length;
  const log = run.log;
  lineChart($("#chart-loss"), {title: "Loss", xLabel: "step", yLabel: "loss",
    series: [{name: "train loss", points: curve(log, "loss")}, {name: "eval loss", points: curve(log, "eval_loss")}]});
  lineChart($("#chart-lr"), {title: "Learning rate", xLabel: "step", yLabel: "learning rate",
    series: [{name: "learning rate", points: curve(log, "learning_rate")}]});
  lineChart($("#chart-grad"), {title: "Gradient norm", xLabel: "step", yLabel: "grad norm",
    series: [{name: "grad norm", points: curve(log, "grad_norm")}]});
  lineChart($("#chart-tps"), {title: "Throughput", xLabel: "step", yLabel: "tokens / second",
    series: [{name: "all tokens", points: curve(log, "tokens_per_second")},
             {name: "supervised tokens", points: curve(log, "supervised_tokens_per_second")}]});
  const cps = $("#checkpoints");
  cps.innerHTML = "";
  for (const cp of run.checkpoints) {
    const li = document.createElement("li");
    li.textContent = `${cp.name} (step ${cp.step})${cp.complete ? "" : " — incomplete"}`;
    cps.appendChild(li);
  }
  if (!run.checkpoints.length) cps.innerHTML = "<li>none yet</li>";
  const metrics = $("#metrics");
  metrics.innerHTML = "";
  for (const [k, v] of Object.entries(run.metrics || {})) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td>";
    tr.children[0].textContent = k;
    tr.children[1].textContent = typeof v === "number" ? formatNumber(v) : String(v);
    metrics.appendChild(tr);
  }
  $("#console").textContent = run.console;
  const row = document.querySelector(`#runs-table tr[data-dir="${CSS.escape(run.dir)}"] .loss`);
  const losses = curve(log, "loss");
  if (row && losses.length) row.textContent = formatNumber(losses[losses.length - 1][1]);
}

async function drawCompare() {
  const box = $("#compare");
  box.classList.toggle("hidden", state.compare.size < 1);
  if (!state.compare.size) return;
  const series = [];
  for (const dir of state.compare) {
    const log = cachedLogs[dir] || (await runLog(dir)).log;
    const run = state.runs.find(r => r.dir === dir);
    series.push({name: run ? run.name : dir, points: curve(log, "loss")});
  }
  lineChart(box, {title: "Train loss of the runs ticked", xLabel: "step", yLabel: "loss", series, width: 920, height: 280});
}

async function runAction(path) {
  const {ok, data} = await api(path, {dir: state.selected});
  text($("#run-action"), ok ? (path.endsWith("stop") ? "SIGTERM sent: the run saves a checkpoint at the end of this step"
    : `resumed: pid ${data.pid}`) : "✗ " + data.error, ok ? "status ok" : "status bad");
  refreshRuns();
}

// ---- Try -------------------------------------------------------------------------------------------------

function fillTryRuns(runs) {
  const select = $("#try-run");
  const current = select.value;
  const options = [];
  for (const run of runs) {
    if (run.has_model) options.push([run.dir, `${run.name} (final model)`]);
    for (const cp of run.checkpoints) if (cp.complete) options.push([`${run.dir}/${cp.name}`, `${run.name} / ${cp.name}`]);
  }
  const key = JSON.stringify(options);
  if (select.dataset.key === key) return;
  select.dataset.key = key;
  select.innerHTML = "";
  for (const [value, label] of options) {
    const opt = document.createElement("option");
    opt.value = value; opt.textContent = label;
    select.appendChild(opt);
  }
  if (options.some(o => o[0] === current)) select.value = current;
}

function chatBubble(role, content) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  div.textContent = content;
  $("#chat-log").appendChild(div);
  return div;
}

async function sendChat() {
  const input = $("#chat-input");
  const content = input.value.trim();
  if (!content || !$("#try-run").value) return;
  input.value = "";
  state.chat.push({role: "user", content});
  chatBubble("user", content);
  const bubble = chatBubble("assistant pending", "");
  text($("#chat-status"), "loading the model and answering…", "status");
  const response = await fetch("/api/chat", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({dir: $("#try-run").value, messages: state.chat,
      temperature: parseFloat($("#chat-temperature").value) || 0, max_new_tokens: parseInt($("#chat-max").value) || 32})});
  if (!response.ok) {
    const data = await response.json();
    bubble.remove(); state.chat.pop();
    text($("#chat-status"), "✗ " + data.error, "status bad");
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let answer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    answer += decoder.decode(value, {stream: true});
    bubble.textContent = answer;
  }
  bubble.className = "turn assistant done";
  state.chat.push({role: "assistant", content: answer});
  text($("#chat-status"), "", "status");
}

async function startJob(kind) {
  const dir = $("#try-run").value;
  if (!dir) return;
  const body = {dir, max_samples: parseInt($("#eval-samples").value) || 20, eval_dataset: $("#eval-dataset").value};
  const {ok, data} = await api(`/api/${kind}`, body);
  if (!ok) { text($("#job-status"), "✗ " + data.error, "status bad"); return; }
  text($("#job-status"), `${kind}: running (output: ${data.out})`, "status");
  const poll = async () => {
    const job = (await api(`/api/job?id=${data.job}`)).data;
    if (job.state === "running") { setTimeout(poll, 1500); return; }
    if (job.state !== "finished") { text($("#job-status"), `✗ ${kind} ${job.state}: ${job.error || job.console}`, "status bad"); return; }
    text($("#job-status"), `✓ ${kind} finished: ${job.out}`, "status ok");
    if (kind === "eval") showPredictions(job);
  };
  poll();
}

function showPredictions(job) {
  const metrics = $("#eval-metrics");
  metrics.innerHTML = "";
  for (const [k, v] of Object.entries(job.metrics)) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td>";
    tr.children[0].textContent = k;
    tr.children[1].textContent = typeof v === "number" ? formatNumber(v) : String(v);
    metrics.appendChild(tr);
  }
  const table = $("#predictions");
  table.innerHTML = "<tr><th>prompt</th><th>reference</th><th>prediction</th></tr>";
  for (const row of job.rows) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td><td></td>";
    tr.children[0].textContent = row.prompt;
    tr.children[1].textContent = row.reference;
    tr.children[2].textContent = row.prediction;
    if (row.prediction.trim() === String(row.reference).trim()) tr.className = "match";
    table.appendChild(tr);
  }
}

// ---- wiring ----------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll(".tab").forEach(t => t.addEventListener("click", () => showScreen(t.dataset.screen)));
  const form = $("#config-form");
  form.addEventListener("input", () => { updateVisibility(); scheduleCheck(); });
  form.addEventListener("change", () => { updateVisibility(); scheduleCheck(); refreshDatasetNames(); });
  refreshDatasetNames();
  $("#btn-start").addEventListener("click", startTraining);
  $("#btn-yaml").addEventListener("click", () => $("#yaml-out").classList.toggle("hidden"));
  $("#btn-show-load").addEventListener("click", () => $("#yaml-load").classList.toggle("hidden"));
  $("#btn-load-yaml").addEventListener("click", () => loadYaml($("#yaml-in").value));
  $("#yaml-file").addEventListener("change", async ev => { const f = ev.target.files[0]; if (f) loadYaml(await f.text()); });
  $("#btn-preview").addEventListener("click", preview);
  $("#btn-stop").addEventListener("click", () => runAction("/api/stop"));
  $("#btn-resume").addEventListener("click", () => runAction("/api/resume"));
  $("#btn-send").addEventListener("click", sendChat);
  $("#chat-input").addEventListener("keydown", ev => { if (ev.key === "Enter") sendChat(); });
  $("#btn-clear").addEventListener("click", () => { state.chat = []; $("#chat-log").innerHTML = ""; });
  $("#try-run").addEventListener("change", () => { state.chat = []; $("#chat-log").innerHTML = ""; });
  $("#btn-eval").addEventListener("click", () => startJob("eval"));
  $("#btn-export").addEventListener("click", () => startJob("export"));
  updateVisibility();
  // The runs' view refreshes itself while it is on screen (the log file is re-read; nothing is kept in the server).
  state.timer = setInterval(() => { if (!$("#screen-runs").classList.contains("hidden")) refreshRuns(); }, 1500);
});

// OPD console: hash-routed pages over the tenant-scoped /v1/opd routes. The key lives in sessionStorage.
const KEY = "opd_api_key";
const main = document.getElementById("main");
const errorBox = document.getElementById("error");
let streamAbort = null;

const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "");

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY)}`, ...(options.headers || {}) },
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    if (response.status === 401) { sessionStorage.removeItem(KEY); }
    throw new Error(`${path}: ${message}`);
  }
  return response;
}
const json = async (path, options) => (await api(path, options)).json();

function loginPage() {
  main.innerHTML = `<form id="login"><label>API key <input id="key" type="password" size="50" autofocus></label>
    <button>Open</button></form>`;
  document.getElementById("login").onsubmit = (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key").value.trim());
    route();
  };
}

async function jobsPage(filter) {
  const jobs = (await json("/v1/opd/jobs?limit=100")).data;
  const statuses = [...new Set(jobs.map((j) => j.status))];
  const shown = filter ? jobs.filter((j) => j.status === filter) : jobs;
  main.innerHTML = `<h1>Jobs</h1><label>Status <select id="filter"><option value="">all</option>
    ${statuses.map((s) => `<option ${s === filter ? "selected" : ""}>${esc(s)}</option>`).join("")}</select></label>
    <table><thead><tr><th>Job</th><th>Name</th><th>Status</th><th>Step</th><th>Latest metrics</th><th>Created</th><th>Finished</th></tr></thead>
    <tbody>${shown.map((j) => `<tr class="job" tabindex="0" data-id="${esc(j.id)}"><td>${esc(j.id)}</td><td>${esc(j.job_name)}</td>
      <td>${esc(j.status)}</td><td>${j.step} / ${j.total_steps ?? "?"}</td>
      <td>${Object.entries(j.metrics || {}).slice(0, 4).map(([k, v]) => `${esc(k)}=${Number(v).toFixed(3)}`).join(" ")}</td>
      <td>${when(j.created_at)}</td><td>${when(j.finished_at)}</td></tr>`).join("")}</tbody></table>`;
  document.getElementById("filter").onchange = (e) => { location.hash = `#/jobs/${e.target.value}`.replace(/\/$/, ""); };
  for (const row of main.querySelectorAll("tr.job")) {
    const open = () => { location.hash = `#/job/${row.dataset.id}`; };
    row.onclick = open;
    row.onkeydown = (e) => { if (e.key === "Enter") open(); };
  }
}

// One chart per metric name, whatever the job reports; step (train) and validation (eval) records apart.
const series = new Map();
function addPoint(kind, step, values) {
  for (const [name, value] of Object.entries(values || {})) {
    if (typeof value !== "number" || name === "step") continue;
    const id = `${kind}:${name}`;
    if (!series.has(id)) series.set(id, { kind, name, x: [], y: [] });
    const s = series.get(id);
    s.x.push(step); s.y.push(value);
  }
}
function drawCharts() {
  const box = document.getElementById("charts");
  for (const [id, s] of series) {
    // getElementById takes the id as it is (a CSS-escaped one never matches: each redraw added a copy).
    let div = document.getElementById(`chart-${id}`);
    if (!div) { div = document.createElement("div"); div.id = `chart-${id}`; div.className = "chart"; box.append(div); }
    Plotly.newPlot(div, [{ x: s.x.slice(), y: s.y.slice(), mode: "lines+markers", name: s.name }],
      { title: { text: `${s.kind === "eval" ? "validation" : "step"}: ${s.name}` }, margin: { t: 36, l: 48, r: 12, b: 32 },
        xaxis: { title: { text: "step" } } }, { displayModeBar: false, responsive: true });
    div.dataset.drawn = "1";
  }
}

async function loadCurves(jobId) {
  const metrics = await json(`/v1/opd/jobs/${jobId}/metrics`);
  series.clear();
  for (const r of metrics.data) addPoint(r.kind === "eval" ? "eval" : "train", r.step, r);
  drawCharts();
}

async function follow(jobId, after) {
  // EventSource cannot send a header, so the stream is read through fetch.
  streamAbort = new AbortController();
  const response = await api(`/v1/opd/jobs/${jobId}/events?after=${after}`, {
    headers: { Accept: "text/event-stream" }, signal: streamAbort.signal,
  });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    // sse-starlette ends lines in CRLF; joined first, so a CRLF split across two chunks still matches.
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let cut;
    let curvesBehind = false;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (!data) continue;
      const event = JSON.parse(data);
      if (event.object === "opd.job") { renderHead(event); continue; }
      logEvent(event);
      // A step event names a few metrics; metrics.jsonl has them all, so every curve follows it.
      if (event.type === "step" || event.type === "eval" || event.type === "checkpoint") curvesBehind = true;
    }
    // Once per chunk read, not per event: a page opened on a running job is sent every past event at
    // once, and a redraw for each kept the status line minutes behind on a busy machine.
    if (curvesBehind) await loadCurves(jobId);
  }
}

function logEvent(e) {
  const log = document.getElementById("events");
  if (log) log.insertAdjacentHTML("afterbegin", `<tr><td>${e.id}</td><td>${when(e.time)}</td><td>${esc(e.type)}</td><td>${esc(e.message)}</td></tr>`);
}

// A job leaves these statuses never (api/services/states.py): a snapshot read before the job ended, whose
// answer arrives after the event stream said it ended (two connections, no order between them), is older.
const TERMINAL = ["succeeded", "failed", "cancelled"];
function renderHead(job) {
  const shown = document.getElementById("status");
  if (shown && shown.dataset.job === job.id && TERMINAL.includes(shown.textContent) && !TERMINAL.includes(job.status)) return;
  document.getElementById("head").innerHTML = `<h1>${esc(job.job_name)} <small>${esc(job.id)}</small></h1>
    <p>Status <strong id="status" data-job="${esc(job.id)}">${esc(job.status)}</strong>, step ${job.step} / ${job.total_steps ?? "?"}</p>`;
}

async function jobPage(jobId) {
  const job = await json(`/v1/opd/jobs/${jobId}`);
  series.clear();
  main.innerHTML = `<p><a href="#/jobs">All jobs</a> · <a href="#/job/${esc(jobId)}/trajectories">Trajectories</a> · <a href="#/job/${esc(jobId)}/validation">Validation side by side</a></p>
    <div id="head"></div>
    <p><button data-act="cancel">Cancel</button> <button data-act="pause">Pause</button> <button data-act="resume">Resume</button></p>
    <h2>Curves</h2><div id="charts" class="charts"></div>
    <h2>Checkpoints</h2><table id="checkpoints"></table>
    <h2>Events</h2><table><tbody id="events"></tbody></table>
    <h2>Spec as submitted</h2><pre>${esc(JSON.stringify(job.spec, null, 2))}</pre>`;
  renderHead(job);
  for (const b of main.querySelectorAll("button[data-act]")) {
    b.onclick = async () => {
      // The job as it is once the action is taken, not the action's answer: a cancel may finish (and
      // the event stream say so) before that answer arrives, and drawing it then would go back a status.
      try { await json(`/v1/opd/jobs/${jobId}/${b.dataset.act}`, { method: "POST" }); renderHead(await json(`/v1/opd/jobs/${jobId}`)); errorBox.textContent = ""; }
      catch (err) { errorBox.textContent = err.message; }
    };
  }
  await loadCurves(jobId);
  const checkpoints = (await json(`/v1/opd/jobs/${jobId}/checkpoints`)).data;
  document.getElementById("checkpoints").innerHTML = `<tr><th>Id</th><th>Step</th><th>Validation</th><th></th></tr>` +
    checkpoints.map((c) => `<tr><td>${esc(c.id)}</td><td>${c.step}</td>
      <td>${esc(Object.entries(c.eval || c.metrics || {}).map(([k, v]) => `${k}=${v}`).join(" "))}</td>
      <td><button data-ckpt="${esc(c.id)}">Download</button></td></tr>`).join("");
  for (const b of main.querySelectorAll("button[data-ckpt]")) {
    // A plain link cannot carry the key: download through fetch and hand the blob to the browser.
    b.onclick = async () => {
      const blob = await (await api(`/v1/opd/jobs/${jobId}/checkpoints/${b.dataset.ckpt}/content`)).blob();
      const a = Object.assign(document.createElement("a"), { href: URL.createObjectURL(blob), download: `${jobId}-${b.dataset.ckpt}.zip` });
      a.click();
    };
  }
  follow(jobId, 0).catch((err) => { if (err.name !== "AbortError") errorBox.textContent = err.message; });
}

// -- trajectories: the teacher's view of every trained token -------------------------------------------
// A token's log-ratio (sampler − teacher logprob) on a diverging scale clamped at ±SCALE nats:
// blue below 0 (the teacher likes the token more than the student did), red above (the teacher disagrees).
const SCALE = 2;
const PAGE = 10;
function tokenColour(lr) {
  if (typeof lr !== "number") return "";
  const t = Math.max(-1, Math.min(1, lr / SCALE));
  const [r, g, b] = t < 0 ? [33, 102, 172] : [178, 24, 43];
  return `background: rgba(${r}, ${g}, ${b}, ${(0.9 * Math.abs(t)).toFixed(2)});${Math.abs(t) > 0.6 ? " color: #fff;" : ""}`;
}
const signed = (v) => (typeof v === "number" ? `${v >= 0 ? "+" : ""}${v.toFixed(3)}` : "n/a");
function tokenInfo(tokens, i) {
  let info = `token ${JSON.stringify(tokens.text[i])} · log-ratio ${signed(tokens.log_ratio[i])}`;
  if (tokens.teacher_top) info += ` · teacher's top token ${JSON.stringify(tokens.teacher_top[i])} (p = ${Number(tokens.teacher_top_p[i]).toFixed(3)})`;
  return info;
}

function legend() {
  return `<div class="legend" id="legend" aria-label="colour scale of trained tokens">
    <span>teacher likes it more (log-ratio −${SCALE} or less)</span>
    <span class="scale" role="img" aria-label="blue for negative log-ratio, white at 0, red for positive"></span>
    <span>teacher disagrees (+${SCALE} or more)</span>
    <p>Trained tokens of the student (and a student's validation replies, scored but not trained) are coloured by
    sampler − teacher logprob; hover a token (or focus a reply and
    use ← →) for the teacher's preferred token. <span class="noloss-sample">Grey, uncoloured text</span> carries no loss:
    prompt, tool output, and replies that were not trained.</p></div>`;
}

function renderToolCalls(m) {
  return (m.tool_calls || []).map((c) => {
    const f = c.function || c;
    return `<div class="toolcall">tool call <strong>${esc(f.name)}</strong>(${esc(typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments))})</div>`;
  }).join("");
}

function renderMessage(m) {
  const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
  const label = m.role === "tool" ? `tool result${m.name ? ` (${esc(m.name)})` : ""}` : esc(m.role);
  const why = m.role === "assistant" ? "not trained" : "no loss";
  return `<div class="turn ${esc(m.role)} noloss"><em>${label} · ${why}</em>\n${esc(content ?? "")}${renderToolCalls(m)}</div>`;
}

// The turn's training signals besides the distillation (hindsight value, preference side, the teacher's
// hindsight note), shown beside it; nothing when it has none.
function renderSignal(signal) {
  if (!signal) return "";
  const parts = [];
  if (signal.hindsight !== undefined) parts.push(`hindsight ${signed(signal.hindsight)}`);
  for (const side of signal.preference || []) parts.push(`preference: ${side}`);
  if (signal.teacher_saw_note) parts.push("teacher scored it with a hindsight note");
  return ` <span class="signal" aria-label="training signals of this turn">${parts.map(esc).join(" · ")}</span>`;
}

// A beacon's rewrite preferred over this turn (the preference pair's chosen side, never distilled): its
// text and the beacon it was written with, folded under the turn.
function renderRewrite(signal) {
  const rewrite = signal && signal.rewrite;
  if (!rewrite) return "";
  return `<details class="rewrite"><summary>preferred rewrite (hindsight beacon)</summary>` +
    `<p><em>rewrite</em> ${esc(rewrite.text)}</p><p><em>beacon</em> ${esc(rewrite.beacon)}</p></details>`;
}

// A reply whose every token the teacher scored, coloured by its log-ratio: trained (a step's rollouts), or
// only scored (a student's validation rollout: nothing of it is trained).
function renderTrainedTurn(call, index, trained = true) {
  const t = call.tokens;
  const spans = t.text.map((piece, i) =>
    `<span class="tok" data-i="${i}" style="${tokenColour(t.log_ratio[i])}" title="${esc(tokenInfo(t, i))}">${esc(piece)}</span>`).join("");
  const how = trained ? "trained" : "scored by the teacher, not trained";
  const label = `assistant · ${how}, LLM call ${index + 1}, ${t.text.length} tokens`;
  return `<div class="turn assistant trained" data-call="${index}"><em>${label}</em>${renderSignal(t.signal)}` +
    `<div class="tokens" tabindex="0" role="group" aria-label="${trained ? "trained" : "scored"} tokens of LLM call ${index + 1}; left and right arrows step through them">${spans}</div>` +
    `<p class="tokinfo" aria-live="polite"></p>${renderToolCalls(call.response || {})}${renderRewrite(t.signal)}</div>`;
}

// A reply's text and tool calls (name, arguments), whatever else a client added to the message it kept.
const replyOf = (m) => JSON.stringify([m.content || "", (m.tool_calls || []).map((c) => {
  const f = c.function || c;
  return [f.name, typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments)];
})]);
const sameReply = (m, call) => Boolean(call && call.response) && replyOf(m) === replyOf(call.response);

function renderConversation(t, messages = t.messages || [], render = renderMessage, trained = true) {
  // Assistant replies are matched to the LLM calls that wrote them, in order; scored ones show their tokens,
  // and a scored call whose reply the conversation does not hold is shown after it.
  const calls = t.llm_calls || [];
  let next = 0;
  const turns = messages.map((m) => {
    if (m.role === "assistant" && sameReply(m, calls[next])) {
      const index = next++;
      return calls[index].tokens ? renderTrainedTurn(calls[index], index, trained) : render(m);
    }
    return render(m);
  });
  for (let i = next; i < calls.length; i++) if (calls[i].tokens) turns.push(renderTrainedTurn(calls[i], i, trained));
  return turns.join("");
}

function trajectoryHead(t, rank) {
  const components = Object.entries(t.component_rewards || {}).map(([k, v]) => `${esc(k)} ${Number(v).toFixed(3)}`).join(", ");
  return `<h2>#${rank} · step ${esc(t.step)} · ${esc(t.sample_id ?? t.rollout_id)}</h2>
    <p class="facts">reward <strong>${t.failed ? "n/a" : Number(t.reward).toFixed(3)}</strong>${components ? ` (${components})` : ""}
    · divergence <strong>${signed(t.divergence)}</strong>${t.failed ? ` · <span class="failed">failed: ${esc(t.error)}</span>` : ""}</p>`;
}

const SORTS = { "reward-desc": "reward, highest first", "reward-asc": "reward, lowest first",
  "divergence-desc": "divergence, highest first", "divergence-asc": "divergence, lowest first", "recent-asc": "as recorded" };

async function trajectoriesPage(jobId, query) {
  const steps = (await json(`/v1/opd/jobs/${jobId}/trajectories?limit=1`)).steps;
  const step = query.has("step") ? Number(query.get("step")) : steps[steps.length - 1];
  const sortKey = SORTS[query.get("sort")] ? query.get("sort") : "divergence-desc";
  const [sort, order] = sortKey.split("-");
  const offset = Math.max(0, Number(query.get("offset")) || 0);
  const page = step === undefined ? { data: [], has_more: false }
    : await json(`/v1/opd/jobs/${jobId}/trajectories?step=${step}&sort=${sort}&order=${order}&limit=${PAGE}&offset=${offset}`);
  const go = (changes) => {
    const next = new URLSearchParams({ step: step ?? "", sort: sortKey, offset: 0, ...changes });
    location.hash = `#/job/${jobId}/trajectories?${next}`;
  };
  main.innerHTML = `<p><a href="#/job/${esc(jobId)}">Back to the job</a></p><h1>Trajectories</h1>
    <p class="controls"><label>Step <select id="traj-step">${steps.map((s) => `<option ${s === step ? "selected" : ""}>${s}</option>`).join("")}</select></label>
    <label>Sort <select id="traj-sort">${Object.entries(SORTS).map(([k, v]) => `<option value="${k}" ${k === sortKey ? "selected" : ""}>${v}</option>`).join("")}</select></label>
    <button id="traj-prev" ${offset ? "" : "disabled"}>Previous</button> <button id="traj-next" ${page.has_more ? "" : "disabled"}>Next</button>
    <span>${page.data.length ? `${offset + 1}–${offset + page.data.length}` : "none recorded"}</span></p>${legend()}` +
    page.data.map((t, i) => `<section class="trajectory">${trajectoryHead(t, offset + i + 1)}${renderConversation(t)}</section>`).join("");
  document.getElementById("traj-step").onchange = (e) => go({ step: e.target.value });
  document.getElementById("traj-sort").onchange = (e) => go({ sort: e.target.value });
  document.getElementById("traj-prev").onclick = () => go({ offset: Math.max(0, offset - PAGE) });
  document.getElementById("traj-next").onclick = () => go({ offset: offset + PAGE });
  main.querySelectorAll("section.trajectory").forEach((section, i) => {
    for (const box of section.querySelectorAll(".tokens")) followTokens(box, page.data[i]);
  });
}

function followTokens(box, trajectory) {
  // The hover text, also for the keyboard: arrows move a marked token and the line below says what it is.
  const turn = box.closest(".turn");
  const tokens = trajectory.llm_calls[Number(turn.dataset.call)].tokens;
  const spans = box.querySelectorAll(".tok");
  let at = -1;
  const show = (i) => {
    if (at >= 0) spans[at].classList.remove("current");
    at = Math.max(0, Math.min(spans.length - 1, i));
    spans[at].classList.add("current");
    turn.querySelector(".tokinfo").textContent = tokenInfo(tokens, at);
  };
  box.onkeydown = (e) => {
    if (e.key === "ArrowRight" || e.key === "ArrowLeft") { e.preventDefault(); show(at + (e.key === "ArrowRight" ? 1 : -1)); }
    if (e.key === "Home") show(0);
    if (e.key === "End") show(spans.length - 1);
  };
  box.onclick = (e) => { if (e.target.classList.contains("tok")) show(Number(e.target.dataset.i)); };
}

// -- validation side by side: the same validation samples in two recorded passes ---------------------
// A pass is one validation run (step, label, model); its first rollouts are recorded, by sample order.
const passKey = (p) => `${p.step}:${p.label}`;
const passName = (p) => (p.label === `step ${p.step}` ? p.label : `step ${p.step} · ${p.label}`) + (p.model === "teacher" ? " (teacher)" : "");

function defaultPasses(passes) {
  // The first and the latest student validation; with only one, the student against the teacher.
  const students = passes.filter((p) => p.model === "student");
  const teacher = passes.find((p) => p.model === "teacher");
  const left = students[0] || passes[0];
  let right = students[students.length - 1] || passes[passes.length - 1];
  if (right === left && teacher) right = teacher;
  return [left, right];
}

async function passRecords(jobId, p, sortKey = "recent-asc") {
  // The route orders them (`sort`, `order`: those without the value last).
  const [sort, order] = sortKey.split("-");
  const query = new URLSearchParams({ step: p.step, label: p.label, sort, order, limit: 200 });
  return (await json(`/v1/opd/jobs/${jobId}/validation_trajectories?${query}`)).data;
}

// A rollout's prompt (what came before the first reply) and what the model wrote after it. The first reply is
// the one its first LLM call wrote: a multi-turn prompt may hold assistant turns of its own.
const firstReply = (t) => {
  const messages = t.messages || [];
  const written = messages.findIndex((m) => m.role === "assistant" && sameReply(m, (t.llm_calls || [])[0]));
  const i = written >= 0 ? written : messages.findIndex((m) => m.role === "assistant");
  return i < 0 ? messages.length : i;
};
const promptOf = (t) => (t.messages || []).slice(0, firstReply(t));
const completionOf = (t) => (t.messages || []).slice(firstReply(t));

function renderTurn(m) {
  const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
  const label = m.role === "tool" ? `tool result${m.name ? ` (${esc(m.name)})` : ""}` : esc(m.role);
  return `<div class="turn ${esc(m.role)}"><em>${label}</em>\n${esc(content ?? "")}${renderToolCalls(m)}</div>`;
}

function scoreLine(t) {
  const score = typeof t.eval_score === "number" ? `score <strong>${t.eval_score.toFixed(3)}</strong>` : "score <strong>n/a</strong>";
  const metrics = Object.entries(t.eval_metrics || {}).map(([k, v]) => `${esc(k)} ${Number(v).toFixed(3)}`).join(", ");
  // A job without reward components has no reward: the record's 0 is not shown.
  const rewarded = !t.failed && Object.keys(t.component_rewards || {}).length > 0;
  const reward = rewarded ? ` · reward ${Number(t.reward).toFixed(3)}` : "";
  const error = t.failed || t.eval_error ? ` · <span class="failed">${esc(t.error || t.eval_error || "failed")}</span>` : "";
  return `<p class="facts">${score}${metrics ? ` (${metrics})` : ""}${reward}${error}</p>`;
}

function renderSide(p, t) {
  // A student's replies show the teacher's view of every token (its validation rollouts are scored, not trained).
  const turns = completionOf(t);
  const divergence = typeof t.divergence === "number" ? ` · divergence <strong>${signed(t.divergence)}</strong>` : "";
  return `<div class="side" data-pass="${esc(passKey(p))}"><h3>${esc(passName(p))}${divergence}</h3>${scoreLine(t)}
    ${turns.length ? renderConversation(t, turns, renderTurn, false) : `<p class="failed">no reply recorded</p>`}</div>`;
}

// The order pairs are shown in: by sample (as recorded), or by a value of the right-hand pass's rollout.
const PAIR_SORTS = { "recent-asc": "sample order", "divergence-desc": "right's divergence, highest first",
  "score-asc": "right's score, lowest first", "score-desc": "right's score, highest first" };

function renderPair(sampleId, a, b, pa, pb) {
  const same = JSON.stringify(completionOf(a)) === JSON.stringify(completionOf(b));
  return `<section class="pair" tabindex="0" data-sample="${esc(sampleId)}" aria-label="sample ${esc(sampleId)}">
    <h2>${esc(sampleId)} <small>${same ? "same reply" : "replies differ"}</small></h2>
    <details><summary>Prompt</summary>${promptOf(a).map(renderTurn).join("")}</details>
    <div class="sides">${renderSide(pa, a)}${renderSide(pb, b)}</div></section>`;
}

function passSelect(id, passes, chosen) {
  return `<select id="${id}">${passes.map((p) => `<option value="${esc(passKey(p))}" ${p === chosen ? "selected" : ""}>${esc(passName(p))}</option>`).join("")}</select>`;
}

let validationFocus = null;
async function validationPage(jobId, query) {
  const passes = (await json(`/v1/opd/jobs/${jobId}/validation_trajectories?limit=1`)).passes;
  const [fallbackA, fallbackB] = defaultPasses(passes);
  const pa = passes.find((p) => passKey(p) === query.get("a")) || fallbackA;
  const pb = passes.find((p) => passKey(p) === query.get("b")) || fallbackB;
  const asked = location.hash;
  const sortKey = PAIR_SORTS[query.get("sort")] ? query.get("sort") : "recent-asc";
  const [left, right] = pa ? await Promise.all([passRecords(jobId, pa), passRecords(jobId, pb, sortKey)]) : [[], []];
  if (location.hash !== asked) return; // another choice came meanwhile: its own call draws it
  // Pairs in the right-hand pass's order (the route sorted it), each with the left's record of its sample.
  const leftBySample = new Map(left.map((t) => [t.sample_id, t]));
  const pairs = right.filter((t) => leftBySample.has(t.sample_id)).map((t) => [leftBySample.get(t.sample_id), t]);
  const both = pairs.map(([a]) => a);
  const scored = pairs.some(([a, b]) => typeof a.divergence === "number" || typeof b.divergence === "number");
  // The control that changed the view keeps the focus after it is redrawn (arrow keys go on choosing).
  const go = (a, b, from, sort = sortKey) => {
    validationFocus = from;
    location.hash = `#/job/${jobId}/validation?${new URLSearchParams({ a, b, sort })}`;
  };
  main.innerHTML = `<p><a href="#/job/${esc(jobId)}">Back to the job</a></p><h1>Validation side by side</h1>
    ${pa ? `<p class="controls"><label>Left ${passSelect("val-a", passes, pa)}</label> <label>Right ${passSelect("val-b", passes, pb)}</label>
    <button id="val-swap">Swap</button> <label>Sort <select id="val-sort">${Object.entries(PAIR_SORTS).map(([k, v]) => `<option value="${k}" ${k === sortKey ? "selected" : ""}>${v}</option>`).join("")}</select></label>
    <span id="val-count">${both.length} samples in both${left.length + right.length > 2 * both.length ? `; ${left.length + right.length - 2 * both.length} in only one` : ""}</span></p>${scored ? legend() : ""}`
    : "<p>No validation rollouts recorded yet.</p>"}` +
    pairs.map(([a, b]) => renderPair(a.sample_id, a, b, pa, pb)).join("");
  if (!pa) return;
  document.getElementById("val-a").onchange = (e) => go(e.target.value, passKey(pb), "val-a");
  document.getElementById("val-b").onchange = (e) => go(passKey(pa), e.target.value, "val-b");
  document.getElementById("val-swap").onclick = () => go(passKey(pb), passKey(pa), "val-swap");
  document.getElementById("val-sort").onchange = (e) => go(passKey(pa), passKey(pb), "val-sort", e.target.value);
  main.querySelectorAll(".side").forEach((side, i) => {
    const [a, b] = pairs[Math.floor(i / 2)];
    for (const box of side.querySelectorAll(".tokens")) followTokens(box, i % 2 ? b : a);
  });
  if (validationFocus) document.getElementById(validationFocus).focus();
  validationFocus = null;
}

async function route() {
  if (streamAbort) { streamAbort.abort(); streamAbort = null; }
  errorBox.textContent = "";
  const key = sessionStorage.getItem(KEY);
  document.getElementById("logout").hidden = !key;
  if (!key) return loginPage();
  const [path, search] = location.hash.replace(/^#\/?/, "").split("?");
  const parts = path.split("/");
  try {
    if (parts[0] === "job" && parts[2] === "trajectories") return await trajectoriesPage(parts[1], new URLSearchParams(search));
    if (parts[0] === "job" && parts[2] === "validation") return await validationPage(parts[1], new URLSearchParams(search));
    if (parts[0] === "job" && parts[1]) return await jobPage(parts[1]);
    return await jobsPage(parts[0] === "jobs" ? parts[1] : "");
  } catch (err) {
    errorBox.textContent = err.message;
    if (!sessionStorage.getItem(KEY)) loginPage();
  }
}

document.getElementById("logout").onclick = () => { sessionStorage.removeItem(KEY); route(); };
window.addEventListener("hashchange", route);
route();

// agentrl view: the page's script. Plain JavaScript, no framework, nothing from the internet.
// It asks the local server (agentrl/viewer/server.py) for the run, its dashboard curves, the
// episodes of a training step or an evaluation, and one whole episode, and draws them. Model
// output is untrusted text: it only ever reaches the page through textContent, never as HTML,
// and its bidi control characters are drawn as visible escapes (`visible`), so that a right-to-left
// override in one token cannot reorder what is drawn after it. A long block (a 2 MB tool output is
// half a million tokens) is folded with its size shown and drawn on demand, a chunk of tokens per
// frame, so the page never freezes. A run that has written nothing yet gets a waiting page that
// fills in as the run writes (`watchRun`).
"use strict";

const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"];
const FINISH = {
  done: "the environment ended the episode (an answer was given)",
  max_turns: "it ran out of turns (rollout.max_turns, or the env's own budget)",
  max_length: "it ran out of tokens: a turn was cut by rollout.max_tokens_per_turn or the episode by rollout.max_total_tokens",
  timeout: "its deadline passed (rollout.episode_timeout_s)",
  error: "it failed",
};
const STATUS = {
  trained: "its group was trained on",
  filtered: "its group was filtered out (not trained)",
  infra: "every episode of its group failed for infrastructure reasons (requeued, not trained)",
  eval: "an evaluation episode (never trained on)",
};

const state = {run: null, sourceId: "", episodes: [], skippedLines: 0, episodeIndex: -1, dashboard: null, record: null, tokens: [],
  overlay: "", markLowp: false};
const FOLD_TOKENS = 2000;   // a block longer than this is folded: its first PREVIEW_TOKENS are drawn, the rest on demand
const PREVIEW_TOKENS = 200;
const CHUNK_TOKENS = 3000;  // tokens drawn per frame when a folded block is opened
const WATCH_MS = 2000;      // how often a run with nothing to show yet is looked at again
const GAP_CAP = 1.0;        // |rollout - trainer| logprob gap (nats) drawn at full colour
const ENTROPY_CAP = 3.0;    // entropy (nats) drawn at full colour
const $ = (id) => document.getElementById(id);

// Embeddings, overrides, isolates and the directional marks: invisible, yet they reorder the text
// around them. Shown as ⟨U+202E⟩ instead.
const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
function visible(text) {
  return String(text).replace(BIDI, (c) => `⟨U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}⟩`);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = visible(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : k === "title" ? visible(v) : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(visible(c)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) if (c) node.append(c);
  return node;
}

async function api(path) {
  const response = await fetch(path, {cache: "no-store"});
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
  return String(Number(x.toFixed(digits)));
}

function short(text, n) {
  text = String(text ?? "");
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

// ── location: #source=ID&episode=N, so a view can be shared and reloaded ──────────────────────
function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  return {source: params.get("source") || "", episode: params.has("episode") ? Number(params.get("episode")) : -1};
}

function writeHash() {
  const params = new URLSearchParams();
  if (state.sourceId) params.set("source", state.sourceId);
  if (state.episodeIndex >= 0) params.set("episode", String(state.episodeIndex));
  const hash = "#" + params.toString();
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

// ── the run ───────────────────────────────────────────────────────────────────────────────────
async function loadRun() {
  const run = await api("api/run");
  state.run = run;
  document.title = `agentrl view: ${run.name}`;
  $("run-name").textContent = visible(run.name);
  const facts = $("run-facts");
  facts.replaceChildren();
  const add = (k, v) => facts.append(el("span", {}, `${k} `, el("b", {text: String(v)})));
  facts.append(el("span", {"data-kind": run.kind}, el("span", {}, `${runKind(run)} `, el("b", {text: run.path}))));
  for (const [k, v] of Object.entries(run.config || {})) add(k, v);
  if (run.report) {
    add("pass@1", fmt(run.report.pass_at_1));
    add(`pass@${run.report.k}`, fmt(run.report.pass_at_k));
  }
  fillSources(run);
  $("show-curves").hidden = !run.has_metrics;
}

function fillSources(run) {
  const select = $("source");
  select.replaceChildren();
  const train = run.sources.filter((s) => s.kind === "train");
  const evals = run.sources.filter((s) => s.kind === "eval");
  if (!run.sources.length) select.append(el("option", {value: "", text: "no kept episodes yet"}));
  if (train.length) select.append(el("optgroup", {label: "Training steps"}, train.map((s) => el("option", {value: s.id, text: s.label}))));
  if (evals.length) select.append(el("optgroup", {label: "Evaluations"}, evals.map((s) => el("option", {value: s.id, text: s.label}))));
  if (state.sourceId) select.value = state.sourceId;
}

// A run that has written nothing to look at yet (only config.yaml, or nothing): look again every
// WATCH_MS until it has, then open its first episodes; the server finds new files at every request.
async function watchRun() {
  for (;;) {
    await new Promise((resolve) => setTimeout(resolve, WATCH_MS));
    let run;
    try { run = await api("api/run"); } catch (err) { continue; }  // the server restarting: try again
    const before = state.run;
    if (run.sources.length === before.sources.length && run.has_metrics === before.has_metrics && run.kind === before.kind) continue;
    state.run = run;
    state.dashboard = null;
    const facts = $("run-facts").querySelector("[data-kind]");
    if (facts) facts.replaceChildren(el("span", {}, `${runKind(run)} `, el("b", {text: run.path})));
    fillSources(run);
    $("show-curves").hidden = !run.has_metrics;
    if (!state.sourceId && run.sources.length) {
      const first = run.sources.filter((s) => s.kind === "train").pop() || run.sources[0];
      await selectSource(first.id);
    } else if (state.episodeIndex < 0) await showCurves();
    if (run.kind !== "waiting" && run.sources.length) return;
  }
}

function runKind(run) {
  return {run: "run", eval: "evaluation", file: "file", waiting: "waiting for the run"}[run.kind] || run.kind;
}

// ── episodes of a source ─────────────────────────────────────────────────────────────────────
async function selectSource(id, episode = -1) {
  state.sourceId = id;
  $("source").value = id;
  const got = id ? await api(`api/episodes?source=${encodeURIComponent(id)}`) : {episodes: [], skipped_lines: 0};
  state.episodes = got.episodes;
  state.skippedLines = got.skipped_lines;
  fillFilters();
  $("filters").hidden = !id;
  $("episodes").hidden = !id;
  renderList();
  if (episode >= 0 && episode < state.episodes.length) await openEpisode(episode);
  else {
    state.episodeIndex = -1;
    await showCurves();
  }
}

function fillFilters() {
  const eps = state.episodes;
  const options = (id, values, label) => {
    const select = $(id);
    const keep = select.value;
    select.replaceChildren(el("option", {value: "", text: "any"}),
      ...[...new Set(values)].sort().map((v) => el("option", {value: v, text: label ? label(v) : v})));
    if ([...select.options].some((o) => o.value === keep)) select.value = keep;
  };
  options("f-finish", eps.map((e) => e.finish_reason));
  options("f-fault", eps.map((e) => e.fault));
  options("f-source", eps.map((e) => e.data_source));
  options("f-status", eps.map((e) => e.status));
}

function filtered() {
  const min = $("f-reward-min").value, max = $("f-reward-max").value;
  const finish = $("f-finish").value, fault = $("f-fault").value, tool = $("f-tool").value;
  const source = $("f-source").value, status = $("f-status").value;
  return state.episodes.filter((e) => {
    const r = e.reward ?? NaN;
    if (min !== "" && !(r >= Number(min))) return false;
    if (max !== "" && !(r <= Number(max))) return false;
    if (finish && e.finish_reason !== finish) return false;
    if (fault && e.fault !== fault) return false;
    if (source && e.data_source !== source) return false;
    if (status && e.status !== status) return false;
    const errors = e.tool_errors_model + e.tool_errors_infra + e.parse_errors;
    if (tool === "some" && !(errors > 0)) return false;
    if (tool === "model" && !(e.tool_errors_model + e.parse_errors > 0)) return false;
    if (tool === "infra" && !(e.tool_errors_infra > 0)) return false;
    if (tool === "none" && errors > 0) return false;
    return true;
  });
}

function renderList() {
  const shown = filtered();
  $("episode-count").textContent = `${shown.length} of ${state.episodes.length} episodes`;
  const skipped = state.skippedLines;
  $("skipped-lines").hidden = !skipped;
  $("skipped-lines").textContent = skipped ? `${skipped} line${skipped === 1 ? "" : "s"} of this file ${skipped === 1 ? "is" : "are"} not an episode (cut, or not agentrl's) and left out` : "";
  const body = $("episodes").tBodies[0];
  body.replaceChildren();
  let lastGroup = null;
  for (const e of shown) {
    const tools = e.tool_calls ? `${fmt(e.tool_calls)} call${e.tool_calls === 1 ? "" : "s"}` : "";
    const errors = e.tool_errors_model + e.tool_errors_infra + e.parse_errors;
    const row = el("tr", {
      class: "row" + (e.index === state.episodeIndex ? " selected" : "") + (e.group_id !== lastGroup ? " group-start" : ""),
      "data-index": e.index, title: `group ${e.group_id} (${e.status}${e.kept_as.length ? ", kept as " + e.kept_as.join(", ") : ""})`,
      onclick: () => openEpisode(e.index),
    },
      el("td", {text: e.index}),
      el("td", {class: e.fault === "infra" ? "bad" : e.reward >= 1 ? "ok" : ""}, e.fault === "infra" ? "infra" : fmt(e.reward)),
      el("td", {}, e.finish_reason, e.fault !== "none" ? el("span", {class: "bad", text: ` (${e.fault})`}) : null,
        el("span", {class: "answer", text: e.error || e.answer})),
      el("td", {}, tools, errors ? el("span", {class: "bad", text: ` ${fmt(errors)} err`}) : null),
      el("td", {}, `${e.num_sampled}/${e.num_tokens}`),
    );
    lastGroup = e.group_id;
    body.append(row);
  }
}

// ── one episode ──────────────────────────────────────────────────────────────────────────────
async function openEpisode(index) {
  $("curves").hidden = true;
  $("episode").hidden = false;
  $("episode").replaceChildren(el("p", {class: "empty-note", text: `loading episode ${index}…`}));
  const record = await api(`api/episode?source=${encodeURIComponent(state.sourceId)}&index=${index}`);
  state.episodeIndex = index;
  state.record = record;
  for (const row of document.querySelectorAll("#episodes tr.row")) {
    row.classList.toggle("selected", Number(row.dataset.index) === index);
  }
  $("curves").hidden = true;
  $("episode").hidden = false;
  renderEpisode(record);
  writeHash();
  $("main").scrollTop = 0;
}

function blocksOf(record) {
  // Consecutive segments of one turn and one side: the prompt, what the assistant sampled, what the
  // environment answered (tool output and the template's markers around it).
  const blocks = [];
  for (const seg of record.segments) {
    const side = seg.origin === "prompt" ? "prompt" : seg.origin === "sampled" ? "assistant" : "env";
    const last = blocks[blocks.length - 1];
    if (last && last.side === side && last.turn === seg.turn) last.segments.push(seg);
    else blocks.push({side, turn: seg.turn, segments: [seg]});
  }
  return blocks;
}

function messagesByTurn(r) {
  // The ledger numbers the model's turns: 1..K, the turn of each sampled token and of the
  // environment's answer after it. The messages end with those K turns, each one assistant message
  // (what was sampled) followed by what the environment added. Everything before them is the prompt,
  // whose own assistant messages (worked examples, an earlier conversation) were never sampled here:
  // so the model's turn k is the k-th of the last K assistant messages, never the k-th from the start.
  const messages = r.messages || [];
  const K = r.segments.reduce((k, s) => Math.max(k, s.turn), 0);
  const assistant = [];
  messages.forEach((m, i) => { if (m.role === "assistant") assistant.push(i); });
  const first = assistant.length - K;  // the index, in `assistant`, of the model's turn 1
  const promptEnd = K === 0 ? messages.length : (assistant[Math.max(first, 0)] ?? messages.length);
  const turns = {prompt: messages.slice(0, promptEnd), last: null};
  for (let k = 1; k <= K; k++) {
    const at = assistant[first + k - 1];
    if (at === undefined) continue;  // fewer messages than the ledger has turns: nothing to attach
    const next = first + k < assistant.length ? assistant[first + k] : messages.length;
    turns[k] = {assistant: messages[at], env: messages.slice(at + 1, next)};
    turns.last = messages[at];
  }
  return turns;
}

function renderEpisode(r) {
  const root = $("episode");
  root.replaceChildren();
  const infra = r.fault === "infra";
  const rewardClass = infra || r.reward === null ? "none" : r.reward >= 1 ? "good" : r.reward <= 0 ? "zero" : "";
  const chips = [
    ["finish", r.finish_reason || "none", r.finish_reason === "error"],
    ["fault", r.fault || "none", !!r.fault],
    ["group", `${r.group_id} · ${r.status}${r.kept_as && r.kept_as.length ? " · kept as " + r.kept_as.join(", ") : ""}`, r.status === "infra"],
    ["trained", r.trained ? "yes" : "no", false],
    ["data source", r.data_source || "unknown", false],
    ["tokens", `${r.num_tokens} (${r.num_sampled} sampled)`, false],
    ["turns", r.num_turns, false],
    ["episode", r.episode_id, false],
  ];
  if (r.segment) chips.push(["segment", `${r.segment.index + 1} of ${r.segment.of}`, false]);
  if (r.step !== null && r.step !== undefined) chips.unshift(["step", r.step, false]);
  root.append(el("div", {class: "ep-head"},
    el("div", {class: `reward ${rewardClass}`, id: "ep-reward"}, infra ? "infra" : fmt(r.reward), el("small", {text: "reward"})),
    el("div", {class: "chips"}, chips.map(([k, v, bad]) => el("span", {class: "chip" + (bad ? " bad" : "")}, `${k}: `, el("b", {text: String(v)})))),
  ));
  const turns = messagesByTurn(r);
  root.append(whyBox(r, turns));
  root.append(legendBar(r));

  state.tokens = [];
  for (const block of blocksOf(r)) root.append(renderBlock(r, block, block.side === "prompt" ? turns.prompt : turns[block.turn]));
  // Drawn when opened: the messages hold every tool output again, megabytes of text for a big episode.
  const recorded = el("pre", {});
  root.append(el("details", {ontoggle: (e) => {
    if (e.target.open && !recorded.textContent) recorded.textContent = visible(JSON.stringify({messages: r.messages, metrics: r.metrics, info: r.info}, null, 2));
  }}, el("summary", {text: "messages, metrics and info as recorded"}), recorded));
  if (r.text && r.segments.every((s) => s.pieces === undefined)) {
    root.append(el("div", {class: "why"}, el("h3", {text: "Text (written before tokens carried their own text)"}),
      el("pre", {class: "tokens", text: r.text})));
  }
}

function whyBox(r, turns) {
  const rows = [];
  const m = r.metrics || {};
  if (r.fault === "infra") rows.push(["reward", "not scored: the episode failed for infrastructure reasons, so it is masked out of the loss and its prompt is requeued"]);
  else rows.push(["reward", fmt(r.reward)]);
  rows.push(["ended", `${r.finish_reason || "none"}: ${FINISH[r.finish_reason] || "unknown"}`]);
  if (r.error) rows.push(["error", r.error]);
  if (r.ground_truth !== null && r.ground_truth !== undefined) rows.push(["ground truth", typeof r.ground_truth === "string" ? r.ground_truth : JSON.stringify(r.ground_truth)]);
  if (turns.last) rows.push(["final answer", short(turns.last.content, 800) || "(empty)"]);
  else rows.push(["final answer", "none: the model took no turn"]);
  const tools = [`${fmt(m.tool_calls || 0)} call${m.tool_calls === 1 ? "" : "s"}`];
  if (m.tool_errors_model) tools.push(`${fmt(m.tool_errors_model)} failed by the model's fault`);
  if (m.tool_errors_infra) tools.push(`${fmt(m.tool_errors_infra)} failed for infrastructure reasons`);
  if (m.parse_errors) tools.push(`${fmt(m.parse_errors)} malformed`);
  rows.push(["tools", tools.join(", ")]);
  const skip = new Set(["tool_calls", "tool_errors_model", "tool_errors_infra", "parse_errors", "turns", "sampled_tokens",
    "total_tokens", "episode_s", "generate_s", "env_s"]);
  const extra = Object.entries(m).filter(([k, v]) => !skip.has(k) && v !== 0);
  if (extra.length) rows.push(["env metrics", extra.map(([k, v]) => `${k} ${fmt(v)}`).join(", ")]);
  for (const [k, v] of Object.entries(r.info || {})) {
    if (k === "template_mismatches") continue;
    rows.push([k, short(typeof v === "string" ? v : JSON.stringify(v), 600)]);
  }
  rows.push(["group", STATUS[r.status] || r.status]);
  rows.push(["time", `${fmt(m.episode_s || 0, 1)} s (generating ${fmt(m.generate_s || 0, 1)} s, env ${fmt(m.env_s || 0, 1)} s)`]);
  return el("div", {class: "why", id: "why"}, el("h3", {text: "The reward and why"}),
    el("dl", {}, rows.map(([k, v]) => [el("dt", {text: k}), el("dd", {text: String(v)})])));
}

function legendBar(r) {
  const sample = (cls, text, title) => el("span", {class: `tok ${cls}`, title}, text);
  const lowp = el("input", {type: "checkbox", id: "mark-lowp", checked: state.markLowp, onchange: (e) => {
    state.markLowp = e.target.checked;
    for (const t of document.querySelectorAll("#episode .tok[data-lowp]")) t.classList.toggle("lowp", e.target.checked);
  }});
  const scored = r.segments.some((s) => s.trainer_logprobs && s.trainer_logprobs.some((v) => v !== null));
  const entropy = r.segments.some((s) => s.trainer_entropy && s.trainer_entropy.some((v) => v !== null));
  const scale = el("span", {class: "overlay-scale", id: "overlay-scale", hidden: !state.overlay || !scored});
  const drawScale = () => {
    const kind = state.overlay;
    scale.hidden = !kind || !scored;
    if (!kind) return;
    const cap = kind === "gap" ? GAP_CAP : ENTROPY_CAP;
    scale.replaceChildren(el("i", {class: "lo", style: `background:${overlayColour(kind, 0)}`}), "0",
      el("i", {class: "hi", style: `background:${overlayColour(kind, cap)}`}), `≥ ${cap} nats`);
  };
  const overlay = el("select", {id: "overlay", disabled: !scored, title: scored ? "colour the sampled tokens the trainer scored" :
    "this episode carries no trainer values (an evaluation, an episode not trained on, or a file written before the trainer's values were kept)",
    onchange: (e) => {
      state.overlay = e.target.value;
      for (const t of document.querySelectorAll("#episode .tok[data-gap], #episode .tok[data-ent]")) paintOverlay(t);
      drawScale();
    }},
    el("option", {value: "", text: "no overlay"}),
    el("option", {value: "gap", text: "logprob gap |rollout − trainer|"}),
    el("option", {value: "entropy", text: "trainer entropy", disabled: !entropy}));
  overlay.value = scored ? state.overlay : "";
  drawScale();
  const onpolicy = Object.entries(r.onpolicy || {});
  return el("div", {class: "legend-bar"},
    sample("o-prompt m0", "prompt", "the first prompt: context, masked"),
    sample("o-sampled m1", "sampled, trained", "sampled by the policy and in the loss"),
    sample("o-sampled m0", "sampled, masked", "sampled, but not in the loss (evaluation, filtered group, or infrastructure failure)"),
    sample("o-template m0", "template", "chat-template markers: context, masked"),
    sample("o-tool m0", "tool / env", "what the environment said: context, masked"),
    el("span", {class: "muted", text: r.trained ? "Underlined tokens are the ones trained on; everything else is masked." :
      "Nothing in this episode was trained on: every token is masked."}),
    el("label", {}, lowp, " mark unlikely samples (p < 5%)"),
    el("label", {title: "where the trainer's logprob of a sampled token differs from the rollout's, training was off-policy on it"},
      "off-policy overlay ", overlay), scale,
    onpolicy.length ? el("span", {id: "onpolicy", title: "this step's on-policy check (metrics onpolicy/*)"}, "step's on-policy check: ",
      onpolicy.map(([k, v], n) => [n ? " · " : "", `${k.slice("onpolicy/".length)} `, el("b", {text: fmt(v, 4)})])) : null,
  );
}

// A function that draws the next `n` tokens of a block into `box` (each call goes on where the
// last stopped) and returns how many it has drawn in all. With `chunked` the tokens go into
// `div.chunk`s of about CHUNK_TOKENS, cut after a newline where one comes soon (so no line is
// broken in two), which the browser skips laying out while they are off screen.
function tokenDrawer(r, block, box, chunked) {
  let k = 0, j = 0, done = 0;  // segment, token in it, tokens drawn
  let chunk = null, inChunk = 0;
  return (n) => {
    let left = n;
    let frag = document.createDocumentFragment();
    const flush = () => { (chunk || box).append(frag); frag = document.createDocumentFragment(); };
    if (chunked && !chunk) { chunk = el("div", {class: "chunk"}); box.append(chunk); }
    while (left > 0 && k < block.segments.length) {
      const seg = block.segments[k];
      if (j >= seg.ids.length) { k += 1; j = 0; continue; }
      const span = tokenSpan(r, seg, j);
      frag.append(span);
      j += 1; done += 1; left -= 1; inChunk += 1;
      if (chunked && inChunk >= CHUNK_TOKENS && (span.textContent.endsWith("\n") || inChunk >= 2 * CHUNK_TOKENS)) {
        flush();
        chunk = el("div", {class: "chunk"});
        box.append(chunk);
        inChunk = 0;
      }
    }
    flush();
    return done;
  };
}

// Draw a folded block CHUNK_TOKENS at a time, one chunk per frame, so clicks and scrolling go on
// meanwhile; stops when another episode is opened.
function drawInChunks(draw, total, progress) {
  const episode = state.record;
  const step = () => {
    if (state.record !== episode) return;
    const done = draw(CHUNK_TOKENS);
    progress(done);
    if (done < total) setTimeout(step, 0);
  };
  setTimeout(step, 0);
}

function tokenSpan(r, seg, j) {
  const i = seg.start + j;
  const trained = r.trained && seg.origin === "sampled";
  const pieces = seg.pieces;
  const piece = pieces ? pieces[j] : `⟨${seg.ids[j]}⟩`;
  const span = document.createElement("span");
  span.className = `tok o-${seg.origin} ${trained ? "m1" : "m0"}`;
  span.dataset.i = String(i);
  span.dataset.origin = seg.origin;
  span.dataset.mask = trained ? "1" : "0";
  const t = {id: seg.ids[j], origin: seg.origin, turn: seg.turn, piece, lp: seg.logprobs ? seg.logprobs[j] : null,
    version: seg.origin === "sampled" ? seg.version : null, trained, trainerLp: null, entropy: null};
  if (seg.origin === "sampled") {
    span.dataset.lp = String(seg.logprobs[j]);
    span.dataset.v = String(seg.version);
    if (seg.logprobs[j] < Math.log(0.05)) {
      span.dataset.lowp = "";
      if (state.markLowp) span.classList.add("lowp");
    }
    const tlp = seg.trainer_logprobs ? seg.trainer_logprobs[j] : null;
    const ent = seg.trainer_entropy ? seg.trainer_entropy[j] : null;
    if (tlp !== null && tlp !== undefined) {
      t.trainerLp = tlp;
      span.dataset.gap = String(Math.abs(seg.logprobs[j] - tlp));
    }
    if (ent !== null && ent !== undefined) {
      t.entropy = ent;
      span.dataset.ent = String(ent);
    }
    paintOverlay(span);
  }
  span.textContent = visible(piece);
  state.tokens[i] = t;
  return span;
}

// The off-policy overlay: a sampled token the trainer scored is tinted by its logprob gap
// |rollout - trainer| (red) or by the policy's entropy there (blue); every other token is drawn plainly.
function overlayColour(kind, value) {
  const x = Math.min(Math.max(value / (kind === "gap" ? GAP_CAP : ENTROPY_CAP), 0), 1);
  const hue = kind === "gap" ? 0 : 220;
  return `hsl(${hue}, 85%, ${Math.round(96 - 46 * x)}%)`;
}

function paintOverlay(span) {
  const kind = state.overlay;
  const value = kind === "gap" ? span.dataset.gap : kind === "entropy" ? span.dataset.ent : undefined;
  span.style.backgroundColor = value === undefined ? "" : overlayColour(kind, Number(value));
  span.classList.toggle("overlaid", value !== undefined);
}

function renderBlock(r, block, turn) {
  // `turn`: the prompt's messages for the prompt, else that turn's {assistant, env} messages.
  const nTokens = block.segments.reduce((n, s) => n + s.ids.length, 0);
  let title;
  if (block.side === "prompt") {
    const messages = turn || [];
    const own = messages.filter((m) => m.role === "assistant").length;
    const said = own ? `, ${own} of them the assistant's (worked examples or an earlier conversation, not sampled here)` : "";
    title = ["Prompt", `${messages.length} message${messages.length === 1 ? "" : "s"}${said} · ${nTokens} tokens · context, masked`];
  }
  else if (block.side === "assistant") {
    const lps = block.segments.flatMap((s) => s.logprobs || []);
    const versions = [...new Set(block.segments.map((s) => s.version))].join(", ");
    const mean = lps.length ? lps.reduce((a, b) => a + b, 0) / lps.length : 0;
    title = [`Turn ${block.turn} · assistant`, `${nTokens} tokens · policy v${versions} · mean logprob ${fmt(mean)} · ${r.trained ? "trained" : "masked"}`];
  } else {
    const tool = block.segments.filter((s) => s.origin === "tool").reduce((n, s) => n + s.ids.length, 0);
    title = [`Turn ${block.turn} · environment`, `${nTokens} tokens (${tool} from tools) · context, masked`];
  }
  const section = el("section", {class: `turn ${block.side}`, "data-turn": block.turn, "data-side": block.side},
    el("h3", {}, title[0], " ", el("span", {class: "muted", text: `· ${title[1]}`})));
  const box = el("div", {class: "tokens"});
  section.append(box);
  const draw = tokenDrawer(r, block, box, nTokens > FOLD_TOKENS);
  if (nTokens > FOLD_TOKENS) {
    // Half a million spans freeze the page for most of a minute: draw a preview, the rest on demand.
    const nChars = block.segments.reduce((n, s) => n + (s.pieces ? s.pieces.reduce((m, p) => m + p.length, 0) : 0), 0);
    draw(PREVIEW_TOKENS);
    const rest = nTokens - PREVIEW_TOKENS;
    const label = `${rest.toLocaleString("en")} more tokens (${nTokens.toLocaleString("en")} tokens, ${nChars.toLocaleString("en")} characters in all)`;
    const button = el("button", {type: "button", class: "unfold", text: `show all: ${label}`});
    const bar = el("div", {class: "fold"}, el("span", {class: "muted", text: "folded · "}), button);
    button.addEventListener("click", () => {
      button.disabled = true;
      drawInChunks(draw, nTokens, (done) => {
        button.textContent = done >= nTokens ? "" : `drawing… ${done.toLocaleString("en")} of ${nTokens.toLocaleString("en")} tokens`;
        if (done >= nTokens) bar.remove();
      });
    });
    section.dataset.folded = String(nTokens);
    section.append(bar);
  } else {
    draw(nTokens);
    if (block.side === "prompt" && nTokens > 120) {
      // The prompt is the same for a whole group: folded, so the turns are what one sees first.
      box.classList.add("folded");
      section.querySelector("h3").append(el("button", {type: "button", class: "unfold", onclick: (e) => {
        const folded = box.classList.toggle("folded");
        e.target.textContent = folded ? "show all" : "fold";
      }, text: "show all"}));
    }
  }
  if (turn && block.side === "assistant" && turn.assistant && turn.assistant.tool_calls && turn.assistant.tool_calls.length) {
    section.append(el("div", {class: "calls"}, turn.assistant.tool_calls.map((c) => {
      const f = c.function || c;
      const args = typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments, null, 1);
      return el("div", {class: "call"}, "tool call ", el("span", {class: "name", text: f.name}), c.id ? el("span", {class: "muted", text: ` (${c.id})`}) : null,
        el("pre", {text: args}));
    })));
  }
  if (turn && block.side === "env" && turn.env.length) {
    section.append(el("div", {class: "calls"}, turn.env.map((m) => {
      const content = String(m.content ?? "");
      const error = /^\s*error\b/i.test(content);
      const who = m.role === "tool" ? `result of ${m.name || "a tool"}` : `${m.role} message`;
      return el("div", {class: "result" + (error ? " error" : "")}, el("b", {text: who}), m.tool_call_id ? el("span", {class: "muted", text: ` (${m.tool_call_id})`}) : null,
        el("pre", {text: short(content, 4000)}));
    })));
  }
  return section;
}

// The tooltip of a token: what it is, where it came from, whether it was trained on.
function tokenTip(t, i) {
  const lines = [`token #${i} · id ${t.id} · turn ${t.turn}`];
  if (t.origin === "sampled") {
    lines.push(`sampled by policy v${t.version}`);
    lines.push(`rollout logprob ${t.lp.toFixed(4)} (p = ${Math.exp(t.lp).toFixed(3)})`);
    if (t.trainerLp !== null) {
      lines.push(`trainer logprob ${t.trainerLp.toFixed(4)} · gap |rollout − trainer| ${Math.abs(t.lp - t.trainerLp).toFixed(4)}`);
    } else lines.push("no trainer logprob (not scored by the trainer, or not kept)");
    if (t.entropy !== null) lines.push(`trainer entropy ${t.entropy.toFixed(4)}`);
  } else lines.push({prompt: "prompt", template: "chat template", tool: "tool / environment output"}[t.origin]);
  lines.push(t.trained ? "in the loss (trained)" : "masked: not in the loss");
  lines.push(JSON.stringify(t.piece));
  return lines.join("\n");
}

function onTokenHover(event) {
  const tip = $("tooltip");
  const span = event.target.closest && event.target.closest(".tok[data-i]");
  if (!span) { tip.hidden = true; return; }
  const i = Number(span.dataset.i);
  const t = state.tokens[i];
  if (!t) { tip.hidden = true; return; }
  tip.textContent = visible(tokenTip(t, i));
  tip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - 370);
  const y = event.clientY + 16 + 120 > window.innerHeight ? event.clientY - 120 : event.clientY + 16;
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

// ── curves ───────────────────────────────────────────────────────────────────────────────────
async function showCurves() {
  $("episode").hidden = true;
  const box = $("curves");
  box.hidden = false;
  state.episodeIndex = -1;
  for (const row of document.querySelectorAll("#episodes tr.row.selected")) row.classList.remove("selected");
  writeHash();
  if (state.run.kind === "waiting" || (!state.run.has_metrics && !state.run.sources.length)) {
    box.replaceChildren(el("div", {class: "empty-note", id: "waiting"},
      el("h2", {text: "Waiting for the run to write its first step…"}),
      el("p", {text: `Nothing to look at in ${state.run.path} yet${state.run.kind === "waiting" ? " (it holds only what a run writes as it starts)" : ""}. ` +
        `This page looks again every ${WATCH_MS / 1000} s and fills in as the run writes its curves and kept episodes; there is no need to reload it.`})));
    return;
  }
  if (!state.run.has_metrics) {
    box.replaceChildren(el("p", {class: "empty-note", text: state.sourceId ?
      "Pick an episode on the left to see its turns and tokens." :
      "This directory has no metrics.jsonl and no kept episodes yet."}));
    return;
  }
  if (!state.dashboard) state.dashboard = await api("api/dashboard");
  const source = state.run.sources.find((s) => s.id === state.sourceId);
  const mark = source && source.kind === "train" ? source.step : source ? source.step : null;
  const drawn = state.dashboard.panels.filter((p) => !p.empty);
  const empty = state.dashboard.panels.filter((p) => p.empty);
  box.replaceChildren(
    el("div", {class: "curves-head"}, el("h2", {text: `Dashboard · ${state.dashboard.steps} step(s)`}),
      mark !== null && mark !== undefined ? el("span", {class: "muted", text: `dashed line: ${source.label}; click a curve to open that step's rollouts`}) :
        el("span", {class: "muted", text: "click a curve to open that step's rollouts"})),
    el("div", {class: "panels"}, drawn.map((p) => drawPanel(p, mark))),
    empty.length ? el("p", {class: "nothing", text: "Nothing to show: " + empty.map((p) => `${p.title} (${p.empty})`).join("; ")}) : null,
  );
}

function drawPanel(panel, mark) {
  const W = 340, H = 170, L = 44, R = 10, T = 8, B = 20;
  let series = Object.entries(panel.series);
  if (panel.stacked) series = series.filter(([, s]) => s.y.some((v) => v !== 0));
  const xs = [...new Set(series.flatMap(([, s]) => s.x))].sort((a, b) => a - b);
  let lines;
  if (panel.stacked) {
    const base = new Map(xs.map((x) => [x, 0]));
    lines = series.map(([key, s]) => {
      const at = new Map(s.x.map((x, i) => [x, s.y[i]]));
      const lo = xs.map((x) => base.get(x));
      const hi = xs.map((x) => base.get(x) + (at.get(x) || 0));
      xs.forEach((x, i) => base.set(x, hi[i]));
      return {key, x: xs, y: hi, lo};
    });
  } else lines = series.map(([key, s]) => ({key, x: s.x, y: s.y}));
  const ys = lines.flatMap((l) => l.y.concat(l.lo || []));
  let y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  if (y1 === y0) y1 = y0 + 1;
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const alarm = panel.title === "Infrastructure failures" && ys.some((v) => v > 0);
  const g = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": panel.title});
  for (const v of [y0, (y0 + y1) / 2, y1]) {
    g.append(svg("line", {x1: L, x2: W - R, y1: py(v), y2: py(v), stroke: "#e5e5e5"}));
    g.append(svg("text", {x: L - 4, y: py(v) + 3, "text-anchor": "end", text: fmt(v, 2)}));
  }
  const ticks = xs.length <= 8 ? xs : [x0, Math.round((x0 + x1) / 2), x1];
  for (const v of ticks) g.append(svg("text", {x: px(v), y: H - 5, "text-anchor": "middle", text: fmt(v)}));
  lines.forEach((l, k) => {
    const colour = COLOURS[k % COLOURS.length];
    if (panel.stacked) {
      const top = l.x.map((x, i) => `${px(x)},${py(l.y[i])}`);
      const bottom = l.x.map((x, i) => `${px(x)},${py(l.lo[i])}`).reverse();
      g.append(svg("polygon", {points: top.concat(bottom).join(" "), fill: colour, "fill-opacity": 0.75, stroke: colour}));
    } else {
      g.append(svg("polyline", {points: l.x.map((x, i) => `${px(x)},${py(l.y[i])}`).join(" "), fill: "none", stroke: colour, "stroke-width": 1.8}));
      if (l.x.length <= 60) l.x.forEach((x, i) => g.append(svg("circle", {cx: px(x), cy: py(l.y[i]), r: 2.4, fill: colour},
        svg("title", {text: `${l.key} at step ${fmt(x)}: ${fmt(l.y[i], 4)}`}))));
    }
  });
  if (mark !== null && mark !== undefined && mark >= x0 && mark <= x1) {
    g.append(svg("line", {x1: px(mark), x2: px(mark), y1: T, y2: H - B, stroke: "#333", "stroke-dasharray": "4 3"}));
  }
  g.addEventListener("click", (event) => {
    const box = g.getBoundingClientRect();
    const x = x0 + ((event.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
    const steps = state.run.sources.filter((s) => s.kind === "train");
    if (!steps.length) return;
    const near = steps.reduce((a, b) => (Math.abs(b.step - x) < Math.abs(a.step - x) ? b : a));
    selectSource(near.id);
  });
  const legend = lines.length > 1 ? el("div", {class: "legend"}, lines.map((l, k) => el("span", {},
    el("i", {style: `background:${COLOURS[k % COLOURS.length]}`}), l.key.split("/").pop()))) : null;
  let last = lines.length === 1 ? ` · last ${fmt(lines[0].y[lines[0].y.length - 1], 4)}` : "";
  if (alarm) last = ` · up to ${fmt(Math.max(...ys) * 100, 1)}%`;
  return el("div", {class: "panel" + (alarm ? " alarm" : ""), "data-title": panel.title},
    el("h3", {text: panel.title + last}), el("p", {class: "hint", text: panel.hint}), g, legend);
}

// ── start ────────────────────────────────────────────────────────────────────────────────────
async function start() {
  await loadRun();
  $("source").addEventListener("change", (e) => selectSource(e.target.value));
  $("show-curves").addEventListener("click", () => showCurves());
  for (const id of ["f-reward-min", "f-reward-max", "f-finish", "f-fault", "f-tool", "f-source", "f-status"]) {
    $(id).addEventListener("input", renderList);
    $(id).addEventListener("change", renderList);
  }
  $("episode").addEventListener("mouseover", onTokenHover);
  $("episode").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  const want = readHash();
  const sources = state.run.sources;
  const first = sources.find((s) => s.id === want.source) || sources.filter((s) => s.kind === "train").pop() || sources[0];
  await selectSource(first ? first.id : "", first && first.id === want.source ? want.episode : -1);
  document.body.dataset.ready = "1";
  if (state.run.kind === "waiting" || !sources.length) await watchRun();
}

start().catch((err) => {
  document.body.dataset.ready = "error";
  $("main").replaceChildren(el("p", {class: "bad", text: `agentrl view could not load this run: ${err.message}`}));
});

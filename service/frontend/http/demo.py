"""The demo page's HTML, CSS and script, all inline: no external script, style or font, so the page works with no
network (a served machine often has none).

What it does: pick, drop or paste several images; each is classified in a request of its own (so each shows the
server's own ``Server-Timing`` for it) and shown as a thumbnail with its top-k, or with its own error. Changing the
model or top-k re-runs the images on screen. Labels, file names and error messages are inserted as text, never as
HTML: a model's labels come from its ``spec.json``, which the page does not trust. A small SVG chart draws the
server's ``total`` duration of recent requests. A detector's images go to its detect route instead, and each
one's boxes are listed and drawn over it, filtered in the browser by a score-threshold slider (``demo_boxes.py``).
A table lists the served models: state, device, residency (pinned or on demand), whether each is in memory and
what it is charged there; read again after each answer, since a request may load an on-demand model and evict
another. Below it, each model with a rollout (docs/rollouts.md): mode, primary -> candidate, samples compared,
agreement with its interval, latency ratio, shed and the verdict, read from ``GET /v2/models/{m}/rollout`` with the
table (a 404, from a server without rollouts, counts as no rollout). Then the live mode (``demo_live.py``): the
camera or a video file streamed to the model, each frame's answer as it comes; and the sources (``demo_sources.py``):
the cameras and files the server pulls itself, listed with the admin token, one watched frame by frame.
"""

from __future__ import annotations

from service.frontend.http.demo_boxes import BOXES_SCRIPT, BOXES_STYLE, SCORE_CONTROL
from service.frontend.http.demo_live import LIVE_SCRIPT, LIVE_SECTION, LIVE_STYLE
from service.frontend.http.demo_sources import SOURCES_SCRIPT, SOURCES_SECTION, SOURCES_STYLE

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>visionserve</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 15px/1.4 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
 .controls { display: flex; flex-wrap: wrap; gap: 1rem; align-items: center; }
 #drop { border: 2px dashed #888; border-radius: 8px; padding: 1.5rem; text-align: center; margin-top: 1rem; }
 #drop.over, #drop:focus-within { background: #eef; }
 :focus-visible { outline: 3px solid #36c; outline-offset: 2px; }
 #grid { list-style: none; padding: 0; display: grid; gap: 1rem;
         grid-template-columns: repeat(auto-fill, minmax(14rem, 1fr)); }
 .card { border: 1px solid #ddd; border-radius: 8px; padding: .5rem; }
 .card img { display: block; width: 100%; height: 8rem; object-fit: contain; image-rendering: pixelated;
             background: #f4f4f4; }
 .name { font-size: .85rem; color: #555; overflow-wrap: anywhere; margin: .25rem 0; }
 table { border-collapse: collapse; width: 100%; }
 td { padding: .1rem .3rem; border-bottom: 1px solid #eee; font-size: .9rem; }
 td.score { text-align: right; white-space: nowrap; }
 th { text-align: left; padding: .1rem .3rem; border-bottom: 1px solid #ccc; font-size: .9rem; }
 .bar { background: #4a7; height: .5rem; display: block; }
 .error, #error { color: #b00; }
 .timing, #latency { font-size: .8rem; color: #555; }
 #chart { width: 100%; max-width: 30rem; height: 4.5rem; background: #fafafa; border: 1px solid #ddd; }
 #chart polyline { fill: none; stroke: #36c; stroke-width: 1.5; }
 #rollouts td { white-space: nowrap; }
 #rollouts td.verdict { white-space: normal; }
/* boxes: style */
/* live: style */
/* sources: style */
</style></head>
<body>
<h1>visionserve</h1>
<div class="controls">
 <label for="model">Model</label> <select id="model"></select>
 <label for="topk" id="topk-label">Classes per image (top-k)</label>
 <input id="topk" type="number" value="5" min="1" max="1000" inputmode="numeric">
<!-- boxes: control -->
</div>
<div id="drop">
 <p id="drop-help">Drop images here, paste them (Ctrl+V or Cmd+V), or choose files.</p>
 <label for="file">Choose images</label>
 <input id="file" type="file" accept="image/*" multiple aria-describedby="drop-help">
</div>
<p id="error" role="alert"></p>
<ul id="grid" aria-label="images and their answers" aria-live="polite"></ul>
<!-- live: section -->
<!-- sources: section -->
<h2>Server latency of recent requests</h2>
<svg id="chart" viewBox="0 0 300 60" preserveAspectRatio="none" role="img" aria-labelledby="latency">
 <polyline points=""></polyline></svg>
<p id="latency">No requests yet.</p>
<h2 id="models-title">Models</h2>
<table id="models" aria-labelledby="models-title"><thead><tr><th scope="col">Model</th><th scope="col">State</th>
 <th scope="col">Device</th><th scope="col">Residency</th><th scope="col">Resident</th></tr></thead>
 <tbody></tbody></table>
<section id="rollouts-section" hidden>
<h2 id="rollouts-title">Rollouts</h2>
<table id="rollouts" aria-labelledby="rollouts-title"><thead><tr><th scope="col">Model</th><th scope="col">Mode</th>
 <th scope="col">Primary -&gt; candidate</th><th scope="col">Samples</th><th scope="col">Agreement [low, high]</th>
 <th scope="col">Latency ratio</th><th scope="col">Shed</th><th scope="col">Verdict</th></tr></thead>
 <tbody></tbody></table>
</section>
<script>
'use strict';
const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  for (const child of children) node.append(child);  // strings become text nodes, never markup
  return node;
};
let images = [];          // [{file, card, run}]: what is on screen, re-run when the model or top-k changes
const recent = [];        // the server's total duration (ms) of the last requests, for the chart
const CHART_POINTS = 50;

const megabytes = (bytes) => bytes >= 1e9 ? `${(bytes / 1e9).toFixed(2)} GB` : `${(bytes / 1e6).toFixed(1)} MB`;

// first: also fill the model picker (later calls only refresh the table, keeping the picked model)
async function loadModels(first = false) {
  try {
    const r = await fetch('/v1/models');
    const models = await r.json();
    if (!r.ok) throw new Error(models.error || r.statusText);
    for (const m of models) modelTasks[m.name] = m.task || 'classify';
    if (first) {
      $('model').replaceChildren(...models.map(m =>
        new Option(`${m.name} (v${m.version}, ${m.device}, ${m.precision})`, m.name)));
      if (!models.length) $('error').textContent = 'No model is served.';
      taskControls();
    }
    $('models').querySelector('tbody').replaceChildren(...models.map(m => el('tr', {className: 'model'},
      el('td', {}, `${m.name} v${m.version}`), el('td', {}, String(m.state)),
      el('td', {}, String(m.device)),
      el('td', {className: 'residency'}, m.residency === 'on_demand' ? 'on demand' : 'pinned'),
      el('td', {className: 'resident'},
        !m.resident ? 'no' : m.resident_bytes ? `yes, ${megabytes(m.resident_bytes)}` : 'yes'))));
    loadRollouts(models.map(m => m.name));
  } catch (e) {
    if (first) $('error').textContent = `Could not list the models: ${e.message}`;
  }
}

const percent = (v) => `${(100 * v).toFixed(2)}%`;

// A model's rollout document, or null where it has none: {"state": "none"}, or a 404 (a server without rollouts).
async function rolloutOf(name) {
  try {
    const r = await fetch(`/v2/models/${encodeURIComponent(name)}/rollout`);
    if (r.status === 404) return null;
    const body = await r.json().catch(() => ({}));
    if (!r.ok) return {model: name, error: body.error || `${r.status} ${r.statusText}`};
    return body.state && body.state !== 'none' ? body : null;
  } catch (e) {
    return {model: name, error: e.message};
  }
}

function rolloutRow(d) {
  const cell = (className, text) => el('td', {className}, text);
  if (d.error) {
    return el('tr', {className: 'rollout'}, cell('model', String(d.model)),
      el('td', {className: 'error', colSpan: 7}, `Could not read its rollout: ${d.error}`));
  }
  const c = d.comparison || {};
  // a detector's agreement is on boxes (an image agrees when its boxes' F1 reaches min_box_f1), said beside it
  const boxes = c.box_f1_mean != null ? `, boxes (mean F1 ${c.box_f1_mean.toFixed(3)})` : '';
  const agreement = c.agreement == null ? 'none yet'
    : `${percent(c.agreement)} [${percent(c.agreement_low)}, ${percent(c.agreement_high)}]${boxes}`;
  // running: what the evidence says now (acted on when auto); decided: what was done and why
  const verdict = d.state === 'running'
    ? `${d.verdict}${d.verdict_reason ? `: ${d.verdict_reason}` : ''}${d.auto ? '' : ' (auto off)'}`
    : `${d.state}${d.reason ? `: ${d.reason}` : ''}`;
  return el('tr', {className: 'rollout'}, cell('model', String(d.model)), cell('mode', String(d.mode)),
    cell('versions', `v${d.primary} -> v${d.candidate}`), cell('samples', String(c.samples ?? 0)),
    cell('agreement', agreement),
    cell('latency-ratio', c.latency_ratio == null ? 'none yet' : `${c.latency_ratio.toFixed(2)}x`),
    cell('shed', String(c.shed ?? 0)), cell('verdict', verdict));
}

let rolloutsRun = 0;  // an answer to an older read (the table was read again meanwhile) is dropped
async function loadRollouts(names) {
  const run = ++rolloutsRun;
  const found = (await Promise.all(names.map(rolloutOf))).filter(Boolean);
  if (run !== rolloutsRun) return;
  $('rollouts').querySelector('tbody').replaceChildren(...found.map(rolloutRow));
  $('rollouts-section').hidden = !found.length;
}

let modelsTimer = 0;  // one refresh after a burst of answers, not one per image
const refreshModels = () => { clearTimeout(modelsTimer); modelsTimer = setTimeout(loadModels, 300); };

function serverTiming(header) {
  const out = {};
  for (const part of (header || '').split(',')) {
    const [name, ...params] = part.trim().split(';');
    const dur = params.map(p => p.trim()).find(p => p.startsWith('dur='));
    if (name && dur) out[name] = parseFloat(dur.slice(4));
  }
  return out;
}

function drawChart() {
  const points = recent.slice(-CHART_POINTS);
  if (!points.length) return;
  const top = Math.max(...points) * 1.1 || 1;
  const step = points.length > 1 ? 300 / (points.length - 1) : 0;
  $('chart').querySelector('polyline').setAttribute('points',
    points.map((v, i) => `${(i * step).toFixed(1)},${(60 - 58 * v / top).toFixed(1)}`).join(' '));
  const sorted = [...points].sort((a, b) => a - b);
  const median = sorted[Math.floor((sorted.length - 1) / 2)];
  $('latency').textContent = `Last ${points.length} requests, server total: latest ` +
    `${points[points.length - 1].toFixed(1)} ms, median ${median.toFixed(1)} ms, max ` +
    `${sorted[sorted.length - 1].toFixed(1)} ms (0 to ${top.toFixed(1)} ms shown).`;
}

// One class of an answer: its label (text, never markup), score and a bar.
function predictionRow(p) {
  const bar = el('span', {className: 'bar'});
  bar.style.width = `${Math.max(1, Math.round(100 * p.score))}%`;
  return el('tr', {className: 'prediction'}, el('td', {className: 'label'}, String(p.label)),
    el('td', {className: 'score'}, (100 * p.score).toFixed(1) + '%'), el('td', {className: 'bar-cell'}, bar));
}

function newCard(file) {
  const img = el('img', {alt: file.name || 'pasted image', src: URL.createObjectURL(file)});
  const boxes = svgEl('svg', {class: 'boxes', 'aria-hidden': 'true'});  // a detector's boxes (demo_boxes.py)
  const card = el('li', {className: 'card'}, el('div', {className: 'view'}, img, boxes),
    el('p', {className: 'name'}, file.name || 'pasted image'), el('p', {className: 'found'}),
    el('table', {className: 'predictions'}, el('tbody')),
    el('p', {className: 'error', role: 'alert'}), el('p', {className: 'timing'}));
  card.setAttribute('aria-busy', 'true');
  return card;
}

async function classify(item) {
  const run = ++item.run;  // an answer to an older run (before the model or top-k changed) is dropped
  const card = item.card;
  card.setAttribute('aria-busy', 'true');
  const detector = isDetector(), model = encodeURIComponent($('model').value);
  const url = detector ? `/v1/models/${model}/detect?score_threshold=${BOX_REQUEST_THRESHOLD}`
    : `/v1/models/${model}/classify?top_k=` + encodeURIComponent($('topk').value);
  const form = new FormData();
  form.append('file', item.file, item.file.name || 'pasted');
  let predictions = [], found = null, error = '', timing = '';
  try {
    const started = performance.now();
    const r = await fetch(url, {method: 'POST', body: form});
    const roundTrip = performance.now() - started;
    const text = await r.text();
    let body;
    try { body = JSON.parse(text); } catch { body = {error: `${r.status} ${r.statusText}: ${text.slice(0, 200)}`}; }
    const st = serverTiming(r.headers.get('Server-Timing'));
    if ('total' in st) { recent.push(st.total); drawChart(); }
    timing = ['queue', 'preprocess', 'compute', 'postprocess', 'total'].filter(k => k in st)
      .map(k => `${k} ${st[k].toFixed(1)} ms`).join(', ') + `; round trip ${roundTrip.toFixed(1)} ms`;
    if (!r.ok) error = body.error || `${r.status} ${r.statusText}`;
    else if (body.results[0].error) error = body.results[0].error;
    else if (detector) found = body.results[0];
    else predictions = body.results[0].predictions;
  } catch (e) {
    error = `The request failed: ${e.message}`;
  }
  if (run !== item.run) return;
  card.querySelector('tbody').replaceChildren(...predictions.map(predictionRow));
  item.found = found;
  showBoxes(item);
  card.querySelector('.error').textContent = error;
  card.querySelector('.timing').textContent = timing ? `server: ${timing}` : '';
  card.setAttribute('aria-busy', 'false');
  refreshModels();
}

function show(files) {
  files = [...files].filter(f => f instanceof File);
  if (!files.length) return;
  for (const old of images) URL.revokeObjectURL(old.card.querySelector('img').src);
  images = files.map(file => ({file, card: newCard(file), run: 0, found: null}));
  $('grid').replaceChildren(...images.map(i => i.card));
  rerun();
}

function rerun() {
  $('error').textContent = '';
  for (const item of images) classify(item);
}

let topkTimer = 0;
$('topk').addEventListener('input', () => { clearTimeout(topkTimer); topkTimer = setTimeout(rerun, 250); });
$('model').addEventListener('change', rerun);
$('file').addEventListener('change', (e) => show(e.target.files));
const drop = $('drop');
drop.addEventListener('dragover', (e) => { e.preventDefault(); drop.classList.add('over'); });
drop.addEventListener('dragleave', () => drop.classList.remove('over'));
drop.addEventListener('drop', (e) => { e.preventDefault(); drop.classList.remove('over');
  show(e.dataTransfer.files); });
document.addEventListener('paste', (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])];
  if (files.length) { e.preventDefault(); show(files); }
});
// boxes: script
loadModels(true);
// live: script
// sources: script
</script></body></html>
"""
PAGE = (
    _PAGE.replace("/* boxes: style */\n", BOXES_STYLE)
    .replace("<!-- boxes: control -->\n", SCORE_CONTROL)
    .replace("// boxes: script\n", BOXES_SCRIPT)
    .replace("/* live: style */\n", LIVE_STYLE)
    .replace("<!-- live: section -->\n", LIVE_SECTION)
    .replace("// live: script\n", LIVE_SCRIPT)
    .replace("/* sources: style */\n", SOURCES_STYLE)
    .replace("<!-- sources: section -->\n", SOURCES_SECTION)
    .replace("// sources: script\n", SOURCES_SCRIPT)
)

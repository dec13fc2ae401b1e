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
  const boxes = svgEl('svg', {class: 'boxes', 'aria-hidden': 'true'});  // a detector's boxes (boxes.js)
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
  const detector = isDetector(), task = modelTasks[$('model').value], model = encodeURIComponent($('model').value);
  const masks = task === 'segment' ? '&mask_format=png' : '';  // a PNG a mask: the overlay draws it as it comes
  const url = detector ? `/v1/models/${model}/${task}?score_threshold=${BOX_REQUEST_THRESHOLD}${masks}`
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
    else if (detector) found = {detections: body.results[0].instances, ...body.results[0]};  // a segmenter's too
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

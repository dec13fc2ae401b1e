// ---- Sources: the server's own cameras and files (docs/sources.md), listed and watched frame by frame ----
const SOURCES_TOKEN_KEY = 'visionserve-admin-token';  // sessionStorage: this tab only
const SOURCES_FINAL = ['ended', 'failed', 'stopped'];
const watch = {socket: null, id: '', found: null, last: null, ended: null, shown: 0,
  counts: {result: 0, expired: 0, error: 0}, geometry: null, trails: new Map(), tally: null, events: 0};
const TRAIL_POINTS = 20;  // a track's trail: its last centres

const sourcesToken = () => $('sources-token').value.trim();
const sourcesMs = (v) => typeof v === 'number' ? `${v.toFixed(1)} ms` : '-';

function sourceRow(s) {
  const state = SOURCES_FINAL.includes(s.state) && s.reason ? `${s.state}: ${s.reason}` : String(s.state);
  const button = el('button', {type: 'button', className: 'watch'}, 'Watch');
  button.setAttribute('aria-label', `Watch ${s.id}`);
  button.addEventListener('click', () => sourcesWatch(String(s.id)));
  const row = el('tr', {className: 'source'}, el('td', {className: 'id'}, String(s.id)),
    el('td', {className: 'model'}, String(s.model)), el('td', {className: 'state'}, state),
    el('td', {className: 'fps'}, s.fps && typeof s.fps.answered === 'number' ? s.fps.answered.toFixed(1) : '-'),
    el('td', {className: 'age'}, sourcesMs(s.age_ms && s.age_ms.p99)), el('td', {}, button));
  row.dataset.id = String(s.id);
  row.setAttribute('aria-current', String(s.id === watch.id));
  return row;
}

async function sourcesRefresh() {
  const token = sourcesToken();
  if (!token) { $('sources-status').textContent = 'Enter the admin token first.'; return; }
  $('sources-status').textContent = 'Listing the sources...';
  try {
    const r = await fetch('/v1/sources', {headers: {Authorization: `Bearer ${token}`}});
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    const sources = body.sources || [];
    $('sources').querySelector('tbody').replaceChildren(...sources.map(sourceRow));
    $('sources-status').textContent = sources.length ? `${sources.length} source(s).` : 'The server has no source.';
  } catch (e) {
    $('sources-status').textContent = `Could not list the sources: ${e.message}`;
  }
}

// The counts line and the view's data- attributes, from what the watched source sent last.
function sourcesCounts() {
  const view = $('sources-view'), a = watch.last, c = watch.counts;
  const drawn = $('sources-boxes').querySelectorAll('g.box').length;
  let what = 'No frame answered yet.';
  if (a && Array.isArray(a.detections)) {
    what = `Frame ${a.frame}, age ${sourcesMs(a.age_ms)}: ${a.detections.length} box(es), ${drawn} drawn at score ` +
      `${scoreThreshold().toFixed(2)} or more (frame ${a.width} x ${a.height} pixels).`;
  } else if (a) {
    what = `Frame ${a.frame}, age ${sourcesMs(a.age_ms)}.`;
  }
  $('sources-counts').textContent = `${what} Answered ${c.result}, expired ${c.expired}, errors ${c.error}.`;
  view.dataset.frame = a ? String(a.frame) : '';
  view.dataset.detections = a && Array.isArray(a.detections) ? String(a.detections.length) : '';
  view.dataset.drawn = String(drawn);
}

function sourcesPaint() {
  drawBoxes($('sources-boxes'), watch.found);
  sourcesCounts();
}

// A result: its frame shown, then its boxes (or top class) over it once the frame is decoded, so they never sit
// over another frame; a newer result meanwhile wins.
function sourcesResult(a) {
  const shown = ++watch.shown;
  const show = () => {
    if (shown !== watch.shown) return;
    $('sources-picture').hidden = false;
    watch.last = a;
    const boxes = a.detections || a.instances;
    for (const d of Array.isArray(boxes) ? boxes : []) {  // each tracked box's centre, onto its track's trail
      if (!Number.isInteger(d.track_id)) continue;
      const trail = watch.trails.get(d.track_id) || [];
      trail.push([(d.box[0] + d.box[2]) / 2, (d.box[1] + d.box[3]) / 2]);
      watch.trails.set(d.track_id, trail.slice(-TRAIL_POINTS));
    }
    for (const id of [...watch.trails.keys()].slice(0, -64)) watch.trails.delete(id);  // the oldest tracks go
    watch.found = Array.isArray(boxes) ? {width: a.width, height: a.height, detections: boxes,
      geometry: watch.geometry, trails: watch.trails, tally: watch.tally} : null;
    const top = !watch.found && Array.isArray(a.predictions) && a.predictions.length ? a.predictions[0] : null;
    $('sources-top').hidden = !top;
    $('sources-top').textContent = top ? `${top.label} ${percentText(top.score)}` : '';
    sourcesPaint();
  };
  if (!a.image) { show(); return; }  // an answer without its frame (subscribed while it was prepared)
  const img = $('sources-frame');
  img.src = `data:image/jpeg;base64,${a.image}`;
  img.decode().catch(() => {}).then(show);
}

function sourcesMessage(text) {
  let a;
  try { a = JSON.parse(text); } catch { a = {status: 'error', error: `not an answer: ${String(text).slice(0, 200)}`}; }
  if (a.type === 'event') {  // a track crossed a line, entered or left a zone: the counts are asked again
    watch.events++;
    $('sources-view').dataset.events = String(watch.events);
    sourcesTally();
    return;
  }
  const status = String(a.status);
  if (status === 'result') { watch.counts.result++; sourcesResult(a); return; }
  if (status === 'ended') { watch.ended = a; return; }
  if (status === 'expired') watch.counts.expired++;
  else {
    watch.counts.error++;
    $('sources-end').textContent = status === 'cut_off' ? `Cut off: ${a.reason}.` : `Error: ${a.error || status}`;
  }
  sourcesCounts();
}

// The watched source's counts (GET /v1/sources/{id}/counts), drawn on its lines and zones and said in words.
async function sourcesTally() {
  const id = watch.id;
  if (!watch.geometry) return;
  try {
    const r = await fetch(`/v1/sources/${encodeURIComponent(id)}/counts`,
      {headers: {Authorization: `Bearer ${sourcesToken()}`}});
    if (!r.ok || id !== watch.id) return;
    watch.tally = await r.json();
    const words = Object.entries(watch.tally.lines).map(([l, c]) => `${l}: in ${JSON.stringify(c.in)}, out ` +
      `${JSON.stringify(c.out)}`).concat(Object.entries(watch.tally.zones).map(([z, c]) =>
      `${z}: inside ${JSON.stringify(c.occupancy)}, entered ${JSON.stringify(c.entered)}`));
    $('sources-tally').textContent = words.join('; ');
    if (watch.found) { watch.found.tally = watch.tally; sourcesPaint(); }
  } catch { /* the next event asks again */ }
}

function sourcesWatch(id) {
  const token = sourcesToken();
  if (watch.socket) watch.socket.close(1000, 'the page watches another source');
  Object.assign(watch, {socket: null, id, found: null, last: null, ended: null, counts: {result: 0, expired: 0,
    error: 0}, geometry: null, trails: new Map(), tally: null, events: 0});
  $('sources-tally').textContent = '';
  fetch(`/v1/sources/${encodeURIComponent(id)}`, {headers: {Authorization: `Bearer ${token}`}})
    .then(r => r.ok ? r.json() : null).then(doc => {
      if (id !== watch.id || !doc || !doc.track) return;
      watch.geometry = doc.track;
      sourcesTally();
    }).catch(() => {});
  watch.shown++;  // a frame of the source watched before, still decoding, is dropped
  for (const row of $('sources').querySelectorAll('tr.source')) {
    row.setAttribute('aria-current', String(row.dataset.id === id));
  }
  const view = $('sources-view');
  view.hidden = false;
  view.dataset.state = 'connecting';
  $('sources-watching').textContent = `Watching ${id}`;
  $('sources-picture').hidden = true;
  $('sources-top').hidden = true;
  $('sources-end').textContent = 'Connecting...';
  sourcesPaint();
  const scheme = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const query = new URLSearchParams({token, frames: '1'});
  const socket = new WebSocket(`${scheme}//${location.host}/v1/sources/${encodeURIComponent(id)}/results?${query}`);
  socket.onopen = () => {
    if (socket !== watch.socket) return;
    view.dataset.state = 'open';
    $('sources-end').textContent = 'Watching: each answer as the server computes it.';
  };
  socket.onmessage = (e) => { if (socket === watch.socket) sourcesMessage(e.data); };
  socket.onclose = (e) => {
    if (socket !== watch.socket) return;
    watch.socket = null;
    const end = watch.ended;
    view.dataset.state = end ? String(end.state) : 'closed';
    $('sources-end').textContent = end ? `Source ${id} ${end.state}${end.reason ? `: ${end.reason}` : ''}.`
      : `The server closed the results (${e.code}${e.reason ? `: ${e.reason}` : ''}).`;
    sourcesRefresh();  // the list shows its final state and counts
  };
  watch.socket = socket;
}

$('sources-token').value = sessionStorage.getItem(SOURCES_TOKEN_KEY) || '';
$('sources-token').addEventListener('input', () => sessionStorage.setItem(SOURCES_TOKEN_KEY, sourcesToken()));
$('sources-token').addEventListener('keydown', (e) => { if (e.key === 'Enter') sourcesRefresh(); });
$('sources-refresh').addEventListener('click', sourcesRefresh);
$('score').addEventListener('input', () => { if (watch.id) sourcesPaint(); });

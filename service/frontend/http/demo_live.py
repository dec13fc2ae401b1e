"""The demo page's live mode (``demo.py`` puts these in the page): the browser's camera (``getUserMedia``), or a
video file, streamed to ``/v1/models/{m}/stream`` (docs/streams.md) at a set rate.

Each tick draws the video's frame to a canvas (what was sent stays on screen) and sends it as JPEG
(``canvas.toBlob``) in the binary frame format: the header's length (4 bytes, big-endian), the JSON header
``{"id", "ts"}`` (``ts``: the page's ``performance.now()``, echoed back, so the round trip is measured), the image.
A tick is skipped while the previous frame is still being encoded, or while the socket holds more than a megabyte
unsent (counted as skipped: the page never queues frames the server will only supersede). Each answer is shown as
it arrives: the frame's status and age, its round trip, the top classes of the last result (a detector's boxes:
listed, and drawn over the frame on screen, filtered by the page's score-threshold slider), and running counts of
frames sent, answered, superseded, expired and failed. Stopping waits (a few seconds at most) for the answers to
the frames already sent, so the counts add up: answered + superseded + expired + errors = sent. Changing the model,
top-k or max age while live opens a new stream (its counts start again). Labels, reasons and errors from the server
are inserted as text, never as HTML.
"""

from __future__ import annotations

LIVE_STYLE = """ #live-view { display: flex; flex-wrap: wrap; gap: 1rem; align-items: flex-start; margin-top: .5rem; }
 #live-picture { width: 20rem; max-width: 100%; border: 1px solid #ddd; }
 #live-canvas { display: block; width: 100%; background: #f4f4f4; }  /* no border: the boxes' overlay covers it */
 #live-answer { flex: 1; min-width: 14rem; }
 #live-toggle[aria-pressed="true"] { background: #b00; color: #fff; }
 #live-counts, #live-last { font-size: .9rem; }
"""

LIVE_SECTION = """<section id="live-section" aria-labelledby="live-title">
<h2 id="live-title">Live</h2>
<p id="live-help">Stream the camera, or a video file, to the model: a frame at each tick of the rate, each answered
 with its classes (a detector's boxes, drawn over the frame) and its age. Frames that come faster than the model
 answers are superseded by newer ones, and a frame older than the max age is dropped (expired).</p>
<div class="controls">
 <label for="live-source">Source</label>
 <select id="live-source"><option value="camera">Camera</option><option value="video">Video file</option></select>
 <label for="live-file">Video file</label> <input id="live-file" type="file" accept="video/*">
 <label for="live-fps">Frames per second</label>
 <input id="live-fps" type="number" value="5" min="0.1" max="30" step="0.1" inputmode="decimal">
 <label for="live-max-age">Max age (ms)</label>
 <input id="live-max-age" type="number" value="500" min="1" max="60000" inputmode="numeric">
 <button id="live-toggle" type="button" aria-pressed="false" aria-label="Live" aria-describedby="live-help">Live
 </button>
</div>
<p id="live-status" role="status">Not streaming.</p>
<div id="live-view">
 <video id="live-video" muted playsinline hidden></video>
 <div id="live-picture" class="view">
  <canvas id="live-canvas" width="320" height="240" role="img" aria-label="The frame sent last"></canvas>
  <svg id="live-boxes" class="boxes" aria-hidden="true"></svg>
 </div>
 <div id="live-answer">
  <p id="live-last">Frame <span id="live-frame">none</span>: <span id="live-result">no answer yet</span>,
   age <span id="live-age">-</span>, round trip <span id="live-rtt">-</span>.
   <span id="live-detail" class="error"></span></p>
  <table id="live-predictions" class="predictions" aria-label="Classes or boxes of the last answered frame"><tbody>
  </tbody>
  </table>
  <p id="live-counts">Sent <span id="live-sent">0</span>, answered <span id="live-answered">0</span>,
   superseded <span id="live-superseded">0</span>, expired <span id="live-expired">0</span>,
   errors <span id="live-errors">0</span>, skipped <span id="live-skipped">0</span>.</p>
 </div>
</div>
</section>
"""

LIVE_SCRIPT = r"""
// ---- Live: the camera or a video file, a frame per tick to /v1/models/{m}/stream (docs/streams.md) ----
const LIVE_MAX_SIDE = 640;          // frames are scaled down to this many pixels on their longer side
const LIVE_MAX_BUFFERED = 1 << 20;  // bytes the socket may hold unsent before a tick is skipped
const LIVE_STOP_WAIT_MS = 3000;     // how long stopping waits for the answers to the frames sent
const LIVE_FIELDS = {sent: 'live-sent', answered: 'live-answered', superseded: 'live-superseded',
  expired: 'live-expired', error: 'live-errors', skipped: 'live-skipped'};
const LIVE_OUTCOME = {result: 'answered', superseded: 'superseded', expired: 'expired', error: 'error'};
const live = {on: false, socket: null, release: null, timer: 0, id: 0, encoding: false, finish: null,
  counts: {}, what: '', found: null};  // found: a detector's last result, {width, height, detections}

function liveCounts(reset = false) {
  for (const [key, id] of Object.entries(LIVE_FIELDS)) {
    if (reset) live.counts[key] = 0;
    $(id).textContent = String(live.counts[key]);
  }
}

const liveAnswered = () => live.counts.answered + live.counts.superseded + live.counts.expired + live.counts.error;

function liveOptions() {
  const fps = Number($('live-fps').value), maxAge = Number($('live-max-age').value);
  if (!(fps > 0 && fps <= 30)) {
    throw new Error(`frames per second must be a number in (0, 30], got ${$('live-fps').value}`);
  }
  if (!(maxAge > 0 && maxAge <= 60000)) {
    throw new Error(`max age must be a number of milliseconds in (0, 60000], got ${$('live-max-age').value}`);
  }
  return {fps, maxAge};
}

// Plays the chosen source in the (hidden) video element; what stops it.
async function liveSource() {
  const video = $('live-video');
  if ($('live-source').value === 'camera') {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      throw new Error('this page has no camera (browsers offer one on https or localhost only)');
    }
    const stream = await navigator.mediaDevices.getUserMedia({video: true, audio: false});
    video.srcObject = stream;
    live.what = 'the camera';
    return () => { stream.getTracks().forEach(t => t.stop()); video.srcObject = null; };
  }
  const file = $('live-file').files[0];
  if (!file) throw new Error('choose a video file first');
  const url = URL.createObjectURL(file);
  video.srcObject = null;
  video.loop = true;
  video.src = url;
  live.what = file.name;
  return () => { video.pause(); video.removeAttribute('src'); video.load(); URL.revokeObjectURL(url); };
}

// A new stream (the counts start again); a stream open before is closed, its late answers dropped.
function liveConnect() {
  const {maxAge} = liveOptions();
  if (live.socket) live.socket.close(1000, 'the page opened another stream');
  const model = $('model').value;
  // A detector is asked for every box down to the slider's lowest value, which then filters them here.
  const query = new URLSearchParams(isDetector(model)
    ? {max_age_ms: String(maxAge), score_threshold: String(BOX_REQUEST_THRESHOLD)}
    : {max_age_ms: String(maxAge), top_k: $('topk').value});
  const scheme = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const socket = new WebSocket(`${scheme}//${location.host}/v1/models/${encodeURIComponent(model)}/stream?${query}`);
  socket.onmessage = (e) => { if (socket === live.socket) liveAnswer(e.data); };
  socket.onclose = (e) => {
    if (socket !== live.socket) return;
    live.socket = null;
    liveStop(`the server closed the stream (${e.code}${e.reason ? `: ${e.reason}` : ''})`);
  };
  socket.onopen = () => {
    if (socket === live.socket) $('live-status').textContent = `Streaming ${live.what} to ${model}.`;
  };
  live.socket = socket;
  live.id = 0;
  live.found = null;
  liveBoxes();
  liveCounts(true);
}

function liveTick() {
  const video = $('live-video'), socket = live.socket;
  if (live.encoding || !socket || socket.readyState !== WebSocket.OPEN || video.readyState < 2 || !video.videoWidth) {
    return;
  }
  if (socket.bufferedAmount > LIVE_MAX_BUFFERED) { live.counts.skipped++; liveCounts(); return; }
  const canvas = $('live-canvas');
  const scale = Math.min(1, LIVE_MAX_SIDE / Math.max(video.videoWidth, video.videoHeight));
  canvas.width = Math.round(video.videoWidth * scale);
  canvas.height = Math.round(video.videoHeight * scale);
  canvas.getContext('2d').drawImage(video, 0, 0, canvas.width, canvas.height);
  live.encoding = true;
  const id = ++live.id, ts = performance.now();
  canvas.toBlob((blob) => {
    live.encoding = false;
    if (!blob || socket !== live.socket || socket.readyState !== WebSocket.OPEN) return;
    const header = new TextEncoder().encode(JSON.stringify({id, ts}));
    const length = new Uint8Array(4);
    new DataView(length.buffer).setUint32(0, header.length);  // big-endian, DataView's default
    socket.send(new Blob([length, header, blob]));
    live.counts.sent++;
    liveCounts();
  }, 'image/jpeg', 0.85);
}

function liveAnswer(text) {
  let a;
  try { a = JSON.parse(text); } catch { a = {status: 'error', error: `not an answer: ${String(text).slice(0, 200)}`}; }
  const status = String(a.status);
  live.counts[LIVE_OUTCOME[status] || 'error']++;
  liveCounts();
  $('live-frame').textContent = a.id == null ? 'none' : String(a.id);
  $('live-result').textContent = status;
  $('live-age').textContent = typeof a.age_ms === 'number' ? `${a.age_ms.toFixed(1)} ms` : '-';
  $('live-rtt').textContent = typeof a.ts === 'number' ? `${(performance.now() - a.ts).toFixed(1)} ms` : '-';
  $('live-detail').textContent = status === 'superseded' ? `Superseded by frame ${a.by}.`
    : status === 'expired' ? `Expired at ${a.stage}${a.reason ? `: ${a.reason}` : ''}.`
    : status === 'error' ? String(a.error) : '';
  if (status === 'result') {
    const canvas = $('live-canvas');
    live.found = Array.isArray(a.detections)
      ? {width: a.width || canvas.width, height: a.height || canvas.height, detections: a.detections} : null;
    if (live.found) liveBoxes();
    else $('live-predictions').querySelector('tbody').replaceChildren(...(a.predictions || []).map(predictionRow));
  }
  if (live.finish && liveAnswered() >= live.counts.sent) live.finish();
}

async function liveStart() {
  if (live.finish) live.finish();  // the stream stopped before: done waiting for its answers
  let options;
  try { options = liveOptions(); } catch (e) { $('live-status').textContent = `Not started: ${e.message}.`; return; }
  live.on = true;
  $('live-toggle').setAttribute('aria-pressed', 'true');
  $('live-status').textContent = 'Starting...';
  try {
    const release = await liveSource();
    if (!live.on) { release(); return; }  // stopped while the source started
    live.release = release;
    await $('live-video').play();
    if (!live.on) return;
    liveConnect();
  } catch (e) {
    if (live.on) liveStop(`could not start: ${e.message}`);
    return;
  }
  live.timer = setInterval(liveTick, 1000 / options.fps);
}

// Stops sending; the stream ends once the frames sent are answered (or after LIVE_STOP_WAIT_MS).
function liveStop(why = '') {
  live.on = false;
  clearInterval(live.timer);
  live.timer = 0;
  if (live.release) { live.release(); live.release = null; }
  $('live-toggle').setAttribute('aria-pressed', 'false');
  const socket = live.socket;
  let waiting = 0;
  live.finish = () => {
    clearTimeout(waiting);
    live.finish = null;
    if (socket && socket === live.socket) { live.socket = null; socket.close(1000, 'the page stopped'); }
    $('live-status').textContent = `Live stopped${why ? `: ${why}` : ''}.`;
  };
  if (!socket || socket.readyState !== WebSocket.OPEN || liveAnswered() >= live.counts.sent) { live.finish(); return; }
  $('live-status').textContent = 'Stopping: waiting for the answers to the frames sent.';
  waiting = setTimeout(live.finish, LIVE_STOP_WAIT_MS);
}

// A detector's last boxes, above the score threshold, listed and drawn over the frame; cleared otherwise.
function liveBoxes() {
  drawBoxes($('live-boxes'), live.found);
  if (live.found) $('live-predictions').querySelector('tbody').replaceChildren(...keptBoxes(live.found.detections)
    .map(detectionRow));
}

$('live-toggle').addEventListener('click', () => (live.on ? liveStop() : liveStart()));
$('live-file').addEventListener('change', () => { if ($('live-file').files.length) $('live-source').value = 'video'; });
$('live-fps').addEventListener('change', () => {
  if (!live.timer) return;
  try {
    const {fps} = liveOptions();
    clearInterval(live.timer);
    live.timer = setInterval(liveTick, 1000 / fps);
  } catch (e) { liveStop(e.message); }
});
for (const id of ['model', 'topk', 'live-max-age']) {
  $(id).addEventListener('change', () => {
    if (!live.timer) return;
    try { liveConnect(); } catch (e) { liveStop(e.message); }
  });
}
liveCounts(true);
"""

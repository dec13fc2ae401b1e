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

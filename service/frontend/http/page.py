"""``GET /``: a small page where a person drops an image and sees the classes, the scores and the timings."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.response import Redirect, Response

from service.frontend.http.image_api import server_of

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>visionserve</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 15px/1.4 system-ui, sans-serif; max-width: 44rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
 #drop { border: 2px dashed #888; border-radius: 8px; padding: 2rem; text-align: center; cursor: pointer; }
 #drop.over { background: #eef; }
 img { max-width: 12rem; max-height: 12rem; min-width: 6rem; margin-top: 1rem; image-rendering: pixelated; }
 table { border-collapse: collapse; margin-top: 1rem; width: 100%; }
 td, th { padding: .25rem .5rem; border-bottom: 1px solid #ddd; text-align: left; }
 .bar { background: #4a7; height: .6rem; display: inline-block; }
 #error { color: #b00; }
</style></head>
<body>
<h1>visionserve</h1>
<p>Model <select id="model"></select> &nbsp; top <input id="topk" type="number" value="5" min="1" max="20"></p>
<div id="drop">Drop an image here, or <label><u>pick one</u><input id="file" type="file" accept="image/*" hidden>
</label></div>
<div id="preview"></div>
<p id="error" role="alert"></p>
<table id="results" hidden><thead><tr><th>class</th><th>score</th><th></th></tr></thead><tbody></tbody></table>
<p id="timing"></p>
<script>
const $ = (id) => document.getElementById(id);
async function loadModels() {
  const r = await fetch('/v1/models');
  const models = await r.json();
  $('model').innerHTML = models.map(m =>
    `<option value="${m.name}">${m.name} (v${m.version}, ${m.device})</option>`).join('');
}
async function classify(file) {
  $('error').textContent = ''; $('results').hidden = true; $('timing').textContent = '';
  $('preview').innerHTML = `<img alt="your image" src="${URL.createObjectURL(file)}">`;
  const url = `/v1/models/${encodeURIComponent($('model').value)}/classify?top_k=${$('topk').value}`;
  const started = performance.now();
  const r = await fetch(url, {method: 'POST', body: file, headers: {'Content-Type': file.type || 'image/jpeg'}});
  const total = performance.now() - started;
  const body = await r.json();
  if (!r.ok) { $('error').textContent = body.error; return; }
  const result = body.results[0];
  if (result.error) { $('error').textContent = result.error; return; }
  $('results').querySelector('tbody').innerHTML = result.predictions.map(p =>
    `<tr class="prediction"><td class="label">${p.label}</td><td class="score">${(100 * p.score).toFixed(1)}%</td>` +
    `<td><span class="bar" style="width:${Math.round(200 * p.score)}px"></span></td></tr>`).join('');
  $('results').hidden = false;
  const st = (r.headers.get('Server-Timing') || '').split(',').map(s => s.trim()).filter(Boolean)
    .map(s => { const [name, dur] = s.split(';dur='); return `${name} ${(+dur).toFixed(1)} ms`; });
  $('timing').textContent = `server: ${st.join(', ')}; round trip ${total.toFixed(1)} ms`;
}
$('file').addEventListener('change', (e) => e.target.files[0] && classify(e.target.files[0]));
const drop = $('drop');
drop.addEventListener('dragover', (e) => { e.preventDefault(); drop.classList.add('over'); });
drop.addEventListener('dragleave', () => drop.classList.remove('over'));
drop.addEventListener('drop', (e) => { e.preventDefault(); drop.classList.remove('over');
  if (e.dataTransfer.files[0]) classify(e.dataTransfer.files[0]); });
loadModels();
</script></body></html>
"""


@get("/", summary="Demo page", include_in_schema=False, media_type="text/html")
async def index() -> Response[str]:
    return Response(PAGE, media_type="text/html")


@get("/docs", summary="OpenAPI UI", include_in_schema=False)
async def docs() -> Redirect:
    return Redirect(path="/schema/")


@get("/v1/models", summary="The served models", tags=["image API"])
async def list_models(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    server = server_of(request)
    rows = []
    for name, versions in sorted(server.slots.items()):
        slot = versions[max(versions)]
        state = slot.engine.state()
        rows.append(
            {
                "name": name,
                "version": slot.version.version,
                "versions": sorted(versions),
                "state": state.state,
                "device": ",".join(state.devices),
                "backend": state.backend,
                "note": state.note,
                "classes": slot.spec.num_classes,
                "input": [slot.spec.input.channels, slot.spec.input.height, slot.spec.input.width],
            }
        )
    return rows

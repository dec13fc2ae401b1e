// ---- Boxes: a detector's answer drawn over its image, a segmenter's masks filled under them (boxes.js) ----
const BOX_REQUEST_THRESHOLD = @REQUEST_SCORE_THRESHOLD@;  // asked of the server once; the slider filters above it, here
const BOX_FONT_PX = 12;                 // label size on screen, whatever the image's scale
const SVG_NS = 'http://www.w3.org/2000/svg';
const modelTasks = {};                  // model name -> 'classify' | 'detect' | 'segment' | ..., from /v1/models
let maskIds = 0;                        // each drawn mask's SVG <mask> id

const isDetector = (name = $('model').value) => ['detect', 'segment'].includes(modelTasks[name]);
const scoreThreshold = () => Number($('score').value);
const keptBoxes = (detections) => (detections || []).filter(d => d.score >= scoreThreshold());
const percentText = (score) => (100 * score).toFixed(1) + '%';

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

// One box of an answer in a list: its label (text, never markup), score and box in the image's pixels.
function detectionRow(d) {
  return el('tr', {className: 'detection'}, el('td', {className: 'label'}, String(d.label)),
    el('td', {className: 'score'}, percentText(d.score)),
    el('td', {className: 'box'}, d.box.map(v => v.toFixed(1)).join(', ')));
}

// The boxes an SVG overlay last drew are drawn again when its size changes: labels and strokes keep their size.
const boxesResized = new ResizeObserver((entries) => { for (const e of entries) paintBoxes(e.target); });

// Draws ``found`` ({width, height, detections}: boxes in the image's own pixels) over the element ``svg`` covers,
// or clears it (null).
function drawBoxes(svg, found) {
  svg.found = found;
  boxesResized.observe(svg);
  paintBoxes(svg);
}

function paintBoxes(svg) {
  const found = svg.found;
  if (!found || !found.width || !found.height) { svg.replaceChildren(); svg.removeAttribute('viewBox'); return; }
  const {width, height} = found;
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  const shown = svg.getBoundingClientRect();
  const unit = 1 / (Math.min(shown.width / width, shown.height / height) || 1);  // a screen pixel, in image pixels
  const font = BOX_FONT_PX * unit, pad = 2 * unit, tagHeight = font + 2 * pad;
  const boxes = keptBoxes(found.detections).map((d) => {
    const [x1, y1, x2, y2] = d.box;
    const text = svgEl('text', {'font-size': font, 'dominant-baseline': 'text-before-edge'});
    const track = Number.isInteger(d.track_id) ? `#${d.track_id} ` : '';  // a tracked box's track (docs/tracking.md)
    text.textContent = `${track}${d.label} ${percentText(d.score)}`;  // text, never markup
    const background = svgEl('rect', {class: 'tag-bg', height: tagHeight});
    const group = svgEl('g', {class: 'box'});
    if (typeof d.mask === 'string') {  // a segmenter's mask, a PNG of the image's size: its inside filled, see-through
      const id = `mask-${++maskIds}`, whole = {x: 0, y: 0, width, height};
      const mask = svgEl('mask', {id, maskUnits: 'userSpaceOnUse', ...whole});
      mask.append(svgEl('image', {href: `data:image/png;base64,${d.mask}`, preserveAspectRatio: 'none', ...whole}));
      group.append(mask, svgEl('rect', {class: 'fill', mask: `url(#${id})`, ...whole}));
    }
    group.append(svgEl('rect', {class: 'outline', x: x1, y: y1, width: Math.max(0, x2 - x1),
      height: Math.max(0, y2 - y1)}), svgEl('g', {class: 'tag'}));
    group.lastChild.append(background, text);
    return {group, text, background, x1, y1};
  });
  svg.replaceChildren(...tracked(found, unit), ...boxes.map(b => b.group));
  // Placed once in the document, where text can be measured: above its box, or inside it where the image's top
  // edge leaves no room; kept within the image on the right.
  for (const {text, background, x1, y1} of boxes) {
    const measured = text.getComputedTextLength();
    const tagWidth = (measured || 0.6 * font * text.textContent.length) + 2 * pad;
    const x = Math.max(0, Math.min(x1, width - tagWidth));
    const y = y1 >= tagHeight ? y1 - tagHeight : y1;
    background.setAttribute('x', x);
    background.setAttribute('y', y);
    background.setAttribute('width', tagWidth);
    text.setAttribute('x', x + pad);
    text.setAttribute('y', y + pad);
  }
}

// A tracking source's zones, lines (each with its counts) and its tracks' trails (found.geometry: the source's
// track, its coordinates in pixels or shares of the frame; found.trails: track id -> its last centres).
function tracked(found, unit) {
  const g = found.geometry, out = [], scale = g && g.normalized ? [found.width, found.height] : [1, 1];
  const at = (p) => `${p[0] * scale[0]},${p[1] * scale[1]}`;
  const label = (p, words, cls) => {
    const text = svgEl('text', {class: cls, x: p[0] * scale[0] + 4 * unit, y: p[1] * scale[1] + 14 * unit,
      'font-size': BOX_FONT_PX * unit});
    text.textContent = words;
    return text;
  };
  for (const z of (g && g.zones) || []) {
    out.push(svgEl('polygon', {class: 'zone', points: z.polygon.map(at).join(' ')}));
    const c = (found.tally && found.tally.zones[z.id]) || {};
    const inside = Object.values(c.occupancy || {}).reduce((a, b) => a + b, 0);
    out.push(label(z.polygon[0], `${z.id}: ${inside} inside`, 'zone-tag'));
  }
  for (const l of (g && g.lines) || []) {
    const [p, q] = l.points;
    out.push(svgEl('line', {class: 'count-line', x1: p[0] * scale[0], y1: p[1] * scale[1], x2: q[0] * scale[0],
      y2: q[1] * scale[1]}));
    const c = (found.tally && found.tally.lines[l.id]) || {};
    const sum = (side) => Object.values(c[side] || {}).reduce((a, b) => a + b, 0);
    out.push(label(p, `${l.id}: in ${sum('in')}, out ${sum('out')}`, 'line-tag'));
  }
  for (const points of (found.trails || new Map()).values()) {
    if (points.length > 1) out.push(svgEl('polyline', {class: 'trail', points: points.map(at).join(' ')}));
  }
  return out;
}

// A card's detector answer (item.found) shown: its boxes above the threshold listed and drawn; none for a classifier.
function showBoxes(item) {
  const card = item.card, found = item.found;
  drawBoxes(card.querySelector('svg.boxes'), found);
  if (!found) { card.querySelector('.found').textContent = ''; return; }
  const kept = keptBoxes(found.detections);
  card.querySelector('tbody').replaceChildren(...kept.map(detectionRow));
  card.querySelector('.found').textContent = `${kept.length} of ${found.detections.length} boxes at score ` +
    `${scoreThreshold().toFixed(2)} or more (image ${found.width} x ${found.height} pixels)`;
}

// The controls that fit the picked model: top-k for a classifier, the score threshold for a detector.
function taskControls() {
  const detector = isDetector();
  $('topk').hidden = $('topk-label').hidden = detector;
  $('score-control').hidden = !detector;
  $('grid').classList.toggle('detect', detector);
}

function thresholdChanged() {
  $('score-value').textContent = scoreThreshold().toFixed(2);
  for (const item of images) if (item.found) showBoxes(item);
  if (typeof liveBoxes === 'function') liveBoxes();
}

$('score').addEventListener('input', thresholdChanged);
$('model').addEventListener('change', taskControls);

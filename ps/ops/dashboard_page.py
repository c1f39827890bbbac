# ruff: noqa: E501 - the page's CSS and JS, not Python
"""The dashboard's one page (ps/ops/dashboard.py): inline CSS and JS, charts drawn on canvases by
the code below, no external asset (it works offline; the server's Content-Security-Policy
forbids loading anything else). It polls ``/api/state`` every second and redraws in place; the
latest state it drew is ``window.latecomerDash.state`` (the browser test reads it)."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>latecomer dashboard</title>
<style>
:root { --bg:#0f1419; --card:#171e26; --line:#263140; --text:#d7dde4; --dim:#8593a3; --accent:#5ab0ff;
        --ok:#3ecf8e; --lost:#ff5d5d; --failed:#ffab40; --other:#7d8796; --flight:#5ab0ff; }
* { box-sizing:border-box; }
body { margin:0; background:var(--bg); color:var(--text); font:13px/1.4 system-ui, -apple-system, "Segoe UI",
       Roboto, "DejaVu Sans", sans-serif; }
header { display:flex; flex-wrap:wrap; align-items:center; gap:10px 18px; padding:12px 18px;
         background:#121a22; border-bottom:1px solid var(--line); position:sticky; top:0; z-index:1; }
header h1 { font-size:16px; margin:0 8px 0 0; font-weight:600; letter-spacing:.3px; }
header h1 span { color:var(--accent); }
.run { font-weight:600; font-size:14px; }
.stat { display:flex; flex-direction:column; min-width:64px; }
.stat b { font-size:16px; font-variant-numeric:tabular-nums; }
.stat small { color:var(--dim); text-transform:uppercase; font-size:10px; letter-spacing:.6px; }
#live { margin-left:auto; padding:3px 10px; border-radius:10px; background:#1f3a2c; color:var(--ok);
        font-weight:600; font-size:12px; }
#live.finished { background:#2a2f38; color:var(--dim); } #live.down { background:#3a1f1f; color:var(--lost); }
main { display:grid; grid-template-columns:repeat(auto-fit, minmax(520px, 1fr)); gap:14px; padding:14px 18px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 12px 12px; min-width:0; }
.card.wide { grid-column:1 / -1; }
.card h2 { font-size:12px; margin:0 0 6px; color:var(--dim); text-transform:uppercase; letter-spacing:.7px;
           font-weight:600; display:flex; align-items:center; gap:8px; }
.card h2 .sp { flex:1; }
canvas { width:100%; height:220px; display:block; }
canvas.tall { height:auto; }
canvas.mini { height:130px; }
.minis { display:grid; grid-template-columns:repeat(auto-fit, minmax(200px, 1fr)); gap:8px; }
.minis div { font-size:11px; color:var(--dim); }
button { background:#222c38; color:var(--text); border:1px solid var(--line); border-radius:4px; font-size:11px;
         padding:1px 8px; cursor:pointer; } button.on { border-color:var(--accent); color:var(--accent); }
table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); white-space:nowrap; }
th { color:var(--dim); font-weight:600; font-size:11px; }
td.err { white-space:normal; color:var(--dim); max-width:420px; }
tr.lost td { background:rgba(255,93,93,.12); } tr.lost td.state { color:var(--lost); font-weight:700; }
tr.left td { color:var(--dim); } td.state.ok { color:var(--ok); } td.state.failing, td.state.benched { color:var(--failed); }
.legend { display:flex; gap:12px; font-size:11px; color:var(--dim); text-transform:none; letter-spacing:0; }
.legend i { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:4px; vertical-align:-1px; }
.empty { color:var(--dim); padding:30px 0; text-align:center; }
</style></head>
<body>
<header>
  <h1><span>latecomer</span> dashboard</h1>
  <div class="run" id="run">&ndash;</div>
  <div class="stat"><small>step</small><b id="step">0</b></div>
  <div class="stat"><small>steps/s</small><b id="rate">&ndash;</b></div>
  <div class="stat"><small>workers</small><b id="workers">0</b></div>
  <div class="stat"><small>elapsed</small><b id="elapsed">0 s</b></div>
  <div class="stat"><small>last loss</small><b id="loss">&ndash;</b></div>
  <div class="stat"><small>lost jobs</small><b id="lostjobs">0</b></div>
  <div id="live">connecting</div>
</header>
<main>
  <section class="card"><h2>Loss<span class="sp"></span><button id="xstep" class="on">step</button>
    <button id="xtime">time</button></h2><canvas id="c-loss"></canvas></section>
  <section class="card"><h2>Evaluation metrics</h2><canvas id="c-metrics"></canvas></section>
  <section class="card"><h2>Step rate (updates/s)</h2><canvas id="c-rate"></canvas></section>
  <section class="card"><h2>Ages of applied replies (steps)</h2><canvas id="c-ages"></canvas></section>
  <section class="card wide"><h2>Jobs per worker<span class="sp"></span><span class="legend">
    <span><i style="background:var(--ok)"></i>applied</span><span><i style="background:var(--lost)"></i>lost</span>
    <span><i style="background:var(--failed)"></i>failed</span><span><i style="background:var(--other)"></i>dropped /
    cancelled</span><span><i style="background:var(--flight)"></i>in flight</span></span></h2>
    <canvas id="c-timeline" class="tall"></canvas></section>
  <section class="card wide"><h2>Algorithm figures</h2><div class="minis" id="figs"></div></section>
  <section class="card wide"><h2>Workers</h2><div id="workers-table"></div></section>
  <section class="card wide" id="shards-card" style="display:none"><h2>Shards</h2><div id="shards-table"></div></section>
</main>
<script>
"use strict";
const D = window.latecomerDash = {state: null, updates: 0, drawn: 0, errors: 0, xaxis: "step"};
const PALETTE = ["#5ab0ff", "#3ecf8e", "#ffab40", "#c792ea", "#ff5d5d", "#4dd0e1", "#f06292", "#aed581"];
const css = n => getComputedStyle(document.documentElement).getPropertyValue(n).trim();
const $ = id => document.getElementById(id);

function fmt(v, d) {
  if (v === null || v === undefined || v === "") return "\u2013";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(d === undefined ? 2 : d);
  const p = d === undefined ? 4 : d, digits = a === 0 ? 1 : Math.floor(Math.log10(a)) + 1;
  if (digits >= p) return String(Math.round(v));
  const t = v.toFixed(Math.min(20, p - digits));
  return t.includes(".") ? t.replace(/\.?0+$/, "") : t;
}
function dur(s) {
  s = Math.max(0, Math.round(s || 0));
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60, r = s % 60;
  return h ? h + " h " + m + " min" : m ? m + " min " + r + " s" : r + " s";
}
function ticks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map(k => k * mag).find(s => s >= step0);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}
function setup(cv, height) {
  const dpr = window.devicePixelRatio || 1, w = cv.clientWidth, h = height || cv.clientHeight;
  if (height) cv.style.height = h + "px";
  if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) {
    cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
  }
  const g = cv.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  return {g, w, h};
}
function frame(g, w, h, xr, yr, xlabel, pad, ylab, nox) {
  const P = pad || {l: 54, r: 10, t: 8, b: 26};
  const X = v => P.l + (v - xr[0]) / (xr[1] - xr[0] || 1) * (w - P.l - P.r);
  const Y = v => h - P.b - (v - yr[0]) / (yr[1] - yr[0] || 1) * (h - P.t - P.b);
  g.strokeStyle = css("--line"); g.fillStyle = css("--dim"); g.lineWidth = 1;
  g.textAlign = "right"; g.textBaseline = "middle";
  for (const v of ticks(yr[0], yr[1], 4)) {
    if (v < yr[0] - 1e-12 || v > yr[1] + 1e-12) continue;
    g.beginPath(); g.moveTo(P.l, Y(v) + .5); g.lineTo(w - P.r, Y(v) + .5); g.stroke();
    g.fillText(ylab ? ylab(v) : fmt(v, 3), P.l - 6, Y(v));
  }
  g.textAlign = "center"; g.textBaseline = "top";
  for (const v of nox ? [] : ticks(xr[0], xr[1], Math.max(2, Math.floor((w - P.l) / 90)))) {
    if (v < xr[0] || v > xr[1] || (xlabel && X(v) > w - P.r - 44)) continue;
    g.fillText(fmt(v, 3), X(v), h - P.b + 6);
  }
  if (xlabel) { g.textAlign = "right"; g.fillText(xlabel, w - P.r, h - P.b + 6 + 0 * 12); }
  return {X, Y, P};
}
function range(vals, zero) {
  let lo = Infinity, hi = -Infinity;
  for (const v of vals) if (v !== null && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (lo === Infinity) return [0, 1];
  if (zero) lo = Math.min(lo, 0);
  if (hi === lo) { hi = lo + (Math.abs(lo) || 1) * 0.1; lo = lo - (Math.abs(lo) || 1) * 0.1; if (zero) lo = Math.min(lo, 0); }
  const m = (hi - lo) * 0.05;
  return [zero && lo >= 0 ? lo : lo - m, hi + m];
}
function lineChart(cv, series, xlabel, opts) {
  opts = opts || {};
  const {g, w, h} = setup(cv);
  const xs = [], ys = [];
  for (const s of series) for (const p of s.pts) { xs.push(p[0]); ys.push(p[1]); }
  const pos = ys.filter(v => v !== null && isFinite(v));
  if (opts.autolog && pos.length > 2 && pos.every(v => v > 0) && Math.max(...pos) / Math.min(...pos) > 50) {
    // a loss over decades reads better on a log scale: the points are log10'd, the labels not
    series = series.map(s => ({...s, pts: s.pts.map(p => [p[0], p[1] > 0 ? Math.log10(p[1]) : null])}));
    ys.length = 0; for (const s of series) for (const p of s.pts) ys.push(p[1]);
    opts = {...opts, ylab: v => fmt(Math.pow(10, v), 2), zero: false};
  }
  if (!xs.length) { g.fillStyle = css("--dim"); g.textAlign = "center"; g.fillText("no data yet", w / 2, h / 2); return; }
  const xr = range(xs), yr = range(ys, opts.zero);
  xr[0] = Math.max(xr[0], Math.min(...xs));
  const {X, Y} = frame(g, w, h, xr, yr, xlabel, opts.pad, opts.ylab);
  series.forEach((s, i) => {
    g.strokeStyle = s.color || PALETTE[i % PALETTE.length]; g.lineWidth = 1.8; g.beginPath();
    let on = false;
    for (const p of s.pts) {
      if (p[1] === null || !isFinite(p[1])) { on = false; continue; }
      on ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1])); on = true;
    }
    g.stroke();
    if (s.pts.length <= 60) {
      g.fillStyle = g.strokeStyle;
      for (const p of s.pts) if (p[1] !== null) { g.beginPath(); g.arc(X(p[0]), Y(p[1]), 2.2, 0, 7); g.fill(); }
    }
  });
  if (series.length > 1 || opts.legend) {
    g.textAlign = "left"; g.textBaseline = "top";
    let x = 62;
    series.forEach((s, i) => {
      g.fillStyle = s.color || PALETTE[i % PALETTE.length]; g.fillRect(x, 10, 10, 3);
      g.fillStyle = css("--text"); g.fillText(s.name, x + 14, 5); x += g.measureText(s.name).width + 30;
    });
  }
}
function agesChart(cv, bins) {
  const {g, w, h} = setup(cv);
  if (!bins.length) { g.fillStyle = css("--dim"); g.textAlign = "center"; g.fillText("no replies yet", w / 2, h / 2); return; }
  const top = Math.max(...bins.map(b => b[2]));
  const {Y, P} = frame(g, w, h, [0, 1], [0, top * 1.08 || 1], "", {l: 54, r: 10, t: 8, b: 26}, null, true);
  const bw = (w - P.l - P.r) / bins.length;
  g.fillStyle = css("--accent");
  bins.forEach((b, i) => { const y = Y(b[2]); g.fillRect(P.l + i * bw + 1, y, Math.max(1, bw - 2), h - P.b - y); });
  g.fillStyle = css("--dim"); g.textAlign = "center"; g.textBaseline = "top";
  const every = Math.ceil(bins.length / Math.max(1, Math.floor((w - P.l) / 34)));
  bins.forEach((b, i) => { if (i % every === 0) g.fillText(b[0] === b[1] ? b[0] : b[0] + "+", P.l + (i + .5) * bw, h - P.b + 6); });
}
const COLORS = {a: "--ok", l: "--lost", f: "--failed", d: "--other", c: "--other", r: "--other"};
function timeline(cv, tl, gone) {
  const names = Object.keys(tl.lanes).concat(Object.keys(tl.in_flight)).filter((v, i, a) => a.indexOf(v) === i).sort();
  const lane = 22, P = {l: 90, r: 10, t: 6, b: 24};
  const {g, w, h} = setup(cv, Math.max(80, P.t + P.b + lane * Math.max(1, names.length)));
  if (!names.length) { g.fillStyle = css("--dim"); g.textAlign = "center"; g.fillText("no jobs yet", w / 2, h / 2); return; }
  let t0 = tl.now;  // the oldest bar shown: every lane is complete from there (at most window_s ago)
  for (const n of names) for (const j of tl.lanes[n] || []) t0 = Math.min(t0, j[0]);
  for (const n of names) for (const a of tl.in_flight[n] || []) t0 = Math.min(t0, a);
  t0 = Math.max(t0, tl.since);
  const xr = [t0, Math.max(tl.now, t0 + 1e-3)];
  const X = v => P.l + (v - xr[0]) / (xr[1] - xr[0]) * (w - P.l - P.r);
  g.fillStyle = css("--dim"); g.textAlign = "center"; g.textBaseline = "top";
  for (const v of ticks(xr[0], xr[1], Math.max(2, Math.floor((w - P.l) / 90)))) if (v >= xr[0]) g.fillText(fmt(v, 4) + " s", X(v), h - P.b + 6);
  names.forEach((n, i) => {
    const y = P.t + i * lane, lost = gone[n] && gone[n].state === "lost";
    g.fillStyle = i % 2 ? "rgba(255,255,255,.02)" : "rgba(255,255,255,.045)"; g.fillRect(P.l, y, w - P.l - P.r, lane - 2);
    g.fillStyle = lost ? css("--lost") : css("--text"); g.textAlign = "right"; g.textBaseline = "middle";
    g.fillText((n.length > 12 ? n.slice(0, 11) + "\u2026" : n) + (lost ? " \u2716" : ""), P.l - 8, y + lane / 2 - 1);
    for (const j of tl.lanes[n] || []) {
      g.fillStyle = css(COLORS[j[2]] || "--other");
      const x0 = X(j[0]), x1 = Math.max(X(j[1]), x0 + 1.5);
      g.fillRect(x0, y + 3, Math.max(1.5, x1 - x0 - 0.6), lane - 8);
    }
    g.strokeStyle = css("--flight"); g.lineWidth = 1.2;
    for (let a of tl.in_flight[n] || []) a = Math.max(a, t0), g.strokeRect(X(a) + .5, y + 3.5, Math.max(2, X(tl.now) - X(a) - 1), lane - 9);
  });
}
function table(el, columns, rows, rowClass) {
  if (!rows.length) { el.innerHTML = '<div class="empty">none</div>'; return; }
  const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
  let html = "<table><thead><tr>" + columns.map(c => "<th>" + esc(c) + "</th>").join("") + "</tr></thead><tbody>";
  for (const r of rows) {
    const cls = rowClass ? rowClass(r) : "";
    html += '<tr class="' + cls + '" data-worker="' + esc(r[0]) + '">' + r.map((v, i) => {
      const c = columns[i], k = c === "state" ? "state " + esc(v || "") : c === "last_error" ? "err" : "";
      return '<td class="' + k + '">' + esc(typeof v === "number" ? fmt(v) : (v === null ? "\u2013" : v)) + "</td>";
    }).join("") + "</tr>";
  }
  el.innerHTML = html + "</tbody></table>";
}
function figures(el, figs) {
  const names = Object.keys(figs).sort();
  if (!names.length) { el.innerHTML = '<div class="empty">this algorithm reports no figures</div>'; return; }
  if (el.dataset.names !== names.join(",")) {
    el.dataset.names = names.join(",");
    el.innerHTML = names.map((n, i) => '<div><span>' + n + ' <b id="fv-' + i + '"></b></span><canvas class="mini" id="fig-' + i + '"></canvas></div>').join("");
  }
  names.forEach((n, i) => {
    const pts = figs[n].map(p => [D.xaxis === "time" ? p[0] : p[1], p[2]]);
    lineChart($("fig-" + i), [{name: n, pts, color: PALETTE[(i + 2) % PALETTE.length]}], "", {pad: {l: 48, r: 8, t: 6, b: 22}});
    $("fv-" + i).textContent = pts.length ? fmt(pts[pts.length - 1][1]) : "";
  });
}
function draw(s) {
  const hd = s.header, xkey = D.xaxis === "time" ? "t" : "version";
  $("run").textContent = (hd.algorithm || "?") + " on " + (hd.problem || "?");
  $("step").textContent = hd.step; $("rate").textContent = fmt(hd.rate, 3); $("workers").textContent = hd.workers;
  $("elapsed").textContent = dur(hd.elapsed_s); $("loss").textContent = fmt(hd.loss);
  $("lostjobs").textContent = s.info["counter.lost"] !== undefined ? s.info["counter.lost"] : "\u2013";
  const live = $("live");
  live.textContent = hd.finished ? "finished" : "live"; live.className = hd.finished ? "finished" : "";
  const evs = s.evaluations, keys = evs.length ? Object.keys(evs[0]).filter(k => k !== "t" && k !== "version") : [];
  lineChart($("c-loss"), [{name: "loss", pts: evs.map(e => [e[xkey], e.loss])}], D.xaxis === "time" ? "s" : "step", {autolog: true});
  const others = keys.filter(k => k !== "loss");
  lineChart($("c-metrics"), others.map((k, i) => ({name: k, pts: evs.map(e => [e[xkey], e[k]]), color: PALETTE[(i + 1) % PALETTE.length]})),
            D.xaxis === "time" ? "s" : "step", {legend: true, autolog: others.length === 1});
  lineChart($("c-rate"), [{name: "steps/s", pts: s.rate.map(p => [p[0], p[2]]), color: PALETTE[1]}], "s", {zero: true});
  agesChart($("c-ages"), s.ages);
  timeline($("c-timeline"), s.timeline, s.workers.gone);
  figures($("figs"), s.figures);
  const si = s.workers.columns.indexOf("state");
  table($("workers-table"), s.workers.columns, s.workers.rows, r => si >= 0 && (r[si] === "lost" || r[si] === "left") ? r[si] : "");
  $("shards-card").style.display = s.shards.length ? "" : "none";
  if (s.shards.length) { const cols = Object.keys(s.shards[0]); table($("shards-table"), cols, s.shards.map(r => cols.map(c => r[c]))); }
}
async function poll() {
  let s = null;
  try {
    const r = await fetch("/api/state", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    s = await r.json();
  } catch (e) {
    D.errors += 1;
    const live = $("live"); live.textContent = "disconnected"; live.className = "down";
  }
  if (s) {
    D.state = s; D.updates += 1;
    try { draw(s); D.drawn = D.updates; } catch (e) { console.error("dashboard: drawing failed: " + e); }
  }
  setTimeout(poll, 1000);
}
for (const [id, x] of [["xstep", "step"], ["xtime", "time"]]) {
  $(id).addEventListener("click", () => { D.xaxis = x; $("xstep").className = x === "step" ? "on" : ""; $("xtime").className = x === "time" ? "on" : ""; if (D.state) draw(D.state); });
}
window.addEventListener("resize", () => { if (D.state) draw(D.state); });
poll();
</script>
</body></html>
"""

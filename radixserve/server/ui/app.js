/* radixserve cache view: the radix tree (GET /cache/tree), live counters (GET /cache/events,
 * server-sent events read with fetch so the API key can travel in a header) and a chat box
 * (POST /v1/chat/completions). Uses the vendored d3-hierarchy (layout) and uPlot (charts).
 * Data from the server is only ever put in the page as text (textContent), never as HTML. */
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const meta = (name) => (document.querySelector(`meta[name="${name}"]`) || {}).content || "";
  const SVG = "http://www.w3.org/2000/svg";

  const AUTH_REQUIRED = meta("radixserve-auth") === "required";
  const MODEL = meta("radixserve-model");
  const KEY_STORAGE = "radixserve-api-key";      // sessionStorage: this tab only
  const EVENTS_INTERVAL_S = 1;
  const MAX_POINTS = 600;                        // ten minutes at one snapshot a second
  const TREE_MIN_GAP_MS = 1500;                  // at most one tree fetch this often

  // Read-only state, also what tests and curious people inspect from the console.
  const ui = (window.radixUI = { snapshots: [], series: null, tree: null, treeFetches: 0, chats: [] });

  // ------------------------------------------------------------------ formatting
  function fmt(n) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return Number.isInteger(n) ? String(n) : n.toFixed(1);
  }
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const visible = (text) => text.replace(/\n/g, "⏎").replace(/\t/g, "→");

  // ------------------------------------------------------------------ API key
  class Unauthorized extends Error {}
  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";

  async function api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    if (apiKey()) headers.Authorization = "Bearer " + apiKey();
    const res = await fetch(path, Object.assign({}, options, { headers }));
    if (res.status === 401) {
      sessionStorage.removeItem(KEY_STORAGE);
      askForKey("That key was refused. Try again.");
      throw new Unauthorized("unauthorized");
    }
    return res;
  }

  function askForKey(message) {
    stopEvents();
    $("key-error").textContent = message || "";
    $("key-overlay").hidden = false;
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("key-input").value = "";
    $("key-overlay").hidden = true;
    begin();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    askForKey("");
  });

  // ------------------------------------------------------------------ status
  function setStatus(state, text) {
    $("status").dataset.state = state;
    $("status-text").textContent = text || state;
  }

  // ------------------------------------------------------------------ events (SSE over fetch)
  let eventsController = null;

  function stopEvents() {
    if (eventsController) eventsController.abort();
    eventsController = null;
  }

  async function streamEvents() {
    stopEvents();
    const controller = (eventsController = new AbortController());
    setStatus("connecting");
    try {
      const res = await api(`/cache/events?interval=${EVENTS_INTERVAL_S}`, { signal: controller.signal });
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      setStatus("live");
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).trimStart()).join("\n");
          if (data) onSnapshot(JSON.parse(data));
        }
      }
    } catch (err) {
      if (err instanceof Unauthorized || controller.signal.aborted) return;
    }
    if (controller.signal.aborted) return;
    setStatus("down", "reconnecting");
    setTimeout(() => { if (eventsController === controller) streamEvents(); }, 2000);
  }

  function onSnapshot(s) {
    ui.snapshots.push(s);
    if (ui.snapshots.length > MAX_POINTS) ui.snapshots.shift();
    updateKpis(s);
    updateCharts();
    maybeRefreshTree(s);
  }

  // ------------------------------------------------------------------ KPIs
  function updateKpis(s) {
    const pc = s.prefix_cache, pool = s.pool, c = s.cache, r = s.requests;
    $("kpi-hit").textContent = pct(pc.hit_rate);
    const back = ui.snapshots[Math.max(0, ui.snapshots.length - 11)];
    const dq = pc.query_tokens - back.prefix_cache.query_tokens;
    const dh = pc.hit_tokens - back.prefix_cache.hit_tokens;
    $("kpi-hit-note").textContent = `${fmt(pc.hit_tokens)} / ${fmt(pc.query_tokens)} tokens` +
      (dq > 0 ? ` · 10 s: ${pct(dh / dq)}` : "");
    $("kpi-cached").textContent = fmt(c.cached_tokens);
    $("kpi-cached-note").textContent = `${fmt(c.evictable_tokens)} evictable · ${fmt(c.locked_tokens)} locked`;
    $("kpi-nodes").textContent = fmt(c.nodes);
    $("kpi-nodes-note").textContent = `page size ${pool.page_size}`;
    $("kpi-pool").textContent = pct(pool.usage);
    $("kpi-pool-note").textContent = `${fmt(pool.pages_free)} of ${fmt(pool.pages_total)} pages free`;
    $("kpi-reqs").textContent = `${r.running} · ${r.waiting}`;
    $("kpi-reqs-note").textContent = `${fmt(s.engine.requests_finished)} finished · ${r.preemptions} preempted`;
    $("kpi-evicted").textContent = fmt(pc.evicted_tokens);
    $("kpi-evicted-note").textContent = "tokens since start";
  }

  // ------------------------------------------------------------------ charts (uPlot)
  const CHARTS = [
    { id: "hit", title: "Token hit rate (%)", range: [0, 100], series: [
      { label: "since start", stroke: "#2563eb", width: 2 },
      { label: "per interval", stroke: "#60a5fa", width: 0, paths: () => null,
        points: { show: true, size: 5, fill: "#93c5fd" } }] },
    { id: "tokens", title: "Prompt tokens / s", series: [
      { label: "computed", stroke: "#f97316", width: 2, fill: "rgba(249,115,22,.10)" },
      { label: "from cache", stroke: "#16a34a", width: 2, fill: "rgba(22,163,74,.10)" }] },
    { id: "pool", title: "KV pool (pages)", series: [
      { label: "free", stroke: "#9ca3af", width: 1.5 },
      { label: "cached", stroke: "#2563eb", width: 2 },
      { label: "locked", stroke: "#dc2626", width: 1.5 },
      { label: "private", stroke: "#a855f7", width: 1.5 }] },
    { id: "requests", title: "Requests", counts: true, series: [
      { label: "running", stroke: "#0891b2", width: 2 },
      { label: "waiting", stroke: "#d97706", width: 2 }] },
    { id: "generated", title: "Generated tokens / s", series: [
      { label: "generated", stroke: "#4f46e5", width: 2, fill: "rgba(79,70,229,.10)" }] },
    { id: "evicted", title: "Evicted tokens / s", series: [
      { label: "evicted", stroke: "#dc2626", width: 2, fill: "rgba(220,38,38,.10)" }] },
  ];
  const charts = {};

  function rate(now, before, dt) {
    return before === null || !(dt > 0) ? null : (now - before) / dt;
  }

  /** Chart columns from the snapshots: counters become rates per second or per interval. */
  function seriesData() {
    const cols = { x: [], hit: [[], []], tokens: [[], []], pool: [[], [], [], []],
                   requests: [[], []], generated: [[]], evicted: [[]] };
    let prev = null;
    for (const s of ui.snapshots) {
      const dt = prev ? s.time - prev.time : null;
      const pc = s.prefix_cache, pp = prev ? prev.prefix_cache : null;
      const dq = pp ? pc.query_tokens - pp.query_tokens : 0;
      const dh = pp ? pc.hit_tokens - pp.hit_tokens : 0;
      cols.x.push(s.time);
      cols.hit[0].push(100 * pc.hit_rate);
      cols.hit[1].push(dq > 0 ? (100 * dh) / dq : null);
      cols.tokens[0].push(pp ? rate(pc.query_tokens - pc.hit_tokens, pp.query_tokens - pp.hit_tokens, dt) : null);
      cols.tokens[1].push(pp ? rate(pc.hit_tokens, pp.hit_tokens, dt) : null);
      const pool = s.pool;
      cols.pool[0].push(pool.pages_free);
      cols.pool[1].push(pool.pages_cached);
      cols.pool[2].push(pool.pages_locked);
      cols.pool[3].push(pool.pages_private);
      cols.requests[0].push(s.requests.running);
      cols.requests[1].push(s.requests.waiting);
      cols.generated[0].push(prev ? rate(s.engine.generation_tokens, prev.engine.generation_tokens, dt) : null);
      cols.evicted[0].push(pp ? rate(pc.evicted_tokens, pp.evicted_tokens, dt) : null);
      prev = s;
    }
    return cols;
  }

  const AXIS = { stroke: "#6b7280", font: "11px system-ui, sans-serif",
                 grid: { stroke: "#eef0f3", width: 1 }, ticks: { stroke: "#e3e6eb", width: 1 } };
  const pad2 = (n) => String(n).padStart(2, "0");
  function clock(t) {
    const d = new Date(t * 1000);
    return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  }

  function chartWidth(el) { return Math.max(240, el.clientWidth); }

  function makeCharts() {
    const host = $("charts");
    for (const def of CHARTS) {
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.chart = def.id;
      const title = document.createElement("h3");
      title.textContent = def.title;
      box.appendChild(title);
      host.appendChild(box);
      const opts = {
        width: chartWidth(box), height: 150,
        legend: { live: false },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: def.range ? { range: def.range } : { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
        axes: [
          Object.assign({ values: (u, splits) => splits.map(clock), space: 70 }, AXIS),
          Object.assign({ values: (u, splits) => splits.map(fmt), size: 44 },
                        def.counts ? { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] } : {}, AXIS),
        ],
        series: [{ value: (u, t) => (t === null ? "–" : clock(t)) }].concat(
          def.series.map((s) => Object.assign({ points: { show: false } }, s))),
      };
      const empty = [[]].concat(def.series.map(() => []));
      charts[def.id] = new uPlot(opts, empty, box);
    }
    new ResizeObserver(() => {
      for (const def of CHARTS) {
        const box = host.querySelector(`[data-chart="${def.id}"]`);
        charts[def.id].setSize({ width: chartWidth(box), height: 150 });
      }
    }).observe(host);
  }

  function updateCharts() {
    const cols = (ui.series = seriesData());
    for (const def of CHARTS) charts[def.id].setData([cols.x].concat(cols[def.id]));
    const n = ui.snapshots.length;
    $("series-note").textContent = n ? `${n} snapshot${n === 1 ? "" : "s"}, one every ${EVENTS_INTERVAL_S} s` : "";
  }

  // ------------------------------------------------------------------ tree
  const knownNamespaces = new Set();
  let treeSignature = "", treeFetchedAt = 0, treeInFlight = false, treeTimer = null;

  function signature(s) {
    const c = s.cache, pc = s.prefix_cache;
    return [c.nodes, c.cached_tokens, c.locked_tokens, pc.hit_tokens, pc.query_tokens, pc.evicted_tokens].join("/");
  }

  function maybeRefreshTree(s) {
    const sig = signature(s);
    if (sig === treeSignature && ui.tree) return;
    const wait = TREE_MIN_GAP_MS - (Date.now() - treeFetchedAt);
    if (wait > 0) {
      if (!treeTimer) treeTimer = setTimeout(() => { treeTimer = null; refreshTree(sig); }, wait);
      return;
    }
    refreshTree(sig);
  }

  async function refreshTree(sig) {
    if (treeInFlight) return;
    treeInFlight = true;
    treeFetchedAt = Date.now();
    try {
      const params = new URLSearchParams({ limit: $("limit").value });
      if ($("namespace").value) params.set("namespace", $("namespace").value);
      const res = await api("/cache/tree?" + params);
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      const tree = await res.json();
      if (sig !== undefined) treeSignature = sig;
      ui.tree = tree;
      ui.treeFetches += 1;
      renderTree(tree);
    } catch (err) {
      if (!(err instanceof Unauthorized)) $("tree-note").textContent = "could not load the tree: " + err.message;
    } finally {
      treeInFlight = false;
    }
  }

  const RAMP = ["#e4edf7", "#a9cce3", "#fdd9a0", "#fb9a5a", "#e04a2a", "#9e1b1b"];

  function rampColour(t) {
    t = Math.max(0, Math.min(1, t));
    const pos = t * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(pos)), f = pos - i;
    const a = hexRgb(RAMP[i]), b = hexRgb(RAMP[i + 1]);
    return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(",")})`;
  }
  function hexRgb(hex) { return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)); }
  function darkFill(colour) {
    const [r, g, b] = colour.match(/\d+/g).map(Number);
    return 0.299 * r + 0.587 * g + 0.114 * b < 140;
  }

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function renderLegend(colourBy) {
    const legend = $("legend");
    legend.textContent = "";
    const item = (build) => { const span = document.createElement("span"); build(span); legend.appendChild(span); };
    item((s) => {
      s.append(colourBy === "hits" ? "fewer hits" : "older");
      const ramp = document.createElement("span");
      ramp.className = "ramp";
      ramp.style.background = `linear-gradient(90deg, ${RAMP.join(",")})`;
      s.appendChild(ramp);
      s.append(colourBy === "hits" ? "more hits" : "recently used");
    });
    const swatch = (s, style, label) => {
      const b = document.createElement("span");
      b.className = "swatch";
      Object.assign(b.style, style);
      s.appendChild(b);
      s.append(label);
    };
    item((s) => swatch(s, { background: "repeating-linear-gradient(45deg,#e4edf7 0 3px,#6b7280 3px 5px)", border: "1.5px solid #111827" }, "locked (in use)"));
    item((s) => swatch(s, { background: "#e4edf7", border: "1.5px dashed #4b5563" }, "evictable leaf"));
    item((s) => swatch(s, { background: "#eceff3", border: "1px solid #c7ced8" }, "folded smaller prefixes"));
    item((s) => s.append("height ∝ tokens cached at or below a node; left to right: deeper prefixes"));
  }

  function nodeLabel(d) {
    const e = d.data;
    if (e.kind === "root") return "cache";
    if (e.kind === "namespace") return `namespace ${e.namespace}`;
    if (e.kind === "other") return `+${fmt(e.subtree_nodes)} smaller`;
    const name = e.text !== undefined ? `“${visible(e.text)}”` : `#${e.hash}`;
    return `${name} · ${fmt(e.subtree_tokens)} tok`;
  }

  function renderTree(tree) {
    const host = $("tree");
    const colourBy = $("colour").value;
    renderLegend(colourBy);
    for (const e of tree.nodes) if (e.kind === "namespace" && !tree.namespace) knownNamespaces.add(e.namespace);
    syncNamespaceOptions();
    host.textContent = "";
    const W = host.clientWidth, H = host.clientHeight;
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "radix tree icicle" }, host);
    const defs = el("defs", {}, svg);
    const pattern = el("pattern", { id: "locked-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, defs);
    el("rect", { width: 2, height: 6, fill: "rgba(17,24,39,0.35)" }, pattern);

    const note = $("tree-note");
    if (!tree.nodes.length || tree.nodes[0].subtree_tokens === 0) {
      const t = el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg);
      t.textContent = "The cache is empty: send a prompt (the chat box on the right) and watch it land here.";
      note.textContent = "";
      return;
    }
    const root = d3.stratify().id((d) => d.id).parentId((d) => d.parent)(tree.nodes);
    root.sum((d) => (d.kind === "node" ? d.edge_tokens : d.kind === "other" ? d.subtree_tokens : 0));
    root.sort((a, b) => b.value - a.value);
    d3.partition().size([H, 1])(root);
    // fixed narrow columns for the root and the namespaces; the prefixes share the rest
    const rootW = 26, nsW = Math.min(150, W / 6);
    const colW = root.height > 1 ? (W - rootW - nsW) / (root.height - 1) : W - rootW - nsW;
    const left = (d) => (d.depth === 0 ? 0 : d.depth === 1 ? rootW : rootW + nsW + (d.depth - 2) * colW);
    const width = (d) => (d.depth === 0 ? rootW : d.depth === 1 ? nsW : colW);

    const nodes = tree.nodes.filter((e) => e.kind === "node");
    const maxHits = Math.max(1, ...nodes.map((e) => e.hits));
    const maxIdle = Math.max(1, ...nodes.map((e) => e.idle));
    const fill = (e) => {
      if (e.kind === "root") return "#374151";
      if (e.kind === "namespace") return "#cfd8e3";
      if (e.kind === "other") return "#eceff3";
      const t = colourBy === "hits" ? Math.log1p(e.hits) / Math.log1p(maxHits)
        : 1 - Math.log1p(e.idle) / Math.log1p(maxIdle);
      return rampColour(t);
    };

    for (const d of root.descendants()) {
      const e = d.data, x = left(d), y = d.x0, w = width(d), h = d.x1 - d.x0;
      if (h < 0.5) continue;
      const g = el("g", { transform: `translate(${x},${y})` }, svg);
      const colour = fill(e);
      const rect = el("rect", {
        width: Math.max(0, w - 1), height: Math.max(0.5, h - 1), fill: colour, rx: 2,
        "data-id": e.id, "data-kind": e.kind, "data-depth": d.depth,
        stroke: e.locked ? "#111827" : e.evictable ? "#4b5563" : e.kind === "other" ? "#c7ced8" : "#ffffff",
        "stroke-width": e.locked ? 1.5 : 1,
      }, g);
      if (e.evictable && !e.locked) rect.setAttribute("stroke-dasharray", "4 2");
      if (e.locked) el("rect", { width: Math.max(0, w - 1), height: Math.max(0.5, h - 1), fill: "url(#locked-hatch)", "pointer-events": "none" }, g);
      if (e.pinned) el("rect", { width: 3, height: Math.max(0.5, h - 1), fill: "#7c3aed", "pointer-events": "none" }, g);
      rect.addEventListener("mousemove", (ev) => showTooltip(ev, d, tree));
      rect.addEventListener("mouseleave", hideTooltip);
      if (e.kind === "root") {
        if (h > 40) {
          const t = el("text", { transform: `translate(${w / 2 + 4},${h / 2}) rotate(-90)`, "text-anchor": "middle", fill: "#f9fafb" }, g);
          t.textContent = `cache · ${fmt(e.subtree_tokens)} tok`;
        }
        continue;
      }
      if (h >= 12 && w >= 40) {
        const maxChars = Math.floor((w - 10) / 6.7);
        let label = nodeLabel(d) + (e.tier ? ` [${e.tier}]` : "");
        if (label.length > maxChars) label = label.slice(0, Math.max(1, maxChars - 1)) + "…";
        const t = el("text", { x: 5, y: Math.min(h / 2, 14) + 4, fill: darkFill(colour) ? "#ffffff" : "#1f2430" }, g);
        t.textContent = label;
      }
    }
    const folded = tree.folded_nodes;
    note.textContent = `${tree.shown_nodes} of ${tree.num_nodes} nodes shown` +
      (folded ? ` (${folded} smaller ones folded into “+N smaller”)` : "") +
      ` · ${tree.num_namespaces} namespace${tree.num_namespaces === 1 ? "" : "s"} · eviction ${tree.policy}` +
      ` · page size ${tree.page_size} · ` +
      (tree.show_text ? "text shown for your own namespace" : "token text hidden: prefixes are named by hash (start the server with --ui-show-text to see your own)");
  }

  function syncNamespaceOptions() {
    const select = $("namespace");
    const have = new Set(Array.from(select.options).map((o) => o.value));
    for (const ns of knownNamespaces) {
      if (have.has(ns)) continue;
      const opt = document.createElement("option");
      opt.value = ns;
      opt.textContent = ns.length > 28 ? ns.slice(0, 27) + "…" : ns;
      select.appendChild(opt);
    }
  }

  // ------------------------------------------------------------------ tooltip
  function showTooltip(ev, d, tree) {
    const e = d.data, tip = $("tooltip");
    tip.textContent = "";
    const line = (cls, text) => { const div = document.createElement("div"); div.className = cls; div.textContent = text; tip.appendChild(div); };
    const row = (k, v) => {
      const div = document.createElement("div");
      div.className = "t-row";
      const a = document.createElement("span"), b = document.createElement("span");
      a.textContent = k; b.textContent = v;
      div.append(a, b);
      tip.appendChild(div);
    };
    if (e.kind === "node") {
      line("t-title", `prefix #${e.hash}`);
      row("namespace", e.namespace);
      row("edge", `${e.edge_tokens} tokens (prefix ${e.prefix_tokens})`);
      row("at or below", `${fmt(e.subtree_tokens)} tokens in ${e.subtree_nodes} node${e.subtree_nodes === 1 ? "" : "s"}`);
      row("hits", String(e.hits));
      row("last use", e.idle === 0 ? "the latest cache operation" : `${fmt(e.idle)} cache operations ago`);
      row("state", e.locked ? "locked: a running request uses it" : e.evictable ? "evictable leaf" : "inner node (evicted after its children)");
      if (e.pinned) row("pinned", "yes");
      if (e.tier) row("tier", e.tier);
      if (e.text !== undefined) line("t-text", visible(e.text) + (e.edge_tokens > e.token_ids.length ? " …" : ""));
    } else if (e.kind === "namespace") {
      line("t-title", `namespace ${e.namespace}`);
      row("cached", `${fmt(e.subtree_tokens)} tokens in ${e.subtree_nodes} nodes`);
    } else if (e.kind === "other") {
      line("t-title", "smaller prefixes, folded");
      row("cached", `${fmt(e.subtree_tokens)} tokens in ${e.subtree_nodes} nodes`);
    } else {
      line("t-title", "the whole cache");
      row("cached", `${fmt(e.subtree_tokens)} tokens in ${fmt(e.subtree_nodes)} nodes`);
      row("clock", String(tree.clock));
    }
    tip.hidden = false;
    // above-right of the pointer; left of it near the right edge, below it near the top
    const pad = 14, r = tip.getBoundingClientRect();
    const x = ev.clientX + pad + r.width > window.innerWidth ? ev.clientX - pad - r.width : ev.clientX + pad;
    const above = ev.clientY - pad - r.height;
    const y = above >= 4 ? above : Math.min(ev.clientY + pad, window.innerHeight - r.height - 4);
    tip.style.left = `${Math.max(4, x)}px`;
    tip.style.top = `${Math.max(4, y)}px`;
  }
  function hideTooltip() { $("tooltip").hidden = true; }

  for (const id of ["limit", "namespace"]) $(id).addEventListener("change", () => refreshTree());
  $("colour").addEventListener("change", () => { if (ui.tree) renderTree(ui.tree); });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (ui.tree) renderTree(ui.tree); }, 150);
  });

  // ------------------------------------------------------------------ chat
  const turns = [];          // the conversation after the system prompt

  function addMessage(role, text, metaText, hit) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    if (metaText) {
      const m = document.createElement("span");
      m.className = "meta";
      if (hit) { const h = document.createElement("span"); h.className = "hit"; h.textContent = hit; m.append(h, " · "); }
      m.append(metaText);
      div.appendChild(m);
    }
    $("chat-log").appendChild(div);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return div;
  }

  $("chat-reset").addEventListener("click", () => {
    if (!turns.length) return;
    turns.length = 0;
    const divider = document.createElement("div");
    divider.className = "divider";
    divider.textContent = "new conversation, same system prompt";
    $("chat-log").appendChild(divider);
    $("chat-input").focus();
  });

  $("chat-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text) return;
    const system = $("chat-system").value.trim();
    turns.push({ role: "user", content: text });
    addMessage("user", text);
    $("chat-input").value = "";
    $("chat-send").disabled = true;
    try {
      const messages = (system ? [{ role: "system", content: system }] : []).concat(turns);
      const res = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model: MODEL, messages, max_tokens: 80 }),
      });
      const body = await res.json();
      if (!res.ok) throw new Error(body.error ? body.error.message : `HTTP ${res.status}`);
      const reply = body.choices[0].message.content;
      const usage = body.usage;
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      turns.push({ role: "assistant", content: reply });
      const share = usage.prompt_tokens ? ` (${Math.round((100 * cached) / usage.prompt_tokens)}%)` : "";
      const div = addMessage("assistant", reply,
        `${usage.prompt_tokens} prompt tokens · ${usage.completion_tokens} generated`,
        `${cached} cached${share}`);
      div.dataset.cachedTokens = String(cached);
      ui.chats.push({ prompt_tokens: usage.prompt_tokens, cached_tokens: cached, completion_tokens: usage.completion_tokens });
      refreshTree();
    } catch (err) {
      turns.pop();
      if (!(err instanceof Unauthorized)) addMessage("error", "request failed: " + err.message);
    } finally {
      $("chat-send").disabled = false;
    }
  });

  // ------------------------------------------------------------------ start
  function begin() {
    $("forget-key").hidden = !AUTH_REQUIRED;
    streamEvents();
    refreshTree();
  }

  $("model").textContent = MODEL;
  makeCharts();
  renderLegend($("colour").value);
  if (AUTH_REQUIRED && !apiKey()) askForKey("");
  else begin();
})();

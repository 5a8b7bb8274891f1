/* lab's dashboard: the pages of lab serve's web UI, drawn from /api/v1/dashboard.
 *
 * Every value from the store goes into the page through textContent or an attribute set
 * with setAttribute (never innerHTML), so a name, config or prediction that holds markup
 * shows as text. No framework, no build step: uPlot (static/vendor) draws the charts. */
'use strict';

(function () {
  const API = '/api/v1/dashboard';
  const POLL_MS = 4000;
  const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf',
    '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22'];
  const PRUNED_GREY = '#9aa0a6';
  const STATUSES = new Set(['running', 'completed', 'failed', 'crashed', 'stopped', 'pruned',
    'superseded', 'pending', 'interrupted']);
  const body = document.body;
  const main = document.getElementById('main');

  // -- DOM ------------------------------------------------------------------------------

  /** An element: props set as properties (text, className, on*) or attributes; children
   * are nodes or text (strings and numbers become text nodes, null is skipped). */
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === 'text') node.textContent = String(value);
      else if (key === 'class') node.className = value;
      else if (key === 'dataset') Object.assign(node.dataset, value);
      else if (key === 'style') node.style.cssText = value;  // CSSOM: allowed by the CSP
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else if (value === true) node.setAttribute(key, '');
      else node.setAttribute(key, String(value));
    }
    append(node, children);
    return node;
  }

  function append(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  }

  function section(id, title, ...children) {
    return el('section', { id, class: 'card' }, title ? el('h2', { text: title }) : null,
      ...children);
  }

  function crumbs(...parts) {
    const nav = clear(document.getElementById('crumbs'));
    for (const part of parts) {
      nav.append(el('span', { class: 'sep', text: '/' }));
      nav.append(typeof part === 'string' ? el('span', { text: part }) : part);
    }
  }

  // -- values ---------------------------------------------------------------------------

  /** A number from the API's JSON: NaN and ±inf travel as strings, missing as null. */
  function num(v) {
    if (typeof v === 'number') return v;
    if (v === 'NaN') return NaN;
    if (v === 'Infinity') return Infinity;
    if (v === '-Infinity') return -Infinity;
    return null;
  }

  /** A number for people: four significant digits, integers whole. */
  function fmt(v) {
    const x = num(v);
    if (x === null) return v === null || v === undefined ? '–' : String(v);
    if (Number.isNaN(x)) return 'NaN';
    if (!Number.isFinite(x)) return x > 0 ? '∞' : '−∞';
    if (Number.isInteger(x) && Math.abs(x) < 1e15) return String(x);
    const a = Math.abs(x);
    if (a !== 0 && (a < 1e-4 || a >= 1e6)) return x.toExponential(3);
    return String(Number(x.toPrecision(4)));
  }

  function value(v) {
    if (v === null || v === undefined) return '–';
    if (typeof v === 'number' || v === 'NaN' || v === 'Infinity' || v === '-Infinity') {
      return fmt(v);
    }
    if (typeof v === 'string') return v;
    return JSON.stringify(v);
  }

  function when(iso) {
    if (!iso) return '–';
    return String(iso).replace('T', ' ').slice(0, 19);
  }

  function duration(s) {
    const x = num(s);
    if (x === null || !Number.isFinite(x)) return '–';
    if (x < 60) return `${x.toFixed(x < 10 ? 1 : 0)} s`;
    if (x < 3600) return `${Math.floor(x / 60)} min ${Math.round(x % 60)} s`;
    if (x < 86400) return `${Math.floor(x / 3600)} h ${Math.round((x % 3600) / 60)} min`;
    return `${Math.floor(x / 86400)} d ${Math.round((x % 86400) / 3600)} h`;
  }

  function badge(status) {
    const known = STATUSES.has(status) ? status : 'other';
    return el('span', { class: `status status-${known}`, text: status || '–' });
  }

  function cell(v, props) {
    const td = el('td', Object.assign({ text: value(v) }, props || {}));
    if (typeof v === 'number' || typeof v === 'string' || v === null) {
      td.dataset.value = JSON.stringify(v);
    }
    if (num(v) !== null) td.className = (td.className + ' num').trim();
    return td;
  }

  const enc = encodeURIComponent;
  const expUrl = (name) => `/experiments/${enc(name)}`;
  const runUrl = (id) => `/runs/${enc(id)}`;

  function flatten(obj, prefix, out) {
    out = out || {};
    if (obj && typeof obj === 'object' && !Array.isArray(obj)) {
      for (const [k, v] of Object.entries(obj)) {
        const key = prefix ? `${prefix}.${k}` : k;
        if (v && typeof v === 'object' && !Array.isArray(v) && Object.keys(v).length) {
          flatten(v, key, out);
        } else {
          out[key] = v;
        }
      }
    }
    return out;
  }

  // -- the API --------------------------------------------------------------------------

  class NotFound extends Error {}
  class NeedToken extends Error {}

  async function api(path) {
    const answer = await fetch(path, {
      credentials: 'same-origin', headers: { Accept: 'application/json' },
    });
    if (answer.ok) return answer.json();
    let detail = `${answer.status} ${answer.statusText}`;
    try {
      const data = await answer.json();
      if (data && typeof data.detail === 'string') detail = data.detail;
    } catch (_err) { /* not JSON: the status line says it */ }
    if (answer.status === 401) throw new NeedToken(detail);
    if (answer.status === 404) throw new NotFound(detail);
    throw new Error(detail);
  }

  function failed(err) {
    if (err instanceof NeedToken) { tokenPrompt(err.message); return; }
    if (err instanceof NotFound) { notFound(err.message); return; }
    clear(main).append(el('section', { class: 'card error-box', id: 'page-error' },
      el('h1', { text: 'Something went wrong' }), el('p', { text: err.message || String(err) }),
      el('p', {}, el('a', { href: '/', text: 'Back to the experiments' }))));
  }

  function notFound(detail) {
    document.title = 'Not found · lab';
    clear(main).append(el('section', { class: 'notfound' },
      el('h1', { text: 'Not found' }), el('p', { id: 'notfound-detail', text: detail }),
      el('p', {}, el('a', { id: 'back', href: '/', text: 'Back to the experiments' }))));
  }

  /** The read-token prompt: the token goes to /ui/token, which keeps it in an HttpOnly
   * session cookie; the page reloads and never holds it again. */
  function tokenPrompt(why) {
    document.title = 'Token · lab';
    const input = el('input', {
      id: 'token-input', type: 'password', autocomplete: 'off', spellcheck: 'false',
      placeholder: 'lab_…', 'aria-label': 'read token', required: true,
    });
    const note = el('p', { id: 'token-error', class: 'error', role: 'alert' });
    const form = el('form', { id: 'token-form', class: 'token-form' },
      input, el('button', { type: 'submit', text: 'Open' }));
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      const token = input.value;
      input.value = '';
      note.textContent = '';
      const answer = await fetch('/ui/token', {
        method: 'POST', credentials: 'same-origin',
        headers: { 'Content-Type': 'application/json', Accept: 'application/json' },
        body: JSON.stringify({ token }),
      });
      if (answer.ok) { location.reload(); return; }
      let detail = `${answer.status}`;
      try { detail = (await answer.json()).detail || detail; } catch (_err) { /* status */ }
      note.textContent = detail;
    });
    clear(main).append(el('section', { id: 'token-prompt', class: 'card narrow' },
      el('h1', { text: 'This server wants a read token' }),
      el('p', { text: 'Paste a token made with: lab token create NAME --scope read. ' +
        'The browser keeps it for this session in a cookie that scripts cannot read; ' +
        'the page never shows it again.' }),
      why && why !== 'need a token' ? el('p', { class: 'muted', text: why }) : null,
      form, note));
    input.focus();
  }

  function setupLogout() {
    const button = document.getElementById('logout');
    if (body.dataset.auth !== '1' || body.dataset.signedIn !== '1') return;
    button.hidden = false;
    button.addEventListener('click', async () => {
      await fetch('/ui/logout', { method: 'POST', credentials: 'same-origin' });
      location.assign('/');
    });
  }

  // -- tables ---------------------------------------------------------------------------

  function table(id, columns, rows, rowProps) {
    const head = el('tr', {}, columns.map((c) => el('th', { text: c.label, title: c.title })));
    const tbody = el('tbody', {}, rows.map((row, i) => el('tr', rowProps ? rowProps(row, i) : {},
      columns.map((c) => (c.cell ? c.cell(row) : cell(row[c.key]))))));
    return el('div', { class: 'table-wrap' },
      el('table', { id, class: 'data' }, el('thead', {}, head), tbody));
  }

  // -- experiments ----------------------------------------------------------------------

  function experimentsPage() {
    document.title = 'Experiments · lab';
    crumbs('experiments');
    const params = new URLSearchParams(location.search);
    const state = { q: params.get('q') || '', offset: Math.max(0, +params.get('offset') || 0),
      limit: 50 };
    const search = el('input', { id: 'search', type: 'search', placeholder: 'Search names',
      value: state.q, 'aria-label': 'search experiments' });
    const holder = el('div', { id: 'experiments' });
    const pager = el('div', { class: 'pager' });
    clear(main).append(section('experiments-card', null,
      el('div', { class: 'head-row' }, el('h1', { text: 'Experiments' }), search),
      holder, pager));
    let timer = null;
    let poll = null;
    search.addEventListener('input', () => {
      clearTimeout(timer);
      timer = setTimeout(() => { state.q = search.value; state.offset = 0; load(); }, 250);
    });

    async function load() {
      clearTimeout(poll);
      const query = new URLSearchParams({ q: state.q, offset: state.offset, limit: state.limit });
      let data;
      try {
        data = await api(`${API}/experiments?${query}`);
      } catch (err) { failed(err); return; }
      const shown = new URLSearchParams();
      if (state.q) shown.set('q', state.q);
      if (state.offset) shown.set('offset', state.offset);
      history.replaceState(null, '', shown.toString() ? `/?${shown}` : '/');
      const columns = [
        { label: 'Name', cell: (r) => el('td', { class: 'name' },
          el('a', { href: expUrl(r.name), text: r.name })) },
        { label: 'Status', cell: (r) => el('td', {}, badge(r.status)) },
        { label: 'Runs done / total', cell: (r) => el('td', { class: 'num',
          text: `${r.runs_done} / ${r.runs_total}` }) },
        { label: 'Best arm', cell: (r) => el('td', {}, r.best_arm === null ? '–' :
          [r.best_arm, el('span', { class: 'muted', text: ` (${r.metric}, ${r.mode})` })]) },
        { label: 'Started (UTC)', cell: (r) => el('td', { text: when(r.started_at) }) },
        { label: 'Duration', cell: (r) => el('td', { class: 'num', text: duration(r.duration_s) }) },
      ];
      clear(holder).append(data.rows.length ? table('experiments-table', columns, data.rows) :
        el('p', { class: 'muted', text: state.q ? 'No experiment name holds that text.' :
          'No experiments yet: run one (lab quickstart) and reload.' }));
      const last = Math.min(data.offset + data.rows.length, data.total);
      clear(pager).append(
        el('button', { type: 'button', text: '← Newer', disabled: data.offset === 0,
          onclick: () => { state.offset = Math.max(0, state.offset - state.limit); load(); } }),
        el('span', { class: 'muted', text: data.total ?
          `${data.offset + 1}–${last} of ${data.total}` : '0 of 0' }),
        el('button', { type: 'button', text: 'Older →', disabled: last >= data.total,
          onclick: () => { state.offset += state.limit; load(); } }));
      if (data.rows.some((r) => r.status === 'running')) poll = setTimeout(load, POLL_MS);
    }
    load();
  }

  // -- one experiment -------------------------------------------------------------------

  function experimentPage(name) {
    document.title = `${name} · lab`;
    crumbs(el('a', { href: '/', text: 'experiments' }), name);
    const params = new URLSearchParams(location.search);
    const state = {
      metric: params.get('metric') || null, mode: params.get('mode') || null,
      smoothing: 0, log: false, runs: false, only: null, sort: null, desc: false,
      filter: '', status: '', exp: null, curves: null, chart: null, poll: null,
    };
    const header = el('div', { id: 'exp-header' });
    const summary = section('summary', 'Arms');
    const curves = section('curves', 'Learning curves');
    const runs = section('runs', 'Runs');
    const chains = section('chains', 'Chains');
    chains.hidden = true;
    clear(main).append(header, summary, curves, runs, chains);

    const base = `${API}/experiments/${enc(name)}`;

    async function load(first) {
      clearTimeout(state.poll);
      const query = new URLSearchParams();
      if (state.metric) query.set('metric', state.metric);
      if (state.mode) query.set('mode', state.mode);
      let exp;
      try {
        exp = await api(`${base}?${query}`);
      } catch (err) { failed(err); return; }
      state.exp = exp;
      state.metric = exp.metric;
      state.mode = exp.mode;
      drawHeader(exp);
      drawSummary(exp);
      drawRuns(exp.runs);
      drawChains(exp);
      if (first) buildCurves();
      await loadCurves();
      if (exp.live) state.poll = setTimeout(() => load(false), POLL_MS);
    }

    function setUrl() {
      const query = new URLSearchParams();
      if (state.metric) query.set('metric', state.metric);
      if (state.mode) query.set('mode', state.mode);
      history.replaceState(null, '', `${expUrl(name)}?${query}`);
    }

    function drawHeader(exp) {
      const metricPick = el('select', { id: 'metric', 'aria-label': 'metric' },
        exp.metrics.map((k) => el('option', { value: k, text: k, selected: k === exp.metric })));
      metricPick.addEventListener('change', () => {
        state.metric = metricPick.value; state.mode = null; setUrl(); load(false);
      });
      const modePick = el('select', { id: 'mode', 'aria-label': 'better is' },
        el('option', { value: 'min', text: 'lower is better', selected: exp.mode === 'min' }),
        el('option', { value: 'max', text: 'higher is better', selected: exp.mode === 'max' }));
      modePick.addEventListener('change', () => {
        state.mode = modePick.value; setUrl(); load(false);
      });
      const done = exp.runs.filter((r) => r.status !== 'running').length;
      clear(header).append(el('section', { class: 'card' },
        el('div', { class: 'head-row' },
          el('h1', { id: 'exp-name', text: exp.name }), badge(exp.status),
          exp.live ? el('span', { class: 'live', text: 'live' }) : null),
        el('p', { class: 'meta' },
          `started ${when(exp.started_at)} UTC · ${duration(exp.duration_s)} · ` +
          `${exp.arms.length} arms × ${exp.repeats} repeats · ${done} / ${exp.runs.length} runs ` +
          'done',
          exp.tags && exp.tags.length ? ` · tags: ${exp.tags.join(', ')}` : ''),
        exp.notes ? el('p', { class: 'notes', text: exp.notes }) : null,
        el('div', { class: 'controls' },
          el('label', {}, 'Metric ', metricPick), el('label', {}, ' ', modePick),
          exp.evals.length ? el('a', { id: 'to-predictions', class: 'button',
            href: `${expUrl(name)}/predictions`, text: 'Predictions →' }) : null,
          exp.arms.length > 1 ? el('a', { id: 'to-sweep', class: 'button',
            href: `${expUrl(name)}/sweep`, text: 'Sweep and race →' }) : null),
        el('details', {}, el('summary', { text: 'Config' }),
          el('pre', { id: 'exp-config', text: JSON.stringify(exp.config, null, 2) }))));
    }

    function drawSummary(exp) {
      const h = summary.querySelector('h2');
      h.textContent = `Arms: final ${exp.metric || '–'} (${exp.mode === 'max' ? 'higher' : 'lower'} is better)`;
      const columns = [
        { label: 'Arm', cell: (r) => el('td', { class: 'name' },
          el('span', { class: 'swatch', style: `background:${armColor(r.arm)}` }),
          el('button', { type: 'button', class: 'link arm-pick', text: r.arm,
            title: 'Show only this arm in the chart', onclick: () => solo(r.arm) }),
          r.is_best ? el('span', { class: 'best-mark', text: '★ best' }) : null) },
        { label: 'n', key: 'n' }, { label: 'mean', key: 'mean' }, { label: 'std', key: 'std' },
        { label: '95% CI', cell: (r) => el('td', { class: 'num ci', dataset: {
          low: JSON.stringify(r.ci_low), high: JSON.stringify(r.ci_high) },
        text: r.ci_low === null ? '–' : `${fmt(r.ci_low)} … ${fmt(r.ci_high)}` }) },
        { label: 'rank', key: 'rank' },
        { label: 'margin', key: 'margin', title: 'how far the best arm is ahead of the next' },
      ];
      const rows = exp.summary || [];
      summary.querySelector('.table-wrap, p')?.remove();
      summary.append(rows.length ? table('arm-table', columns, rows, (r) => ({
        class: r.is_best ? 'best' : null, dataset: { arm: r.arm } })) :
        el('p', { class: 'muted', text: exp.summary_error || 'No finished run has this metric yet.' }));
    }

    function armColor(arm) {
      const arms = (state.exp ? state.exp.arms : []).map((a) => a.name);
      const i = arms.indexOf(arm);
      return COLORS[(i < 0 ? 0 : i) % COLORS.length];
    }

    // -- curves --

    let chartBox, legend, smoothLabel;

    function buildCurves() {
      const smooth = el('input', { id: 'smoothing', type: 'range', min: '0', max: '0.99',
        step: '0.01', value: '0', 'aria-label': 'smoothing' });
      smoothLabel = el('span', { class: 'muted', text: '0' });
      smooth.addEventListener('input', () => {
        state.smoothing = +smooth.value; smoothLabel.textContent = smooth.value; drawCurves();
      });
      const log = el('input', { id: 'log-scale', type: 'checkbox' });
      log.addEventListener('change', () => { state.log = log.checked; drawCurves(); });
      const each = el('input', { id: 'show-runs', type: 'checkbox' });
      each.addEventListener('change', () => { state.runs = each.checked; loadCurves(); });
      const reset = el('button', { id: 'reset-zoom', type: 'button', text: 'Reset zoom',
        onclick: () => { state.only = null; state.zoom = null; drawCurves(); } });
      chartBox = el('div', { id: 'curve-chart', class: 'chart' });
      legend = el('div', { id: 'curve-legend', class: 'legend' });
      curves.append(el('div', { class: 'controls' },
        el('label', {}, 'Smoothing ', smooth, ' ', smoothLabel),
        el('label', {}, log, ' log scale'), el('label', {}, each, ' runs one by one'), reset,
        el('span', { class: 'muted hint', text: 'drag to zoom, double-click to zoom out' })),
      chartBox, legend);
    }

    async function loadCurves() {
      if (!state.metric) {
        clear(chartBox).append(el('p', { class: 'muted', text: 'No metric recorded yet.' }));
        return;
      }
      const buckets = Math.max(50, Math.min(2000, Math.round(chartBox.clientWidth || 800)));
      // a pruned run is in no arm's curve: its own line is drawn grey whenever there is one
      const pruned = (state.exp ? state.exp.runs : []).some((r) => r.status === 'pruned');
      const query = new URLSearchParams({ metric: state.metric, buckets,
        runs: state.runs || pruned });
      const started = performance.now();
      try {
        state.curves = await api(`${base}/curves?${query}`);
      } catch (err) {
        clear(chartBox).append(el('p', { class: 'error', text: err.message }));
        return;
      }
      drawCurves(started);
    }

    function solo(arm) {
      state.only = state.only === arm ? null : arm;
      drawCurves();
      chartBox.scrollIntoView({ block: 'nearest' });
    }

    function drawCurves(started) {
      const data = state.curves;
      if (!data || !window.uPlot) return;
      const arms = data.arms.filter((a) => !state.only || a.arm === state.only);
      const runs = data.runs.filter((r) => r.step.length && (state.runs || r.status === 'pruned')
        && (!state.only || r.arm === state.only));
      const steps = new Set();
      for (const a of arms) a.step.forEach((s) => steps.add(s));
      for (const r of runs) r.step.forEach((s) => steps.add(s));
      const xs = Array.from(steps).sort((p, q) => p - q);
      const at = new Map(xs.map((s, i) => [s, i]));
      const shape = (stepsOf, values) => {
        const out = new Array(xs.length).fill(null);
        const ys = smooth(values.map(num));
        stepsOf.forEach((s, i) => {
          const y = ys[i];
          out[at.get(s)] = y === null || !Number.isFinite(y) || (state.log && y <= 0) ? null : y;
        });
        return out;
      };
      const series = [{ label: 'step' }];
      const columns = [xs];
      const bands = [];
      for (const a of arms) {
        const color = armColor(a.arm);
        columns.push(shape(a.step, a.mean));
        // a short curve (a few evals) shows its points: one point alone draws no line
        series.push({ label: a.arm, role: 'mean', stroke: color, width: 2, spanGaps: true,
          points: { show: a.step.length <= 12, size: 5, fill: color } });
        const mean = series.length - 1;
        columns.push(shape(a.step, a.ci_low), shape(a.step, a.ci_high));
        series.push({ label: `${a.arm} 95% CI low`, role: 'ci', stroke: `${color}55`, width: 1,
          spanGaps: true, points: { show: false } });
        series.push({ label: `${a.arm} 95% CI high`, role: 'ci', stroke: `${color}55`, width: 1,
          spanGaps: true, points: { show: false } });
        bands.push({ series: [mean + 2, mean + 1], fill: `${color}22` });
      }
      for (const r of runs) {
        columns.push(shape(r.step, r.last));
        const cut = r.status === 'pruned';  // grey and dashed, its last point shown
        series.push({ label: r.run_key, role: cut ? 'pruned' : 'run',
          stroke: cut ? PRUNED_GREY : `${armColor(r.arm)}88`, width: cut ? 1.5 : 1,
          dash: cut ? [5, 4] : undefined, spanGaps: true, points: { show: false } });
      }
      const zoom = state.zoom;  // a redraw (a poll, the log scale, smoothing) keeps the zoom
      if (state.chart) { state.chart.destroy(); state.chart = null; }
      clear(chartBox);
      clear(legend);
      if (!xs.length) {
        chartBox.append(el('p', { class: 'muted', text: 'No points for this metric yet.' }));
        return;
      }
      const readouts = [];
      legend.append(el('span', { class: 'legend-step muted', text: '' }));
      for (const a of arms) {
        const out = el('span', { class: 'legend-value' });
        readouts.push(out);
        legend.append(el('span', { class: 'legend-arm', dataset: { arm: a.arm } },
          el('span', { class: 'swatch', style: `background:${armColor(a.arm)}` }),
          el('button', { type: 'button', class: 'link', text: a.arm,
            onclick: () => solo(a.arm) }), ' ', out));
      }
      const width = Math.max(300, chartBox.clientWidth);
      let measured = !started;
      const opts = {
        width, height: 320, series, bands,
        legend: { show: false },
        cursor: { drag: { x: true, y: false } },
        scales: { x: { time: false }, y: state.log ? { distr: 3 } : {} },
        axes: [{ label: 'step' }, { label: data.metric }],
        hooks: {
          setCursor: [(u) => {
            const i = u.cursor.idx;
            legend.firstChild.textContent = i === null || i === undefined ? '' :
              `step ${xs[i]}: `;
            let k = 0;
            u.series.forEach((s, j) => {
              if (s.role !== 'mean') return;
              readouts[k++].textContent = i === null || i === undefined ? '' :
                fmt(nearest(u.data[j], i));
            });
          }],
          setScale: [(u, key) => {
            if (key !== 'x' || !restored) return;
            const lo = u.scales.x.min;
            const hi = u.scales.x.max;
            state.zoom = lo > xs[0] || hi < xs[xs.length - 1] ? [lo, hi] : null;
          }],
          draw: [() => {
            if (measured) return;
            measured = true;
            chartBox.dataset.drawMs = (performance.now() - started).toFixed(1);
          }],
        },
      };
      let restored = false;
      state.chart = new window.uPlot(opts, columns, chartBox);
      if (zoom) state.chart.setScale('x', { min: zoom[0], max: zoom[1] });
      state.zoom = zoom;
      restored = true;
      chartBox.uplot = state.chart;
      chartBox.dataset.arms = String(arms.length);
      chartBox.dataset.pruned = String(runs.filter((r) => r.status === 'pruned').length);
      if (runs.some((r) => r.status === 'pruned')) {
        legend.append(el('span', { class: 'legend-arm legend-pruned' }, el('span',
          { class: 'swatch', style: `background:${PRUNED_GREY}` }), 'pruned runs (in no arm\'s mean)'));
      }
      chartBox.dataset.metric = data.metric;
    }

    function nearest(values, i) {
      for (let j = i; j >= 0; j--) if (values[j] !== null) return values[j];
      return null;
    }

    /** EMA as lab.analysis.ema computes it: NaN and missing points are skipped. */
    function smooth(values) {
      const w = state.smoothing;
      if (!w) return values;
      let s = null;
      return values.map((x) => {
        if (x === null || Number.isNaN(x)) return x;
        s = s === null ? x : w * s + (1 - w) * x;
        return s;
      });
    }

    // -- runs --

    let runsBox;

    function runColumns(list) {
      const configs = list.map((r) => flatten(r.config));
      const keys = new Set();
      configs.forEach((c) => Object.keys(c).forEach((k) => keys.add(k)));
      const varying = Array.from(keys).filter((k) => new Set(configs.map((c) =>
        JSON.stringify(c[k]))).size > 1).sort();
      const finals = new Set();
      list.forEach((r) => Object.keys(r.final || {}).forEach((k) => finals.add(k)));
      const cols = [
        { key: 'run_key', label: 'run', get: (r) => r.run_key },
        { key: 'arm', label: 'arm', get: (r) => r.arm },
        { key: 'repeat', label: 'repeat', get: (r) => r.repeat },
        { key: 'stage', label: 'stage', get: (r) => r.stage },
        { key: 'seed', label: 'seed', get: (r) => r.seed },
        { key: 'status', label: 'status', get: (r) => r.status },
        { key: 'duration', label: 'duration', get: (r) => num(r.duration_s) },
      ];
      varying.forEach((k) => cols.push({ key: `config.${k}`, label: k, kind: 'config',
        get: (r) => flatten(r.config)[k] }));
      // A metric named like a config field (lr) says which of the two columns it is.
      Array.from(finals).sort().forEach((k) => cols.push({ key: `final.${k}`,
        label: varying.includes(k) ? `${k} (final)` : k,
        kind: 'final', get: (r) => (r.final || {})[k] }));
      return cols;
    }

    /** The filter box: words "field=value", "field<3", "field~text" (contains), "field!=v",
     * for config fields, final metrics, status, arm...; a word without one matches text. */
    function matcher(text, cols) {
      const tests = [];
      for (const word of text.trim().split(/\s+/).filter(Boolean)) {
        const m = word.match(/^([^<>=!~]+)(<=|>=|!=|=|<|>|~)(.*)$/);
        if (!m) {
          const needle = word.toLowerCase();
          tests.push((r) => JSON.stringify([r.run_key, r.arm, r.status, r.config])
            .toLowerCase().includes(needle));
          continue;
        }
        const [, field, op, want] = m;
        const col = cols.find((c) => c.key === field) || cols.find((c) => c.label === field);
        const get = col ? col.get : (r) => flatten(r.config)[field.replace(/^config\./, '')];
        tests.push((r) => compare(get(r), op, want));
      }
      return (r) => tests.every((t) => t(r));
    }

    function compare(have, op, want) {
      if (op === '~') return have !== undefined && value(have).toLowerCase().includes(want.toLowerCase());
      const a = num(have);
      const b = want === '' ? NaN : Number(want);
      const numeric = a !== null && !Number.isNaN(b);
      const same = numeric ? a === b : value(have) === want;
      if (op === '=') return same;
      if (op === '!=') return !same;
      if (!numeric) return false;
      return { '<': a < b, '>': a > b, '<=': a <= b, '>=': a >= b }[op];
    }

    function drawRuns(list) {
      if (!runsBox) {
        const filter = el('input', { id: 'run-filter', type: 'search', value: state.filter,
          placeholder: 'filter: lr=0.1 status=failed val/loss<0.5 seed!=0 run_key~r1',
          'aria-label': 'filter runs' });
        filter.addEventListener('input', () => { state.filter = filter.value; redraw(); });
        const status = el('select', { id: 'run-status', 'aria-label': 'status' },
          el('option', { value: '', text: 'any status' }),
          Array.from(STATUSES).map((s) => el('option', { value: s, text: s })));
        status.addEventListener('change', () => { state.status = status.value; redraw(); });
        runsBox = el('div', {});
        runs.append(el('div', { class: 'controls' }, filter, status), runsBox);
      }
      state.runList = list;
      redraw();
    }

    function redraw() {
      const list = state.runList || [];
      const cols = runColumns(list);
      const keep = matcher(state.filter, cols);
      let shown = list.filter((r) => (!state.status || r.status === state.status) && keep(r));
      if (state.sort) {
        const col = cols.find((c) => c.key === state.sort);
        if (col) {
          shown = shown.slice().sort((p, q) => order(col.get(p), col.get(q)) *
            (state.desc ? -1 : 1));
        }
      }
      const head = el('tr', {}, cols.map((c) => {
        const arrow = state.sort === c.key ? (state.desc ? ' ▼' : ' ▲') : '';
        return el('th', { class: c.kind ? `col-${c.kind}` : null, title: c.key },
          el('button', { type: 'button', class: 'sort', dataset: { key: c.key },
            text: c.label + arrow, onclick: () => {
              state.desc = state.sort === c.key ? !state.desc : false;
              state.sort = c.key;
              redraw();
            } }));
      }));
      const rows = shown.map((r) => el('tr', { dataset: { runId: r.run_id, status: r.status } },
        cols.map((c) => {
          if (c.key === 'run_key') {
            return el('td', { class: 'name' }, el('a', { href: runUrl(r.run_id), text: r.run_key }),
              r.error ? el('div', { class: 'error small', text: r.error.split('\n')[0] }) : null);
          }
          if (c.key === 'status') return el('td', {}, badge(r.status));
          if (c.key === 'duration') return el('td', { class: 'num', text: duration(r.duration_s) });
          return cell(c.get(r) === undefined ? null : c.get(r));
        })));
      clear(runsBox).append(
        el('p', { class: 'muted', id: 'run-count', text: `${shown.length} of ${list.length} runs` }),
        el('div', { class: 'table-wrap' }, el('table', { id: 'runs-table', class: 'data' },
          el('thead', {}, head), el('tbody', {}, rows))));
    }

    function order(p, q) {
      const a = num(p);
      const b = num(q);
      if (p === undefined || p === null) return q === undefined || q === null ? 0 : 1;
      if (q === undefined || q === null) return -1;
      if (a !== null && b !== null) {
        if (Number.isNaN(a)) return Number.isNaN(b) ? 0 : 1;
        if (Number.isNaN(b)) return -1;
        return a - b;
      }
      return value(p).localeCompare(value(q), undefined, { numeric: true });
    }

    function drawChains(exp) {
      const real = (exp.chains || []).filter((c) => c.runs.length > 1);
      chains.hidden = !real.length;
      clear(chains).append(el('h2', { text: 'Chains' }));
      const byId = new Map(exp.runs.map((r) => [r.run_id, r]));
      chains.append(el('ol', { id: 'chain-list', class: 'chains' }, real.map((c) =>
        el('li', {}, el('span', { class: 'muted', text: `${c.group} (${c.arm}): ` }),
          c.runs.map((id, i) => {
            const r = byId.get(id);
            return [i ? el('span', { class: 'arrow', text: ' → ' }) : null,
              el('a', { href: runUrl(id), text: r ? `stage ${r.stage}` : `run ${id}` }),
              r ? [' ', badge(r.status)] : null];
          })))));
    }

    load(true);
  }

  // -- one run --------------------------------------------------------------------------

  function runPage(id) {
    document.title = `run ${id} · lab`;
    let poll = null;
    const charts = new Map();

    async function load() {
      clearTimeout(poll);
      let run;
      try {
        run = await api(`${API}/runs/${enc(id)}`);
      } catch (err) { failed(err); return; }
      document.title = `${run.run_key} · lab`;
      crumbs(el('a', { href: '/', text: 'experiments' }),
        el('a', { href: expUrl(run.experiment), text: run.experiment }), run.run_key);
      draw(run);
      if (run.live) poll = setTimeout(load, POLL_MS);
    }

    function draw(run) {
      const parts = [];
      parts.push(el('section', { class: 'card', id: 'run-header' },
        el('div', { class: 'head-row' }, el('h1', { id: 'run-key', text: run.run_key }),
          badge(run.status), run.live ? el('span', { class: 'live', text: 'live' }) : null),
        el('p', { class: 'meta' }, 'experiment ',
          el('a', { href: expUrl(run.experiment), text: run.experiment }),
          ` · arm ${run.arm === null ? '–' : run.arm} · repeat ${run.repeat} · stage ${run.stage}` +
          ` · seed ${run.seed} · started ${when(run.started_at)} UTC · ${duration(run.duration_s)}`,
          run.parent_run_id !== null && run.parent_run_id !== undefined ?
            [' · after ', el('a', { href: runUrl(run.parent_run_id),
              text: `run ${run.parent_run_id}` })] : null)));
      if (run.error || run.traceback) {
        parts.push(el('section', { class: 'card error-box', id: 'run-error' },
          el('h2', { text: `This run ${run.status === 'crashed' ? 'crashed' : 'failed'}` }),
          el('pre', { class: 'error-text', text: run.error || '' }),
          run.traceback ? el('details', { open: true }, el('summary', { text: 'Traceback' }),
            el('pre', { class: 'traceback', text: run.traceback })) : null));
      } else if (run.status === 'crashed') {
        parts.push(el('section', { class: 'card error-box', id: 'run-error' },
          el('h2', { text: 'This run crashed' }),
          el('p', { text: 'Its process ended without recording how: no error was stored.' })));
      }
      const errors = run.callback_errors || [];
      if (errors.length) {
        parts.push(section('callback-errors', `Callback errors (${errors.length})`,
          errors.map((e) => el('div', { class: 'cb-error' },
            typeof e === 'object' && e !== null ? [
              el('p', {}, el('strong', { text: `${e.callback || '?'}.${e.hook || '?'}` }),
                `: ${e.error || ''}`, e.count > 1 ? ` (${e.count} times)` : '',
                e.disabled ? ' — disabled for the rest of the run' : ''),
              e.traceback ? el('details', {}, el('summary', { text: 'Traceback' }),
                el('pre', { class: 'traceback', text: e.traceback })) : null,
            ] : el('pre', { text: String(e) })))));
      }
      parts.push(section('run-config', 'Config',
        el('pre', { id: 'config-text', text: JSON.stringify(run.config, null, 2) })));
      const grid = el('div', { class: 'chart-grid' });
      parts.push(section('metrics', 'Metrics',
        run.metrics.length ? table('metrics-table', [
          { label: 'key', key: 'key' }, { label: 'points', key: 'count' },
          { label: 'first step', key: 'first_step' }, { label: 'last step', key: 'last_step' },
          { label: 'last', key: 'last' }, { label: 'min', key: 'min' }, { label: 'max', key: 'max' },
        ], run.metrics) : el('p', { class: 'muted', text: 'No metrics recorded.' }), grid));
      if (run.evals.length) {
        parts.push(section('evals', 'Evals', table('evals-table', [
          { label: 'name', cell: (e) => el('td', {}, e.predictions ? el('a', {
            href: `${expUrl(run.experiment)}/predictions?eval=${enc(e.name)}`, text: e.name }) :
            e.name) },
          { label: 'step', cell: (e) => el('td', { class: 'num',
            text: e.step === null ? 'final' : String(e.step) }) },
          { label: 'metrics', cell: (e) => el('td', { text: pairs(e.metrics) }) },
          { label: 'breakdowns', cell: (e) => el('td', { class: 'small', text: e.breakdowns ?
            Object.entries(e.breakdowns).map(([s, m]) => `${s}: ${pairs(m)}`).join('; ') : '–' }) },
          { label: 'tags', cell: (e) => el('td', { class: 'small', text: pairs(e.tags) }) },
          { label: 'seconds', key: 'seconds' },
          { label: 'predictions', key: 'predictions' },
          { label: 'error', cell: (e) => el('td', { class: 'error', text: e.error || '' }) },
        ], run.evals)));
      }
      if (run.checkpoints.length) {
        parts.push(section('checkpoints', 'Checkpoints', table('checkpoints-table', [
          { label: 'step', key: 'step' }, { label: 'event', key: 'event' },
          { label: 'path', cell: (c) => el('td', { class: 'path', text: c.path || '–' }) },
          { label: 'metrics', cell: (c) => el('td', { text: pairs(c.metrics) }) },
          { label: 'reason', cell: (c) => el('td', { text: c.reason || '' }) },
          { label: 'at (UTC)', cell: (c) => el('td', { text: when(c.created_at) }) },
        ], run.checkpoints, (c) => ({ class: `event-${String(c.event).replace(/\W/g, '')}` }))));
      }
      if ((run.histograms || []).length) {
        parts.push(section('histograms', 'Histograms', el('div', { class: 'chart-grid' },
          run.histograms.map(histogram))));
      }
      if ((run.images || []).length) {
        parts.push(section('images', 'Images', el('div', { class: 'image-grid' },
          run.images.filter((m) => String(m.url).startsWith('/api/v1/dashboard/')).map((m) => {
            // small images (a weight matrix) drawn large, pixels kept square; big ones fit 300 px
            const side = Math.max(1, m.width || 1, m.height || 1);
            const scale = Math.min(300 / side, Math.max(1, 160 / side));
            return el('figure', {}, el('img', { src: m.url, alt: `${m.key} at step ${m.step}`,
              width: Math.round((m.width || 1) * scale), height: Math.round((m.height || 1) * scale),
              loading: 'lazy' }),
            el('figcaption', { text: `${m.key} · step ${m.step}` }));
          }))));
      }
      for (const chart of charts.values()) chart.destroy();
      charts.clear();
      clear(main).append(...parts);
      seriesCharts(run, grid);
    }

    function pairs(obj) {
      if (!obj || typeof obj !== 'object') return value(obj);
      return Object.entries(obj).map(([k, v]) => `${k}=${value(v)}`).join(', ') || '–';
    }

    async function seriesCharts(run, grid) {
      const span = stepSpan(run.metrics);
      for (const m of run.metrics) {
        const box = el('div', { class: 'small-chart', dataset: { key: m.key } },
          el('div', { class: 'chart-title', text: m.key }));
        grid.append(box);
        let s;
        try {
          s = await api(`/api/v1/runs/${enc(run.run_id)}/series?key=${enc(m.key)}&buckets=300`);
        } catch (err) {
          box.append(el('p', { class: 'error', text: err.message })); continue;
        }
        if (!window.uPlot) continue;
        const clean = (v) => { const x = num(v); return x === null || !Number.isFinite(x) ? null : x; };
        const color = COLORS[0];
        const chart = new window.uPlot({
          width: 300, height: 150, legend: { show: false },
          scales: { x: { time: false, range: span ? () => span : undefined } },
          axes: [{ size: 28, font: '10px sans-serif' }, { size: 44, font: '10px sans-serif' }],
          series: [{}, { stroke: color, width: 1.5, spanGaps: true,
            points: { show: s.step_max.length < 3 } },
            { stroke: `${color}44`, width: 1, spanGaps: true, points: { show: false } },
            { stroke: `${color}44`, width: 1, spanGaps: true, points: { show: false } }],
          bands: [{ series: [3, 2], fill: `${color}22` }],
        }, [s.step_max, s.last.map(clean), s.min.map(clean), s.max.map(clean)], box);
        box.uplot = chart;
        charts.set(m.key, chart);
      }
    }

    /** The x range every metric of a run is drawn on: the run's steps, from the first
     * metric's first step to the last one's last, so a metric of one point (a final eval)
     * sits where it was logged; a run of one step gets one step of room each side. */
    function stepSpan(metrics) {
      const firsts = metrics.map((m) => num(m.first_step)).filter(Number.isFinite);
      const lasts = metrics.map((m) => num(m.last_step)).filter(Number.isFinite);
      if (!firsts.length || !lasts.length) return null;
      const lo = Math.min(...firsts);
      const hi = Math.max(...lasts);
      return lo < hi ? [lo, hi] : [lo - 1, hi + 1];
    }

    function histogram(hist) {
      const counts = (hist.counts || []).map((c) => num(c) || 0);
      const edges = (hist.edges || []).map(num);
      const canvas = el('canvas', { width: 300, height: 120, class: 'hist' });
      const ctx = canvas.getContext('2d');
      const top = Math.max(1, ...counts);
      const w = canvas.width / Math.max(1, counts.length);
      ctx.fillStyle = COLORS[0];
      counts.forEach((c, i) => {
        const h = (c / top) * (canvas.height - 4);
        ctx.fillRect(i * w, canvas.height - h, Math.max(1, w - 1), h);
      });
      const extra = ['nan', 'posinf', 'neginf'].filter((k) => hist[k]).map((k) => `${k} ${hist[k]}`);
      return el('figure', { class: 'histogram', dataset: { key: hist.key } }, canvas,
        el('figcaption', { text: `${hist.key} · step ${hist.step} · ` +
          `${fmt(edges[0])} … ${fmt(edges[edges.length - 1])}` +
          (extra.length ? ` · ${extra.join(', ')}` : '') }));
    }

    load();
  }

  // -- predictions ----------------------------------------------------------------------

  function predictionsPage(name) {
    document.title = `predictions of ${name} · lab`;
    crumbs(el('a', { href: '/', text: 'experiments' }), el('a', { href: expUrl(name), text: name }),
      'predictions');
    const params = new URLSearchParams(location.search);
    const state = { eval: params.get('eval'), a: params.get('arm_a'), b: params.get('arm_b'),
      run: null, cursors: [null], page: 0 };
    const base = `${API}/experiments/${enc(name)}`;

    async function load() {
      let exp;
      try {
        exp = await api(base);
      } catch (err) { failed(err); return; }
      const arms = exp.arms.map((a) => a.name);
      if (!exp.evals.includes(state.eval)) state.eval = exp.evals[0] || null;
      if (!arms.includes(state.a)) state.a = arms[0] || null;
      if (!arms.includes(state.b) || state.b === state.a) {
        state.b = arms.find((a) => a !== state.a) || null;
      }
      const pick = (id, label, options, chosen, on) => {
        const select = el('select', { id, 'aria-label': label },
          options.map((o) => el('option', { value: o, text: o, selected: o === chosen })));
        select.addEventListener('change', () => on(select.value));
        return el('label', {}, `${label} `, select);
      };
      const disagreeBox = section('disagreements', 'Where the two arms disagree');
      const breakdownBox = section('breakdown', 'Per tag (breakdowns)');
      const rowsBox = section('rows', 'Rows of one run');
      const runsOf = exp.runs.filter((r) => r.status !== 'running' || true);
      if (!runsOf.some((r) => r.run_id === state.run)) state.run = runsOf.length ? runsOf[0].run_id : null;
      clear(main).append(section('pred-head', null,
        el('h1', { text: `Predictions of ${exp.name}` }),
        exp.evals.length ? el('div', { class: 'controls' },
          pick('eval', 'eval', exp.evals, state.eval, (v) => { state.eval = v; refresh(); }),
          pick('arm-a', 'arm A', arms, state.a, (v) => { state.a = v; refresh(); }),
          pick('arm-b', 'arm B', arms, state.b, (v) => { state.b = v; refresh(); }))
          : el('p', { class: 'muted', text: 'This experiment recorded no evals.' })),
      disagreeBox, breakdownBox, rowsBox);
      if (!exp.evals.length) return;

      function setUrl() {
        const query = new URLSearchParams({ eval: state.eval });
        if (state.a) query.set('arm_a', state.a);
        if (state.b) query.set('arm_b', state.b);
        history.replaceState(null, '', `${expUrl(name)}/predictions?${query}`);
      }

      /** Empty `box` but its title, once the newest of its loads has its answer. */
      const turns = new Map();
      function turn(box) {
        const mine = (turns.get(box) || 0) + 1;
        turns.set(box, mine);
        return () => {
          if (turns.get(box) !== mine) return false;
          while (box.childNodes.length > 1) box.removeChild(box.lastChild);
          return true;
        };
      }

      async function disagreements() {
        const box = disagreeBox;
        const mine = turn(box);
        if (!state.a || !state.b || state.a === state.b) {
          if (mine()) box.append(el('p', { class: 'muted', text: 'Choose two different arms.' }));
          return;
        }
        try {
          const q = new URLSearchParams({ eval: state.eval, arm_a: state.a, arm_b: state.b,
            limit: 20 });
          const data = await api(`${base}/disagreements?${q}`);
          if (!mine()) return;
          // correctness is shown only where it is defined (a discrete target): a
          // regression's rows have it null, and their scores say how close they came
          const cols = ['example_id', 'input', 'target', 'output_a', 'output_b', 'score_a',
            'score_b', 'correct_a', 'correct_b', 'diff'].filter((c) =>
            !c.startsWith('correct_') || data.rows.some((r) => r[c] !== null));
          box.append(el('p', { class: 'muted', text: `A = ${state.a}, B = ${state.b}; ` +
            'each arm over its repeats, its latest eval; largest |diff| first' }),
          data.rows.length ? table('disagreements-table', cols.map((c) => ({ label: c, key: c })),
            data.rows) : el('p', { class: 'muted', text: 'No example that both arms scored.' }));
        } catch (err) {
          if (mine()) box.append(el('p', { class: 'error', text: err.message }));
        }
      }

      async function breakdown() {
        const box = breakdownBox;
        const mine = turn(box);
        try {
          const data = await api(`${base}/breakdown?${new URLSearchParams({ eval: state.eval })}`);
          if (!mine()) return;
          box.append(data.rows.length ? table('breakdown-table', [
            { label: 'arm', key: 'arm' }, { label: 'tag', key: 'slice' },
            { label: 'metric', key: 'metric' }, { label: 'n', key: 'n' },
            { label: 'mean', key: 'mean' }, { label: 'std', key: 'std' },
            { label: '95% CI', cell: (r) => el('td', { class: 'num', text: r.ci_low === null ?
              '–' : `${fmt(r.ci_low)} … ${fmt(r.ci_high)}` }) },
          ], data.rows) : el('p', { class: 'muted', text: 'This eval recorded no breakdowns.' }));
        } catch (err) {
          if (mine()) box.append(el('p', { class: 'error', text: err.message }));
        }
      }

      async function rows() {
        const box = rowsBox;
        const mine = turn(box);
        const select = el('select', { id: 'rows-run', 'aria-label': 'run' },
          runsOf.map((r) => el('option', { value: r.run_id, text: `${r.run_key} (${r.arm})`,
            selected: r.run_id === state.run })));
        select.addEventListener('change', () => {
          state.run = +select.value; state.cursors = [null]; state.page = 0; rows();
        });
        const controls = el('div', { class: 'controls' }, el('label', {}, 'run ', select));
        if (state.run === null) {
          if (mine()) box.append(controls);
          return;
        }
        const q = new URLSearchParams({ eval: state.eval, limit: 25 });
        const after = state.cursors[state.page];
        if (after) q.set('after', after);
        try {
          const data = await api(`/api/v1/runs/${enc(state.run)}/predictions?${q}`);
          if (!mine()) return;
          state.cursors[state.page + 1] = data.next;
          box.append(controls, data.predictions.length ? table('rows-table', [
            { label: 'step', cell: (p) => el('td', { class: 'num',
              text: p.step === null ? 'final' : String(p.step) }) },
            ...['idx', 'example_id', 'input', 'output', 'target', 'score', 'extras'].map((c) => ({
              label: c, key: c })),
          ], data.predictions) : el('p', { class: 'muted', text: 'No rows.' }),
          el('div', { class: 'pager' },
            el('button', { type: 'button', text: '← Previous', disabled: state.page === 0,
              onclick: () => { state.page -= 1; rows(); } }),
            el('span', { class: 'muted', text: `page ${state.page + 1}` }),
            el('button', { type: 'button', text: 'Next →', disabled: !data.next,
              onclick: () => { state.page += 1; rows(); } })));
        } catch (err) {
          if (mine()) box.append(controls, el('p', { class: 'error', text: err.message }));
        }
      }

      function refresh() {
        setUrl();
        disagreements();
        breakdown();
        state.cursors = [null];
        state.page = 0;
        rows();
      }
      refresh();
    }
    load();
  }

  // -- a sweep: parallel coordinates, importance, the race ------------------------------

  const SVG_NS = 'http://www.w3.org/2000/svg';
  /** An SVG element; attributes set with setAttribute, text children as text nodes. */
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (key === 'text') node.textContent = String(v);
      else node.setAttribute(key, String(v));
    }
    append(node, children);
    return node;
  }

  /** A line's stroke: complete ones from blue (best) to red (worst), the others by state. */
  const STATE_STYLE = {
    pruned: { stroke: '#9aa0a6', dash: '5 4' },
    failed: { stroke: '#b42318', dash: '1 4' },
    running: { stroke: '#5f6b7a', dash: '8 3' },
  };

  function sweepPage(name) {
    document.title = `sweep of ${name} · lab`;
    crumbs(el('a', { href: '/', text: 'experiments' }), el('a', { href: expUrl(name), text: name }),
      'sweep');
    const base = `${API}/experiments/${enc(name)}`;

    async function load() {
      let page;
      try {
        page = await api(`${base}/sweep`);
      } catch (err) { failed(err); return; }
      const better = page.mode === 'max' ? 'higher' : 'lower';
      const coords = section('parcoords', `Parameters against ${page.metric || '–'}`);
      const importance = section('importance', 'Per-parameter importance');
      const race = section('race', 'The race');
      clear(main).append(section('sweep-head', null,
        el('div', { class: 'head-row' }, el('h1', { id: 'sweep-name', text: `Sweep of ${page.name}` })),
        el('p', { class: 'meta' }, `${page.lines.length} arms · ${page.metric || 'no metric'} ` +
          `(${better} is better) · `, el('a', { id: 'to-curves', href: expUrl(name),
          text: 'learning curves (pruned runs in grey) →' }))),
      coords, importance, race);
      drawCoords(coords, page);
      drawRace(race, page);
      if (page.trials.length) main.append(trialsSection(page));
      drawImportance(importance);
    }

    function drawCoords(box, page) {
      if (!page.lines.length) {
        box.append(el('p', { class: 'muted', text: 'No arms recorded yet.' }));
        return;
      }
      const axes = page.axes.concat([{ name: page.metric || 'value', kind: 'metric' }]);
      const values = page.lines.map((l) => num(l.value)).filter((v) => v !== null && Number.isFinite(v));
      const lo = values.length ? Math.min(...values) : 0;
      const hi = values.length ? Math.max(...values) : 1;
      const width = Math.max(480, Math.min(1300, box.clientWidth - 30));
      const height = 300;
      const top = 28;
      const bottom = height - 46;
      const x = (i) => 60 + (i * (width - 130)) / Math.max(1, axes.length - 1);
      const unit = (a, v) => {  // where value v sits on axis a: 0 (bottom) .. 1 (top), or null
        if (v === undefined) return null;
        if (a.kind === 'metric') {
          const y = num(v);
          if (y === null || !Number.isFinite(y)) return -0.12;  // no value: below the axis
          const t = hi > lo ? (y - lo) / (hi - lo) : 0.5;
          return page.mode === 'max' ? t : 1 - t;  // the better end on top
        }
        if (a.kind === 'choice') {
          const i = a.choices.findIndex((c) => JSON.stringify(c) === JSON.stringify(v));
          return a.choices.length > 1 ? i / (a.choices.length - 1) : 0.5;
        }
        const low = num(a.low);
        const high = num(a.high);
        if (high <= low) return 0.5;
        if (a.log) return (Math.log(v) - Math.log(low)) / (Math.log(high) - Math.log(low));
        return (v - low) / (high - low);
      };
      const y = (t) => bottom - t * (bottom - top);
      const chart = svg('svg', { id: 'parcoords-chart', width, height,
        viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': 'parallel coordinates' });
      const ranked = page.lines.filter((l) => l.state === 'complete' && num(l.value) !== null);
      page.lines.forEach((line) => {
        const points = axes.map((a, i) => {
          const t = unit(a, a.kind === 'metric' ? line.value : line.params[a.name]);
          return t === null ? null : [x(i), y(t)];
        });
        let d = '';
        let pen = false;
        for (const p of points) {
          if (p === null) { pen = false; continue; }
          d += `${pen ? 'L' : 'M'}${p[0].toFixed(1)},${p[1].toFixed(1)} `;
          pen = true;
        }
        const style = STATE_STYLE[line.state];
        let stroke = style ? style.stroke : '#1f5fbf';
        if (!style) {
          const t = hi > lo ? (num(line.value) - lo) / (hi - lo) : 0;
          const good = page.mode === 'max' ? t : 1 - t;
          stroke = `rgb(${Math.round(214 - 183 * good)},${Math.round(39 + 56 * good)},` +
            `${Math.round(40 + 151 * good)})`;
        }
        chart.append(svg('path', { d: d.trim(), class: `pc-line state-${line.state}`,
          fill: 'none', stroke, 'stroke-width': 2, 'stroke-dasharray': style ? style.dash : null,
          'data-arm': line.arm, 'data-state': line.state,
          'data-values': JSON.stringify(axes.map((a) => (a.kind === 'metric' ? line.value :
            (a.name in line.params ? line.params[a.name] : null)))) },
        svg('title', { text: `${line.arm} (${line.state}): ` + axes.map((a) => `${a.name}=` +
          value(a.kind === 'metric' ? line.value : line.params[a.name])).join(', ') })));
      });
      axes.forEach((a, i) => {
        const g = svg('g', { class: 'pc-axis', 'data-axis': a.name,
          'data-scale': a.kind === 'metric' ? 'metric' : a.kind === 'choice' ? 'choice' :
            a.log ? 'log' : 'linear' });
        g.append(svg('line', { x1: x(i), x2: x(i), y1: top, y2: bottom, stroke: '#1d2430' }));
        g.append(svg('text', { x: x(i), y: top - 10, 'text-anchor': 'middle', class: 'pc-name',
          text: a.name + (a.log ? ' (log)' : '') }));
        let ticks;
        if (a.kind === 'choice') ticks = a.choices.map((c) => [unit(a, c), value(c)]);
        else if (a.kind === 'metric') ticks = [[unit(a, lo), fmt(lo)], [unit(a, hi), fmt(hi)]];
        else {
          const low = num(a.low);
          const high = num(a.high);
          const mid = a.log ? Math.sqrt(low * high) : (low + high) / 2;
          ticks = [[0, fmt(low)], [0.5, fmt(a.kind === 'int' ? Math.round(mid) : mid)], [1, fmt(high)]];
        }
        if (a.kind === 'metric' && page.lines.some((l) => num(l.value) === null)) {
          ticks.push([-0.12, 'no value']);
        }
        for (const [t, label] of ticks) {
          g.append(svg('text', { x: x(i) - 6, y: y(t) + 4, 'text-anchor': 'end',
            class: 'pc-tick', text: label }));
        }
        chart.append(g);
      });
      box.append(el('div', { class: 'table-wrap' }, chart),
        el('p', { class: 'legend muted', id: 'parcoords-legend' },
          `${ranked.length} complete (blue: best ${page.metric}, red: worst)`,
          el('span', { class: 'key key-pruned', text: 'pruned' }),
          el('span', { class: 'key key-failed', text: 'failed' }),
          el('span', { class: 'key key-running', text: 'running' })));
    }

    async function drawImportance(box) {
      let data;
      try {
        data = await api(`${base}/importance`);
      } catch (err) {
        box.append(el('p', { class: 'error', text: err.message }));
        return;
      }
      if (data.unavailable) {
        box.append(el('p', { id: 'importance-unavailable', class: 'muted', text: data.unavailable }));
        return;
      }
      box.append(el('p', { class: 'muted', text: `PED-ANOVA (Optuna) over the ${data.arms} ` +
        `arms with a value of ${data.metric}; the shares sum to 1` }),
      table('importance-table', [
        { label: 'parameter', key: 'param' },
        { label: 'importance', key: 'importance' },
        { label: '', cell: (r) => el('td', { class: 'bar-cell' }, el('span', { class: 'bar',
          style: `width:${Math.max(0, Math.min(100, 100 * num(r.importance))).toFixed(1)}%` })) },
      ], data.importance));
    }

    function drawRace(box, page) {
      const race = page.race;  // lab.sweeps.report's race table, as lab show prints it
      if (race === null) {
        box.append(el('p', { id: 'race-none', class: 'muted',
          text: 'This experiment ran no race: Experiment(race=Race(...)) runs one.' }));
        return;
      }
      const rows = race.rows;
      const out = Object.fromEntries(race.eliminations.map((e) => [e.arm, e]));
      const head = el('p', { class: 'meta', id: 'race-winner' },
        race.winner !== null ? ['Winner: ', el('strong', { text: race.winner })] :
          race.over ? 'The race is over with no winner' :
            `No winner yet: ${race.survivors.length} of ${race.arms.length} arms racing`,
        ` · ${race.rounds} of ${race.race.max_repeats} rounds closed · ` +
        `${race.eliminations.length} arms eliminated by the ${race.race.test} test at alpha ` +
        `${fmt(race.race.alpha)} · ${race.runs} runs` +
        (race.pruned ? ` (${race.pruned} pruned)` : ''));
      if (!rows.length) {
        box.append(head, el('p', { class: 'muted', text: 'No round has closed yet.' }));
        return;
      }
      const arms = race.arms;
      const width = Math.max(480, Math.min(1300, box.clientWidth - 30));
      const height = 280;
      const top = 20;
      const bottom = height - 36;
      const spans = rows.flatMap((r) => [r.mean, r.ci_low, r.ci_high].map(num))
        .filter((v) => v !== null && Number.isFinite(v));
      const lo = spans.length ? Math.min(...spans) : 0;
      const hi = spans.length ? Math.max(...spans) : 1;
      const y = (v) => (hi > lo ? bottom - ((v - lo) * (bottom - top)) / (hi - lo) :
        (top + bottom) / 2);
      const step = (width - 110) / Math.max(1, race.rounds);
      const x = (round, i) => 70 + step * (round + 0.5) +
        (arms.length > 1 ? (i / (arms.length - 1) - 0.5) * step * 0.5 : 0);
      const chart = svg('svg', { id: 'race-chart', width, height,
        viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': 'the race by round' });
      chart.append(svg('line', { x1: 60, x2: 60, y1: top, y2: bottom, stroke: '#1d2430' }));
      chart.append(svg('text', { x: 54, y: top + 4, 'text-anchor': 'end', class: 'pc-tick',
        text: fmt(hi) }), svg('text', { x: 54, y: bottom, 'text-anchor': 'end',
        class: 'pc-tick', text: fmt(lo) }));
      for (let r = 0; r < race.rounds; r++) {
        chart.append(svg('text', { x: 70 + step * (r + 0.5), y: height - 12, 'text-anchor': 'middle',
          class: 'pc-tick', text: `round ${r}` }));
      }
      arms.forEach((arm, i) => {
        const color = COLORS[i % COLORS.length];
        const g = svg('g', { class: 'race-arm', 'data-arm': arm });
        let path = '';
        for (const row of rows.filter((r) => r.arm === arm)) {
          const mean = num(row.mean);
          if (mean === null || !Number.isFinite(mean)) continue;
          const cx = x(row.round, i);
          path += `${path ? 'L' : 'M'}${cx.toFixed(1)},${y(mean).toFixed(1)} `;
          const low = num(row.ci_low);
          const high = num(row.ci_high);
          if (low !== null && high !== null && Number.isFinite(low) && Number.isFinite(high)) {
            g.append(svg('line', { class: 'race-ci', x1: cx, x2: cx, y1: y(low), y2: y(high),
              stroke: color, 'stroke-width': 2, 'data-round': row.round,
              'data-low': JSON.stringify(row.ci_low), 'data-high': JSON.stringify(row.ci_high) }));
          }
          // a round whose run counted no value (pruned, failed) is a hollow mark
          const counted = row.value !== null;
          g.append(svg('circle', { class: 'race-mean', cx, cy: y(mean), r: 3.5,
            fill: counted ? color : '#fff', stroke: color, 'data-round': row.round,
            'data-mean': JSON.stringify(row.mean), 'data-n': row.n, 'data-status': row.status },
          svg('title', { text: `${arm}, round ${row.round} (${row.status}): mean ${fmt(mean)} ` +
            `(n ${row.n})` })));
          const gone = row.eliminated ? out[arm] : undefined;
          if (gone) {
            const cy = y(mean);
            g.append(svg('path', { class: 'race-out', d: `M${cx - 6},${cy - 6}L${cx + 6},${cy + 6}` +
              `M${cx - 6},${cy + 6}L${cx + 6},${cy - 6}`, stroke: '#b42318', 'stroke-width': 2.5,
            'data-round': gone.round, 'data-p': JSON.stringify(gone.p_value) }),
            svg('text', { class: 'race-out-label', x: cx + 8, y: cy - 8,
              text: `out: p=${fmt(gone.p_value)}` }));
          }
        }
        g.prepend(svg('path', { d: path.trim(), fill: 'none', stroke: color, 'stroke-width': 1,
          'stroke-opacity': 0.6 }));
        chart.append(g);
      });
      const legend = el('div', { class: 'legend', id: 'race-legend' }, arms.map((arm, i) =>
        el('span', { class: 'legend-arm' }, el('span', { class: 'swatch',
          style: `background:${COLORS[i % COLORS.length]}` }), arm,
        arm === race.winner ? el('span', { class: 'best-mark', text: ' ★ winner' }) : null)));
      box.append(head, el('div', { class: 'table-wrap' }, chart), legend,
        race.eliminations.length ? table('eliminations-table', [
          { label: 'arm', key: 'arm' }, { label: 'after round', key: 'round' },
          { label: 'test', key: 'test' }, { label: 'statistic', key: 'statistic' },
          { label: 'p (Holm)', key: 'p_value' }, { label: 'against', key: 'best' },
        ], race.eliminations, (e) => ({ dataset: { arm: e.arm } })) : null,
        el('details', {}, el('summary', { text: 'Each arm, round by round' }),
          table('race-table', [
            { label: 'arm', key: 'arm' }, { label: 'round', key: 'round' },
            { label: 'status', cell: (r) => el('td', {}, badge(r.status)) },
            { label: 'value', key: 'value' }, { label: 'n', key: 'n' },
            { label: 'mean', key: 'mean' }, { label: '95% CI low', key: 'ci_low' },
            { label: '95% CI high', key: 'ci_high' },
            { label: 'p (if dropped)', cell: (r) => cell(r.eliminated && out[r.arm] ?
              out[r.arm].p_value : null) },
          ], rows, (r) => ({ class: r.eliminated ? 'eliminated' : null,
            dataset: { arm: r.arm, round: r.round } }))));
    }

    function trialsSection(page) {
      const keys = page.axes.map((a) => a.name);
      return section('trials', 'Trials', table('trials-table', [
        { label: '#', key: 'number' }, { label: 'arm', key: 'arm' },
        { label: 'state', cell: (t) => el('td', {}, badge(t.state === 'complete' ? 'completed' :
          t.state)) },
        ...keys.map((k) => ({ label: k, cell: (t) => cell(k in t.params ? t.params[k] : null) })),
        { label: 'value', key: 'value' },
      ], page.trials, (t) => ({ dataset: { arm: t.arm, state: t.state } })));
    }

    load();
  }

  // -- routing --------------------------------------------------------------------------

  function route() {
    setupLogout();
    if (body.dataset.auth === '1' && body.dataset.signedIn !== '1') {
      tokenPrompt('');
      return;
    }
    const path = location.pathname;
    let m;
    if (path === '/') experimentsPage();
    else if ((m = path.match(/^\/experiments\/(.+)\/predictions$/))) predictionsPage(decode(m[1]));
    else if ((m = path.match(/^\/experiments\/(.+)\/sweep$/))) sweepPage(decode(m[1]));
    else if ((m = path.match(/^\/experiments\/(.+)$/))) experimentPage(decode(m[1]));
    else if ((m = path.match(/^\/runs\/([^/]+)$/))) runPage(decode(m[1]));
    else notFound(`no page at ${path}`);
  }

  function decode(part) {
    try { return decodeURIComponent(part); } catch (_err) { return part; }
  }

  route();
})();

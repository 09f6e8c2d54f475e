// The gpusched dashboard: reads the HTTP API with the bearer token kept in this tab's
// sessionStorage, follows /v1/dashboard/events (fetch streaming, so the token travels in
// the Authorization header, never in a URL) and refreshes everything now and then in
// case an event was missed. Every piece of job-provided text goes in through
// textContent: nothing here parses HTML.
'use strict';

const TOKEN_KEY = 'gpusched.token';
// the whole state is read again this often, events or not
const REFRESH_MS = 10000;
// a burst of events causes one read of what they changed
const SETTLE_MS = 250;
// scheduling rounds re-read the scheduler's status at most this often
const SCHEDULER_MS = 2000;
// a node agent samples its GPUs every second: a second read of the cluster this long
// after a job's state event shows the GPUs it left or took as they read now
const TELEMETRY_MS = 1500;
const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 15000;
const TERMINAL = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED']);
const WAITING = new Set(['QUEUED', 'PREEMPTED']);
const FINISHED_SHOWN = 20;

const page = {
  token: null,
  jobs: new Map(),      // id -> record of the tenant's unfinished jobs
  finished: [],         // records of the tenant's jobs seen finishing, newest first
  selected: null,       // id of the job shown in detail
  selectedRecord: null,
  leader: null,
  stream: null,         // AbortController of the event stream
  timers: new Map(),
  refresher: null,
  reconnectMs: RECONNECT_MIN_MS,
};

// ---------------------------------------------------------------- DOM helpers

function $(id) { return document.getElementById(id); }

// el('td', {className: 'x', dataset: {jobId: id}}, 'text', child): children that are
// strings become text nodes
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key === 'onclick') node.addEventListener('click', value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === 'string' || typeof child === 'number'
      ? document.createTextNode(String(child)) : child);
  }
  return node;
}

function replace(container, children) {
  container.replaceChildren(...children);
}

function clock(at) {
  return at ? new Date(at * 1000).toLocaleTimeString() : '–';
}

function duration(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function shortId(id) { return id.length > 12 ? `${id.slice(0, 4)}…${id.slice(-6)}` : id; }

function placementText(placement) {
  return (placement || []).map((p) => `${p.node}: GPU ${p.gpus.join(',')}`).join('; ');
}

function progressBar(record) {
  const total = record.total_iterations || 0;
  const done = (record.progress && record.progress.iteration) || 0;
  const fraction = total ? Math.min(1, done / total) : 0;
  const fill = el('div', {className: 'fill'});
  fill.style.width = `${(fraction * 100).toFixed(1)}%`;
  return el('div', {className: 'progress', title: `${done} / ${total} iterations`},
    fill, el('span', {}, `${done} / ${total}`));
}

// ---------------------------------------------------------------- the API

class SignedOut extends Error {}

async function api(path) {
  const response = await fetch(path, {
    headers: {Authorization: `Bearer ${page.token}`, Accept: 'application/json'},
    cache: 'no-store',
  });
  if (response.status === 401) throw new SignedOut('the token was refused');
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

async function unfinishedJobs() {
  const jobs = [];
  let after = null;
  for (let pages = 0; pages < 20; pages += 1) {
    const query = new URLSearchParams({state: 'QUEUED,PREEMPTED,RUNNING', limit: '1000'});
    if (after) query.set('after', after);
    const answer = await api(`/v1/jobs?${query}`);
    jobs.push(...answer.jobs);
    if (!answer.next) break;
    after = answer.next;
  }
  return jobs;
}

// ---------------------------------------------------------------- rendering

function jobLink(id, label) {
  return el('a', {href: '#', className: 'job-link', dataset: {jobId: id},
    onclick: (event) => { event.preventDefault(); select(id); }}, label);
}

function renderJobs() {
  const jobs = [...page.jobs.values()];
  const now = Date.now() / 1000;
  const waiting = jobs.filter((j) => WAITING.has(j.state));
  const running = jobs.filter((j) => j.state === 'RUNNING');
  replace($('queue-body'), waiting.map((job) => {
    const since = job.history.length ? job.history[job.history.length - 1].at : job.submitted_at;
    return el('tr', {dataset: {jobId: job.id, state: job.state}},
      el('td', {}, jobLink(job.id, shortId(job.id))),
      el('td', {className: 'name'}, job.spec.name),
      el('td', {}, el('span', {className: `state ${job.state}`}, job.state)),
      el('td', {}, job.gpus || job.spec.gpus),
      el('td', {}, duration(now - since)),
      el('td', {className: 'reason'}, job.pending_reason));
  }));
  replace($('running-body'), running.map((job) => el('tr', {dataset: {jobId: job.id}},
    el('td', {}, jobLink(job.id, shortId(job.id))),
    el('td', {className: 'name'}, job.spec.name),
    el('td', {className: 'placement'}, placementText(job.placement)),
    el('td', {}, progressBar(job)),
    el('td', {}, job.progress.samples_per_s ? job.progress.samples_per_s.toFixed(0) : '–'))));
  replace($('finished-body'), page.finished.map((job) => el('tr', {dataset: {jobId: job.id}},
    el('td', {}, jobLink(job.id, shortId(job.id))),
    el('td', {className: 'name'}, job.spec.name),
    el('td', {}, el('span', {className: `state ${job.state}`}, job.state)),
    el('td', {}, clock(job.history.length ? job.history[job.history.length - 1].at : 0)))));
  $('queue-count').textContent = `(${waiting.length})`;
  $('running-count').textContent = `(${running.length})`;
}

function renderCluster(cluster) {
  const t = cluster.totals;
  // busy now by the job records; the DCGM figure is a mean over a stated window, so a
  // job that just ended does not leave "100 %" beside GPUs that are idle
  const share = t.gpus ? Math.round((100 * t.busy_gpus) / t.gpus) : 0;
  $('totals').textContent = `${t.nodes} nodes, ${t.busy_gpus}/${t.gpus} GPUs busy now (${share} %)` +
    (t.window_gpu_util === null || t.window_gpu_util === undefined ? ''
      : `, DCGM utilisation ${t.window_gpu_util.toFixed(0)} % over the last ${t.util_window_s.toFixed(0)} s`);
  replace($('nodes'), cluster.nodes.map((node) => {
    const gpus = node.gpus.map((gpu) => {
      const chips = gpu.jobs.map((id) => {
        const own = page.jobs.get(id);
        const label = own ? `${own.spec.name} · ${shortId(id)}` : `${shortId(id)} (other tenant)`;
        return own
          ? el('a', {href: '#', className: 'job-chip', dataset: {jobId: id}, title: id,
            onclick: (event) => { event.preventDefault(); select(id); }}, label)
          : el('span', {className: 'job-chip foreign', dataset: {jobId: id}, title: id}, label);
      });
      const util = gpu.telemetry ? gpu.telemetry.DCGM_FI_DEV_GPU_UTIL : null;
      const bar = el('div', {className: 'util'});
      bar.style.width = `${util === null ? 0 : Math.min(100, util)}%`;
      const classes = ['gpu', gpu.jobs.length ? 'busy' : 'idle'];
      if (gpu.jobs.length > 1) classes.push('shared');
      return el('div', {className: classes.join(' '),
        dataset: {node: node.name, gpu: String(gpu.index), jobs: String(gpu.jobs.length)}},
      el('div', {className: 'gpu-head'}, `GPU ${gpu.index}`,
        el('span', {className: 'muted'}, ` ${gpu.model} · ${(gpu.memory_mb / 1024).toFixed(0)} GB`),
        gpu.jobs.length > 1 ? el('span', {className: 'badge'}, 'shared') : null),
      el('div', {className: 'util-track', title: util === null ? 'no telemetry' : `${util} %`}, bar),
      el('div', {className: 'chips'}, ...(chips.length ? chips : [el('span', {className: 'muted'}, 'idle')])));
    });
    return el('div', {className: 'node', dataset: {node: node.name}},
      el('div', {className: 'node-head'}, el('b', {}, node.name),
        el('span', {className: 'muted'},
          ` ${node.cpus} CPUs · ${node.host_mem_gb.toFixed(0)} GB` +
          (node.emulated ? ' · emulated' : '') +
          (node.telemetry_at ? ` · telemetry ${clock(node.telemetry_at)}` : ''))),
      el('div', {className: 'gpus'}, ...gpus));
  }));
}

function renderScheduler(view) {
  page.leader = view.leader;
  $('leader').textContent = view.leader || 'none';
  $('policy').textContent = view.policy || '–';
  $('rounds').textContent = view.rounds === null || view.rounds === undefined ? '–' : String(view.rounds);
}

function renderDecision(decision) {
  $('decision').textContent = `last round ${clock(decision.at)}: ${decision.started} started, ` +
    `${decision.preempted} preempted, ${decision.pending} waiting (${decision.decide_ms.toFixed(1)} ms)`;
  $('policy').textContent = decision.policy;
}

function renderSubmissions(view) {
  const peak = Math.max(1, ...view.counts);
  const bucketMinutes = view.bucket_s / 60;
  replace($('throughput'), view.counts.map((count, i) => {
    const bar = el('div', {className: 'bar',
      title: `${clock(view.end - (view.counts.length - i) * view.bucket_s)}: ${count}`});
    bar.style.height = `${(count / peak) * 100}%`;
    return bar;
  }));
  $('throughput-total').textContent =
    `(${view.total} in the last ${view.counts.length * bucketMinutes} min, peak ${Math.max(0, ...view.counts)}/min)`;
}

function renderDetail() {
  const job = page.selectedRecord;
  const body = $('detail-body');
  if (!job) { replace(body, []); return; }
  $('detail-title').textContent = `${job.spec.name} (${job.id})`;
  const rows = [
    ['state', el('span', {className: `state ${job.state}`}, job.state)],
    ['model', `${job.spec.model}, batch ${job.batch_size || job.spec.batch_size}, ` +
      `${job.gpus || job.spec.gpus} GPU(s)`],
    ['submitted', clock(job.submitted_at)],
    ['placement', placementText(job.placement) || '–'],
    ['shares with', (job.shares_with || []).join(', ') || '–'],
    ['progress', progressBar(job)],
    ['samples/s', job.progress.samples_per_s ? job.progress.samples_per_s.toFixed(1) : '–'],
    ['attempts', `${job.attempts} (preempted ${job.preemptions} times)`],
  ];
  if (WAITING.has(job.state)) rows.push(['pending reason', job.pending_reason]);
  if (job.error) rows.push(['error', job.error]);
  const labels = Object.entries(job.spec.labels || {}).map(([k, v]) => `${k}=${v}`).join(', ');
  if (labels) rows.push(['labels', labels]);
  replace(body, [
    el('dl', {}, ...rows.flatMap(([k, v]) => [el('dt', {}, k), el('dd', {}, v)])),
    el('h3', {}, 'History'),
    el('ol', {id: 'history', className: 'history'}, ...job.history.map((h) =>
      el('li', {}, el('time', {}, clock(h.at)), ' ',
        el('span', {className: `state ${h.state}`}, h.state), ' ', h.reason))),
  ]);
}

function setConnection(state, text) {
  const badge = $('connection');
  badge.dataset.state = state;
  badge.textContent = text;
}

// ---------------------------------------------------------------- reading

async function guarded(work) {
  try {
    await work();
  } catch (error) {
    if (error instanceof SignedOut) signOut(error.message);
    else console.warn(error);
  }
}

// runs work once after delayMs however often it is asked for meanwhile
function later(name, work, delayMs = SETTLE_MS) {
  if (page.timers.has(name)) return;
  page.timers.set(name, setTimeout(() => {
    page.timers.delete(name);
    guarded(work);
  }, delayMs));
}

async function refreshJobs() {
  const jobs = await unfinishedJobs();
  const seen = new Set(jobs.map((j) => j.id));
  for (const id of page.jobs.keys()) {
    if (!seen.has(id)) await noteFinished(id);
  }
  page.jobs = new Map(jobs.map((j) => [j.id, j]));
  renderJobs();
}

async function noteFinished(id) {
  if (page.finished.some((j) => j.id === id)) return;
  try {
    const record = await api(`/v1/jobs/${encodeURIComponent(id)}`);
    if (TERMINAL.has(record.state)) {
      page.finished.unshift(record);
      page.finished.length = Math.min(page.finished.length, FINISHED_SHOWN);
    }
  } catch (error) {
    if (error instanceof SignedOut) throw error;
  }
}

async function refreshCluster() { renderCluster(await api('/v1/cluster')); }
async function refreshScheduler() { renderScheduler(await api('/v1/dashboard/scheduler')); }
async function refreshSubmissions() { renderSubmissions(await api('/v1/dashboard/submissions')); }

async function refreshDetail() {
  if (!page.selected) return;
  page.selectedRecord = await api(`/v1/jobs/${encodeURIComponent(page.selected)}`);
  renderDetail();
}

async function refreshAll() {
  await refreshJobs();
  await Promise.all([refreshCluster(), refreshScheduler(), refreshSubmissions(), refreshDetail()]);
}

function select(id) {
  page.selected = id;
  page.selectedRecord = page.jobs.get(id) || page.finished.find((j) => j.id === id) || null;
  renderDetail();
  guarded(refreshDetail);
}

// ---------------------------------------------------------------- the event stream

function onEvent(kind, data) {
  if (kind === 'state') {
    const job = page.jobs.get(data.job_id);
    if (job) {
      job.state = data.state;
      if (data.placement) job.placement = data.placement;
      if (WAITING.has(data.state) && data.reason) job.pending_reason = data.reason;
      renderJobs();
    }
    later('jobs', async () => { await refreshJobs(); await refreshCluster(); });
    later('cluster-telemetry', refreshCluster, TELEMETRY_MS);
    later('submissions', refreshSubmissions);
    if (data.job_id === page.selected) later('detail', refreshDetail);
  } else if (kind === 'progress') {
    const job = page.jobs.get(data.job_id);
    if (job) {
      job.progress = data.progress;
      later('render', async () => renderJobs());
    }
    if (data.job_id === page.selected && page.selectedRecord) {
      page.selectedRecord.progress = data.progress;
      later('render-detail', async () => renderDetail());
    }
  } else if (kind === 'cluster') {
    later('cluster', refreshCluster);
  } else if (kind === 'decision') {
    renderDecision(data);
    // a new leader at once; the leader's round count at most every SCHEDULER_MS
    later('scheduler', refreshScheduler, data.instance !== page.leader ? SETTLE_MS : SCHEDULER_MS);
  }
}

function parseBlock(block) {
  let kind = 'message';
  const data = [];
  for (const line of block.split('\n')) {
    if (line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'event') kind = value;
    else if (field === 'data') data.push(value);
  }
  if (data.length) onEvent(kind, JSON.parse(data.join('\n')));
}

async function follow() {
  const controller = new AbortController();
  page.stream = controller;
  try {
    const response = await fetch('/v1/dashboard/events', {
      headers: {Authorization: `Bearer ${page.token}`, Accept: 'text/event-stream'},
      cache: 'no-store',
      signal: controller.signal,
    });
    if (response.status === 401) { signOut('the token was refused'); return; }
    if (!response.ok) throw new Error(`event stream: ${response.status}`);
    setConnection('live', 'live');
    page.reconnectMs = RECONNECT_MIN_MS;
    // events may have passed while the stream was down
    guarded(refreshAll);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        try { parseBlock(block); } catch (error) { console.warn(error); }
      }
    }
  } catch (error) {
    if (controller.signal.aborted) return;
    console.warn(error);
  }
  if (page.stream !== controller) return;
  setConnection('retry', `reconnecting, polling every ${REFRESH_MS / 1000} s`);
  setTimeout(() => { if (page.stream === controller) follow(); }, page.reconnectMs);
  page.reconnectMs = Math.min(RECONNECT_MAX_MS, page.reconnectMs * 2);
}

// ---------------------------------------------------------------- signing in and out

function start(token) {
  page.token = token;
  $('login').hidden = true;
  $('board').hidden = false;
  $('sign-out').hidden = false;
  setConnection('connecting', 'connecting');
  guarded(refreshAll);
  page.refresher = setInterval(() => guarded(refreshAll), REFRESH_MS);
  follow();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  page.token = null;
  if (page.stream) page.stream.abort();
  page.stream = null;
  clearInterval(page.refresher);
  for (const timer of page.timers.values()) clearTimeout(timer);
  page.timers.clear();
  $('board').hidden = true;
  $('sign-out').hidden = true;
  $('login').hidden = false;
  $('login-error').textContent = message || '';
  setConnection('off', 'signed out');
}

async function signIn(event) {
  event.preventDefault();
  const token = $('token').value.trim();
  if (!token) return;
  const response = await fetch('/v1/dashboard/scheduler', {
    headers: {Authorization: `Bearer ${token}`}, cache: 'no-store'});
  if (response.status === 401) {
    $('login-error').textContent = 'the token was refused';
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  $('token').value = '';
  $('login-error').textContent = '';
  start(token);
}

document.addEventListener('DOMContentLoaded', () => {
  $('login-form').addEventListener('submit', signIn);
  $('sign-out').addEventListener('click', () => signOut(''));
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) start(token);
});

// llmgw status pages: reads the admin API's JSON (the data ctl reads) and polls it.
// Every value is put in the page with textContent or an attribute, never as HTML, so a name
// like "<script>" shows as text. No inline script or style: the Content-Security-Policy allows
// only this file and app.css.
"use strict";

const POLL_MS = 2000; // an operator's page: fresh enough to watch a replica come up
const USAGE_POLL_MS = 10000; // usage is a query on the store; it changes slowly
const SVG = "http://www.w3.org/2000/svg";

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(headers, rows, id) {
  const head = el("tr", {}, ...headers.map((h) => el("th", { class: h.num ? "num" : null, text: h.label || h })));
  const body = rows.length
    ? rows.map((cells) => el("tr", {}, ...cells.map((c, i) =>
        el("td", { class: headers[i].num ? "num" : null }, c === null || c === undefined ? "—" : c))))
    : [el("tr", {}, el("td", { colspan: headers.length, class: "muted", text: "none" }))];
  return el("table", { id }, el("thead", {}, head), el("tbody", {}, ...body));
}

function state(value) {
  return el("span", { class: "state state-" + String(value).replace(/[^A-Za-z]/g, ""), text: value });
}

function num(value, digits) {
  if (value === null || value === undefined) return "—";
  return Number(value).toFixed(digits === undefined ? 0 : digits);
}

function age(since) {
  if (!since) return "—";
  let s = Math.max(0, Math.floor(Date.now() / 1000 - since));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  s = Math.floor(s / 60);
  if (s < 1440) return Math.floor(s / 60) + "h " + (s % 60) + "m";
  return Math.floor(s / 1440) + "d " + Math.floor((s % 1440) / 60) + "h";
}

function when(t) {
  return t ? new Date(t * 1000).toLocaleString() : "—";
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (response.status === 401) {
    window.location.assign("/"); // the session expired or was closed: back to the login form
    throw new Error("logged out");
  }
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function card(label, value, detail, id) {
  return el("div", { class: "card", id },
    el("div", { class: "label", text: label }),
    el("div", { class: "value", text: value }),
    detail ? el("div", { class: "detail", text: detail }) : null);
}

function sparkline(label, points, key, digits, id) {
  const values = points.map((p) => Number(p[key]) || 0);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 100 30");
  svg.setAttribute("preserveAspectRatio", "none");
  const max = Math.max(1e-9, ...values);
  if (values.length > 1) {
    const line = document.createElementNS(SVG, "polyline");
    const step = 100 / (values.length - 1);
    line.setAttribute("points", values.map((v, i) => `${(i * step).toFixed(2)},${(29 - (v / max) * 28).toFixed(2)}`).join(" "));
    svg.append(line);
  }
  const last = values.length ? values[values.length - 1] : null;
  return el("div", { class: "card chart", id },
    el("div", { class: "label", text: label }),
    el("div", { class: "detail", text: last === null ? "no samples yet" : "now " + num(last, digits) + ", max " + num(max, digits) }),
    svg);
}

function bars(label, entries, id) {
  // entries: [[label, value]]; one bar per entry, scaled to the largest.
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 100 30");
  svg.setAttribute("preserveAspectRatio", "none");
  const max = Math.max(1, ...entries.map((e) => e[1]));
  const width = entries.length ? 100 / entries.length : 100;
  entries.forEach(([name, value], i) => {
    const rect = document.createElementNS(SVG, "rect");
    const h = (value / max) * 29;
    rect.setAttribute("x", (i * width + width * 0.1).toFixed(2));
    rect.setAttribute("width", (width * 0.8).toFixed(2));
    rect.setAttribute("y", (30 - h).toFixed(2));
    rect.setAttribute("height", h.toFixed(2));
    const title = document.createElementNS(SVG, "title");
    title.textContent = name + ": " + value;
    rect.append(title);
    svg.append(rect);
  });
  return el("div", { class: "card chart", id }, el("div", { class: "label", text: label }), svg);
}

// --- pages ---------------------------------------------------------------------------------

const pages = {
  async overview() {
    const o = await getJSON("/admin/v1/overview");
    const points = o.series.points;
    const latest = points.length ? points[points.length - 1] : null;
    const gpuUsed = Object.values(o.gpus).reduce((a, g) => a + g.used, 0);
    const gpuTotal = Object.values(o.gpus).reduce((a, g) => a + g.total, 0);
    const states = Object.entries(o.replicas).filter(([k]) => k !== "total");
    const totals = o.series.totals;
    const rate = (key) => (totals && latest ? num(latest[key], 2) : "—");
    const since = (key) => (totals ? num(totals[key]) + " since start" : o.series.traffic_reported ? "no sample yet" : "not reported by the gateway workers");
    const span = points.length * o.series.interval;
    return [
      el("div", { class: "cards" },
        card("Nodes online", o.nodes.online || 0, (o.nodes.lost || 0) + " lost of " + o.nodes.total, "card-nodes"),
        card("GPUs used", gpuUsed + " / " + gpuTotal, (gpuTotal - gpuUsed) + " not in use", "card-gpus"),
        card("Replicas ready", o.replicas.Ready || 0, states.map(([k, v]) => k + " " + v).join(", ") || "none", "card-replicas"),
        card("Requests/s", rate("request_rate"), since("requests"), "card-rate"),
        card("Errors/s", rate("error_rate"), since("errors"), "card-errors"),
        card("Queue depth", o.queue_depth, "requests waiting at the gateway", "card-queue"),
        card("SLO violations/s", rate("slo_violation_rate"), since("slo_violations"), "card-slo")),
      el("h2", { text: "Over the last " + (span < 120 ? span + " seconds" : Math.round(span / 60) + " minutes") }),
      el("div", { class: "charts" },
        sparkline("Requests/s", points, "request_rate", 2, "chart-rate"),
        sparkline("Errors/s", points, "error_rate", 2, "chart-errors"),
        sparkline("Queue depth", points, "queue_depth", 0, "chart-queue"),
        sparkline("Ready replicas", points, "ready_replicas", 0, "chart-ready"),
        sparkline("GPUs used", points, "gpus_used", 0, "chart-gpus")),
      el("h2", { text: "GPUs by class" }),
      table(["Class", { label: "Total", num: 1 }, { label: "Used", num: 1 }, { label: "Free", num: 1 }, { label: "Unhealthy", num: 1 }],
        Object.entries(o.gpus).map(([k, g]) => [k, g.total, g.used, g.free, g.unhealthy]), "gpu-classes"),
      el("h2", { text: o.replica_rows.length < o.replicas.total
        ? "Replicas (" + o.replica_rows.length + " of " + o.replicas.total + ", those not Ready first)" : "Replicas" }),
      table(["Replica", "Profile", "Model", "State", "On", "Age"],
        o.replica_rows.map((r) => [r.id, r.profile, r.model, state(r.state), r.nodes.join(", ") || "—", age(r.created)]), "replicas"),
    ];
  },

  async nodes() {
    const { nodes } = await getJSON("/admin/v1/nodes");
    return [el("h2", { text: nodes.length + " nodes" }), ...nodes.map((n) => {
      const onCard = {};
      for (const shard of n.shards) {
        for (const g of (shard.spec && shard.spec.gpus) || []) {
          (onCard[g.index] = onCard[g.index] || []).push(shard.replica_id + " (" + shard.state + ")");
        }
      }
      const inv = n.inventory;
      return el("section", { class: "node", "data-node": n.name },
        el("h2", {}, n.name + " ", state(n.state),
          el("span", { class: "muted", text: "  " + (inv.fabric ? "fabric " + inv.fabric + " · " : "") +
            (inv.mgmt_address || "") + " · agent " + n.agent_version + " · seen " + age(n.last_seen) + " ago" +
            (inv.simulated ? " · simulated GPUs" : "") })),
        inv.gpus.length
          ? table(["GPU", "Name", "Class", { label: "Memory used / total MiB", num: 1 }, "Health", "Runs"],
            inv.gpus.map((g) => [g.index, g.name, g.gpu_class, g.memory_used_mib + " / " + g.memory_total_mib,
              g.problems.length ? g.problems.join(", ") : "ok", (onCard[g.index] || []).join(", ") || "—"]))
          : el("p", { class: "muted", text: "no GPUs" + (inv.gpu_note ? ": " + inv.gpu_note : "") +
            (n.shards.length ? " · runs " + n.shards.map((s) => s.replica_id + " (" + s.state + ")").join(", ") : "") }));
    })];
  },

  async replicas() {
    const [{ replicas }, { profiles }] = await Promise.all([getJSON("/admin/v1/replicas"), getJSON("/admin/v1/profiles")]);
    return [el("h2", { text: replicas.length + " replicas" }), replicaTable(replicas, profiles)];
  },

  async models() {
    const [{ models }, { profiles }] = await Promise.all([getJSON("/admin/v1/models"), getJSON("/admin/v1/profiles")]);
    return [
      el("h2", { text: "Models" }),
      table(["Name", "Path", "Used by", "Source"], models.map((m) => [m.name, m.path || m.model_path || "", (m.used_by || []).join(", "), m.source]), "models"),
      el("h2", { text: "Profiles" }),
      table(["Name", "Model", "Engine", "GPU class", { label: "GPUs", num: 1 }, "Replicas (min–max)", "Wanted", "Adapters"],
        profiles.map((p) => [p.name, p.model, p.engine, p.gpu_class || "—", p.gpus_per_node !== undefined ? p.gpus_per_node : p.gpus,
          p.min_replicas + "–" + p.max_replicas,
          p.scale.wanted === null ? "—" : p.scale.wanted + (p.scale.reason ? " (" + p.scale.reason + ")" : ""),
          (p.adapters || []).map((a) => a.name || a).join(", ")]), "profiles"),
    ];
  },

  async queue() {
    const { queue } = await getJSON("/admin/v1/queue");
    return [el("h2", { text: "Requests waiting at the gateway" }),
      table(["Model", { label: "Band", num: 1 }, { label: "Waiting", num: 1 }], queue.map((q) => [q.model, q.band, q.waiting]), "queue")];
  },

  async jobs() {
    const { jobs } = await getJSON("/admin/v1/jobs");
    return [el("h2", { text: jobs.length + " training jobs" }),
      table(["Job", "Adapter", "Model", "Node", "State", "Progress", { label: "Step", num: 1 }, { label: "Loss", num: 1 }, { label: "Peak MiB", num: 1 }],
        jobs.map((j) => {
          const total = j.total_steps || 0;
          const bar = el("progress", { max: total || 1, value: total ? j.step : 0, "data-job": j.id });
          return [j.id, j.adapter, j.model, j.node, el("span", {}, state(j.state), j.reason ? el("div", { class: "muted", text: j.reason }) : null),
            el("span", {}, bar, " " + (total ? Math.round((100 * j.step) / total) + "%" : "")), (j.step || 0) + (total ? " / " + total : ""),
            j.loss === null ? "—" : num(j.loss, 4), j.peak_mib];
        }), "jobs")];
  },

  usage: null, // set below: it keeps its range form between polls

  async events() {
    const { events } = await getJSON("/admin/v1/events");
    return [el("h2", { text: "Recent reconcile actions (newest first)" }),
      table(["When", "Action", "Subject", "Reason"], events.slice().reverse().map((e) => [when(e.at), e.kind, e.subject, e.reason]), "events")];
  },
};

function replicaTable(replicas, profiles) {
  const adapters = {};
  for (const p of profiles) adapters[p.name] = (p.adapters || []).map((a) => a.name || a).join(", ");
  const headers = ["Replica", "Profile", "Model", "State", "On", "Endpoint", "Load", "Age", "Adapters", "Why"];
  return table(headers, replicas.map((r) => {
    // A Pending replica: every node's reason for not taking it.
    const why = r.candidates.length
      ? el("span", {}, r.reason, el("ul", { class: "reasons" }, ...r.candidates.map((c) => el("li", {}, el("b", { text: c.node }), ": " + c.reason))))
      : r.reason || "";
    const load = r.load
      ? r.load.running + " running, " + r.load.waiting + " waiting, " + Math.round(100 * r.load.saturation) + "% full"
      : "—";
    return [r.id, r.profile, r.model, state(r.state), r.shards.map((s) => s.node).join(", ") || "—", r.endpoint,
      load, age(r.created), adapters[r.profile] || "—", why];
  }), "replicas");
}

function usagePage(main) {
  const today = new Date();
  const iso = (d) => d.toISOString().slice(0, 10);
  const since = el("input", { type: "date", id: "since", value: iso(new Date(today - 6 * 86400000)) });
  const until = el("input", { type: "date", id: "until", value: iso(today) });
  const show = el("button", { type: "submit", text: "Show" });
  const form = el("form", { class: "range", id: "range" }, el("label", {}, "From", since), el("label", {}, "To", until), show);
  const out = el("div", { id: "usage-out" });
  main.replaceChildren(el("h2", { text: "Usage per tenant and model" }), form, out);
  async function load() {
    const q = "since=" + encodeURIComponent(since.value) + "&until=" + encodeURIComponent(until.value);
    const [byDay, byTenant, { tenants }] = await Promise.all([
      getJSON("/admin/v1/usage?by=day&" + q), getJSON("/admin/v1/usage?by=tenant,model&" + q), getJSON("/admin/v1/tenants")]);
    out.replaceChildren(
      el("div", { class: "charts" }, bars("Tokens per day", byDay.usage.map((u) => [u.day, u.total_tokens]), "chart-usage")),
      el("h2", { text: "By tenant and model" }),
      table(["Tenant", "Model", { label: "Requests", num: 1 }, { label: "Prompt tokens", num: 1 }, { label: "Completion tokens", num: 1 }, { label: "Errors", num: 1 }, { label: "Avg latency ms", num: 1 }],
        byTenant.usage.map((u) => [u.tenant, u.model, u.requests, u.prompt_tokens, u.completion_tokens, u.errors, num(u.avg_latency_ms, 1)]), "usage"),
      el("h2", { text: "Tenants" }),
      table(["Tenant", { label: "Active keys", num: 1 }, "Created"], tenants.map((t) => [t.name, t.active_keys, when(t.created)]), "tenants"));
  }
  form.addEventListener("submit", (event) => { event.preventDefault(); tick(load); });
  return load;
}

// --- the loop ------------------------------------------------------------------------------

async function tick(load) {
  const error = document.getElementById("error");
  try {
    await load();
    error.textContent = "";
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
  } catch (e) {
    error.textContent = "could not update: " + e.message;
  }
}

function start() {
  const page = document.body.dataset.page;
  const main = document.getElementById("main");
  for (const link of document.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === page) link.classList.add("current");
  }
  let load;
  let every = POLL_MS;
  if (page === "usage") {
    load = usagePage(main);
    every = USAGE_POLL_MS;
  } else {
    load = async () => main.replaceChildren(...(await pages[page]()));
  }
  let running = false;
  const run = async () => {
    if (running) return; // a slow answer: skip a beat rather than pile up requests
    running = true;
    try { await tick(load); } finally { running = false; }
  };
  run();
  setInterval(run, every);
}

document.addEventListener("DOMContentLoaded", start);

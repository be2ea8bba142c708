// Renders /status.json into index.html. Plain DOM code: no build step, no dependencies.
// Every value goes through textContent, never innerHTML: key names are user input.
"use strict";

const REFRESH_MS = 5000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}

function duration(secs) {
  let s = Math.floor(Number(secs));
  const d = Math.floor(s / 86400); s -= d * 86400;
  const h = Math.floor(s / 3600); s -= h * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (d) return d + "d " + h + "h";
  if (h) return h + "h " + m + "m";
  if (m) return m + "m " + s + "s";
  return s + "s";
}

function when(ts) {
  return ts ? new Date(ts * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "";
}

function setText(id, text) {
  document.getElementById(id).textContent = String(text);
}

function fillBody(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(...rows);
}

function masterRow(m, leader) {
  const tr = el("tr");
  tr.dataset.address = m.address;
  const addr = el("td");
  if (m.status_url) {
    const a = el("a", m.address);
    a.href = m.status_url;
    addr.appendChild(a);
  } else {
    addr.textContent = m.address;
  }
  tr.appendChild(addr);
  let role = "follower";
  if (!m.reachable) { role = "unreachable"; tr.className = "bad"; }
  else if (m.address === leader) { role = "leader"; tr.className = "leader"; }
  tr.appendChild(el("td", role, "role"));
  tr.appendChild(el("td", m.reachable ? duration(m.uptime_secs) : ""));
  tr.appendChild(el("td", m.version));
  tr.appendChild(el("td", m.reachable ? m.blob_count : "", "num"));
  tr.appendChild(el("td", m.reachable ? bytes(m.bytes_stored) : "", "num"));
  tr.appendChild(el("td", m.reachable ? bytes(m.disk_free) : "", "num"));
  tr.appendChild(el("td", m.reachable ? m.lag_blobs : "", "num"));
  // A master knows its own term only while it leads.
  tr.appendChild(el("td", m.reachable && m.is_leader ? m.epoch : "", "num"));
  return tr;
}

function blobRow(b) {
  const tr = el("tr", null, b.under_replicated ? "under" : "");
  tr.dataset.key = b.key;
  tr.appendChild(el("td", b.key, "key"));
  tr.appendChild(el("td", "v" + b.version, "num"));
  tr.appendChild(el("td", bytes(b.size), "num"));
  const rep = el("td", b.replication + " / " + b.replication_factor, "replication num");
  if (b.target < b.replication_factor) rep.title = "at most " + b.target + " with the masters there are";
  if (b.under_replicated) rep.appendChild(el("span", " under-replicated", "flag"));
  tr.appendChild(rep);
  tr.appendChild(el("td", b.holders.join(", "), "holders"));
  tr.appendChild(el("td", when(b.updated_at)));
  return tr;
}

function render(s) {
  setText("leader", s.leader || "none (election in progress)");
  document.getElementById("leader").className = s.leader ? "" : "bad";
  setText("epoch", s.epoch);
  setText("blob-count", s.blob_count);
  setText("under-replicated", s.under_replicated);
  document.getElementById("under-replicated").className = s.under_replicated ? "bad" : "";
  setText("this-master", s.this_master + " (blobha " + s.version + ")");
  setText("zookeeper", s.zookeeper.servers + " \u2013 " + s.zookeeper.state);
  setText("summary", s.masters.length + " masters, leader " + (s.leader || "none") +
          ", " + s.blob_count + " blobs, " + s.under_replicated + " under-replicated");

  fillBody("masters", s.masters.map((m) => masterRow(m, s.leader)));
  fillBody("blobs", s.blobs.map(blobRow));
  setText("blobs-note", s.blobs_truncated
    ? "Showing " + s.blobs.length + " of " + s.blob_count + " (under-replicated first)."
    : "Under-replicated blobs first.");
  fillBody("failovers", s.failovers.map((t) => {
    const tr = el("tr");
    tr.appendChild(el("td", t.epoch, "num"));
    tr.appendChild(el("td", t.leader));
    tr.appendChild(el("td", when(t.observed_at) + (t.at_start ? " (running when this master started)" : "")));
    return tr;
  }));

  const scrubSection = document.getElementById("scrub-section");
  if (s.scrub) {
    const dl = document.getElementById("scrub");
    dl.replaceChildren();
    for (const [name, value] of Object.entries(s.scrub)) {
      dl.appendChild(el("dt", name.replace(/_/g, " ")));
      dl.appendChild(el("dd", name === "bytes_verified" ? bytes(value) : value,
                        name === "corrupt_found" && value ? "bad" : ""));
    }
    scrubSection.hidden = false;
  } else {
    scrubSection.hidden = true;
  }

  const errors = document.getElementById("errors");
  errors.replaceChildren(...s.errors.map((e) => el("p", e, "bad")));
  errors.hidden = s.errors.length === 0;
  setText("updated", when(s.generated_at));
  document.body.dataset.loaded = "true";
}

async function refresh() {
  try {
    const r = await fetch("status.json", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const errors = document.getElementById("errors");
    errors.replaceChildren(el("p", "cannot load status.json: " + e.message, "bad"));
    errors.hidden = false;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);

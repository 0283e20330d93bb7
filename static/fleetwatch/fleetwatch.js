/* FleetWatch charts and live-region helpers.

   Charts: every element with data-chart reads JSON from its data-src and redraws in place
   every few seconds. "grid" is the dashboard's GPU health heatmap; "timeseries" draws one
   field of the JSON (data-field: {name: {x, y}}) as one line per name, with the fault and
   resolution marked when data-marks is set, stacked when data-stack is set. Elements sharing
   a data-src share one fetch.

   Live regions (htmx polling): a confirmation a person has opened (<details open>), or a
   field they are typing in, is not swapped away under them; the poll waits until it is
   closed. Focus is kept across swaps. The incident timeline's filter keeps the address in
   step with what it shows. */
(function () {
  "use strict";
  const config = { displaylogo: false, responsive: true };
  const COLORS = { ok: "#2e9d5b", unknown: "#9aa0a6", bad: "#d93025" };

  async function load(src) {
    const response = await fetch(src, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(response.status);
    return response.json();
  }

  function say(el, text) {
    window.Plotly.purge(el);
    el.textContent = text;
    el.dataset.state = "empty";
  }

  // Clear a message ("No samples...") before the first draw, never a drawn plot: emptying
  // the element under Plotly leaves Plotly.react diffing against a plot that is no longer
  // there, and the chart stays blank from the first refresh on.
  function clearMessage(el) {
    if (el.dataset.state !== "drawn") el.textContent = "";
  }

  function drawn(el) {
    // Plotly puts its toolbar's buttons inside the chart's element: an element with
    // role="img" may not hold controls (its children are presentational), a figure may.
    if (el.getAttribute("role") === "img") el.setAttribute("role", "figure");
    el.dataset.state = "drawn";
    el.dataset.draws = String(Number(el.dataset.draws || 0) + 1);  // refreshes, for tests
  }

  function drawGrid(el, d) {
    if (!d.z.length) { say(el, "No GPU telemetry yet for these nodes."); return; }
    clearMessage(el);
    const trace = {
      type: "heatmap", z: d.z, x: d.x, y: d.y, text: d.text, hoverinfo: "text",
      zmin: 0, zmax: 2, showscale: false, xgap: 2, ygap: 2,
      colorscale: [[0, COLORS.ok], [0.5, COLORS.unknown], [1, COLORS.bad]],
    };
    const layout = {
      margin: { l: 130, r: 10, t: 10, b: 30 }, height: Math.max(240, 18 * d.y.length + 50),
      yaxis: { autorange: "reversed", automargin: true }, paper_bgcolor: "rgba(0,0,0,0)",
    };
    window.Plotly.react(el, [trace], layout, config);
    el._fwNodes = d.nodes || [];
    if (!el._fwClick && el.dataset.nodeUrl) {
      // A cell opens its node's page (the node's cluster in the query, as the lists link).
      el._fwClick = true;
      el.on("plotly_click", (evt) => {
        const point = evt.points && evt.points[0];
        const row = point ? el._fwNodes[point.pointIndex[0]] : null;
        if (!row) return;
        window.location.href = el.dataset.nodeUrl.replace("__node__", encodeURIComponent(row[0])) +
          "?cluster=" + encodeURIComponent(row[1]);
      });
    }
    drawn(el);
    el.dataset.rows = String(d.y.length);
    if (d.truncated) el.title = `Showing ${d.y.length} of ${d.total} nodes: pick a group or use the Nodes page.`;
  }

  function drawSeries(el, d) {
    if (d.error) { say(el, d.error); return; }  // e.g. Prometheus unreachable: say so
    const data = d[el.dataset.field] || {};
    // An incident's chart says which line is the failed node and which its replacement
    // (d.roles): those are drawn bold and named so; the other nodes involved stay thin.
    const roles = d.roles || {};
    const traces = Object.entries(data).map(([name, s]) => {
      const role = roles[name];
      const marked = role === "failed" || role === "replacement";
      return {
        // A series of a point or two (a chart only just started) would draw no line: marks.
        type: "scatter", mode: s.x.length < 3 ? "lines+markers" : "lines", x: s.x, y: s.y,
        name: marked ? `${name} (${role})` : name,
        line: marked ? { width: 4, color: role === "failed" ? COLORS.bad : COLORS.ok }
          : { width: role ? 1.5 : 2 },
        opacity: role && !marked ? 0.6 : 1,
        // data-stack: the lines add up (the capacity page's GPUs by use).
        ...(el.dataset.stack ? { stackgroup: "one", line: { width: 0.5 } } : {}),
      };
    });
    if (!traces.length) { say(el, "No samples in this window."); return; }
    clearMessage(el);
    const marks = [];
    if (el.dataset.marks && d.fault_at) marks.push({ at: d.fault_at, label: "fault", color: COLORS.bad });
    if (el.dataset.marks && d.resolved_at) marks.push({ at: d.resolved_at, label: "resolved", color: COLORS.ok });
    const yaxis = { title: { text: el.dataset.ytitle || "" } };
    if (el.dataset.ymax) yaxis.range = [0, Number(el.dataset.ymax)];
    const layout = {
      margin: { l: 50, r: 10, t: 20, b: 40 }, height: 320, yaxis: yaxis,
      xaxis: { type: "date" }, paper_bgcolor: "rgba(0,0,0,0)", legend: { orientation: "h" },
      shapes: marks.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: m.at, x1: m.at,
        y0: 0, y1: 1, line: { color: m.color, dash: "dot" } })),
      annotations: marks.map((m) => ({ x: m.at, y: 1, yref: "paper", text: m.label,
        showarrow: false, font: { color: m.color } })),
    };
    window.Plotly.react(el, traces, layout, config);
    drawn(el);
    el.dataset.series = String(traces.length);
  }

  const DRAW = { grid: drawGrid, timeseries: drawSeries };
  const PERIOD = { grid: 5000, timeseries: 3000 };

  function start() {
    const bySrc = new Map();
    document.querySelectorAll("[data-chart]").forEach((el) => {
      if (!bySrc.has(el.dataset.src)) bySrc.set(el.dataset.src, []);
      bySrc.get(el.dataset.src).push(el);
    });
    bySrc.forEach((els, src) => {
      const run = async () => {
        try {
          const d = await load(src);
          els.forEach((el) => DRAW[el.dataset.chart](el, d));
        } catch (e) {
          els.forEach((el) => { el.dataset.error = String(e); });
        }
      };
      run();
      setInterval(run, PERIOD[els[0].dataset.chart] || 5000);
    });
  }

  // Do not poll a live region away from under an open confirmation, or from under a field
  // someone is typing in (the dashboard's group search).
  document.addEventListener("htmx:beforeRequest", (evt) => {
    const elt = evt.detail.elt;
    if (!elt || !elt.querySelector) return;
    // Only a poll waits: a request the person made (the timeline's filter) goes at once.
    if (!/\bevery\b/.test(elt.getAttribute("hx-trigger") || "")) return;
    const active = document.activeElement;
    const typing = active && elt.contains(active) && active.matches("input, select, textarea");
    if (elt.querySelector("details[open]") || typing) evt.preventDefault();
  });
  // Keep keyboard focus on the same control after a live swap.
  let focused = null;
  document.addEventListener("htmx:beforeSwap", () => {
    const a = document.activeElement;
    focused = a && a.id ? a.id : null;
  });
  document.addEventListener("htmx:afterSwap", () => {
    if (focused) {
      const el = document.getElementById(focused);
      if (el && el !== document.activeElement) el.focus({ preventScroll: true });
    }
  });

  // The incident timeline's filter redrew the timeline in place (htmx): the address and the
  // chart's range form carry the new filter, so a reload, a bookmark or a new range keeps it.
  document.addEventListener("htmx:afterSwap", (evt) => {
    const form = evt.detail.requestConfig && evt.detail.requestConfig.elt;
    if (!form || form.id !== "timeline-filter") return;
    const shown = new FormData(form).getAll("show");
    const params = new URLSearchParams(window.location.search);
    params.delete("show");
    shown.forEach((k) => params.append("show", k));
    const query = params.toString();
    history.replaceState(null, "", window.location.pathname + (query ? "?" + query : "") +
      window.location.hash);
    document.querySelectorAll("[data-timeline-shown]").forEach((holder) => {
      holder.replaceChildren(...shown.map((k) => {
        const input = document.createElement("input");
        Object.assign(input, { type: "hidden", name: "show", value: k });
        return input;
      }));
    });
  });

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
